"""Writing files whole or not at all, and their SHA-256.

Every artifact ktcore writes (adapters, merged models, training checkpoints) is written into a temp file or
directory next to its destination, fsynced and renamed into place, so a process killed half way leaves the
old artifact or none, never half of one; readers check sizes and hashes before trusting what they read.

Temp names are ``.<name>.ktcore-<pid>.<...>``: a later atomic write to the same destination removes those whose
process is gone (``clean_leftovers``), and never anything named otherwise. ``KTCORE_FAULT_AT=<step>`` makes the
process SIGKILL itself at that step (``fault_point``), so tests can kill a write at every rename.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

from .errors import ConfigError, KtcoreError


def fsync_path(path) -> None:
    """fsync a file, or a directory (its entries); file systems that cannot fsync a directory are let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


FAULT_ENV = "KTCORE_FAULT_AT"


def fault_point(step: str) -> None:
    """Test hook: SIGKILL this process here when ``KTCORE_FAULT_AT`` names ``step`` (kill tests at every rename)."""
    if os.environ.get(FAULT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def temp_prefix(path) -> str:
    """The prefix of every temp name ktcore gives a sibling of ``path`` in this process."""
    return f".{Path(path).name}.ktcore-{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def leftovers(path) -> list[Path]:
    """Temp siblings of ``path`` that ktcore named (``.<name>.ktcore-<pid>.``, also nested temp names built on
    such a name) and whose process is gone."""
    path = Path(path)
    pattern = re.compile(r"^\.+" + re.escape(path.name) + r"\.ktcore-(\d+)\.")
    if not path.parent.is_dir():
        return []
    found = []
    for p in path.parent.iterdir():
        m = pattern.match(p.name)
        if m and (int(m.group(1)) != os.getpid() and not _alive(int(m.group(1)))):
            found.append(p)
    return sorted(found)


def remove_path(path) -> None:
    """Remove a file or a directory tree (a symlink itself, never what it points to)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_leftovers(path) -> None:
    """Remove what killed atomic writes to ``path`` left beside it (see ``leftovers``)."""
    for p in leftovers(path):
        remove_path(p)


def exchange(a, b) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_path(new, dst, old) -> None:
    """Put ``new`` (a file or directory) at ``dst``; an existing ``dst`` is removed only once ``new`` is in place.

    Atomic where the system can swap two paths: a kill leaves the old or the new copy at ``dst``. Elsewhere the
    old copy is first renamed to ``old`` (``recover`` puts it back if the process dies before the new one
    is in place)."""
    new, dst, old = Path(new), Path(dst), Path(old)
    if dst.exists() or dst.is_symlink():
        if exchange(new, dst):  # new is at dst, the old copy at new's name
            fsync_path(dst.parent)
            fault_point("replace:swapped")
            remove_path(new)
            return
        remove_path(old)  # a stale copy of an earlier write (dst itself is still there)
        os.replace(dst, old)
        fault_point("replace:moved-old")
        os.replace(new, dst)
        fsync_path(dst.parent)
        remove_path(old)
    else:
        os.replace(new, dst)
        fsync_path(dst.parent)


def recover(dst) -> None:
    """Undo what killed atomic writes to ``dst`` left: put back an old copy ``replace_path`` had moved aside when
    ``dst`` is missing (the newest), then remove the rest of ``leftovers(dst)``."""
    dst = Path(dst)
    moved = re.compile(r"^\." + re.escape(dst.name) + r"\.ktcore-\d+\.old$")
    olds = [p for p in leftovers(dst) if moved.match(p.name)]
    if olds and not (dst.exists() or dst.is_symlink()):
        os.replace(max(olds, key=lambda p: p.stat().st_mtime), dst)
        fsync_path(dst.parent)
    clean_leftovers(dst)


@contextmanager
def atomic_file(path):
    """Yield a temp file's path next to ``path``; on success fsync it and rename it to ``path`` (then fsync the
    directory). On failure nothing at ``path`` changes."""
    path = Path(path)
    recover(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        fsync_path(tmp)
        fault_point("atomic_file:written")
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


@contextmanager
def atomic_dir(dst, replaces: Iterable[str]):
    """Yield a temp directory next to ``dst``; on success fsync its files and put it at ``dst`` (``replace_path``:
    the old copy is removed only once the new one is in place).

    An existing non-empty ``dst`` is replaced only when it holds one of the file names ``replaces`` (an
    artifact of the kind being written), and only then; on failure nothing at ``dst`` changes. (The commands
    are stricter: ``ktcore.outputs.output_path``.)"""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    recover(dst)
    if dst.exists() and not dst.is_dir():
        raise KtcoreError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not any((dst / n).exists() for n in replaces):
        raise KtcoreError(f"{dst} exists and holds something other than an adapter or model; choose a new or empty "
                          "directory (it would be replaced)")
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(dst), suffix=".tmp", dir=dst.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        usual_modes(tmp)
        fault_point("atomic_dir:written")
        replace_path(tmp, dst, dst.with_name(temp_prefix(dst) + "old"))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def fsync_tree(root) -> None:
    """fsync every file and directory under ``root`` (and ``root``)."""
    root = Path(root)
    for p in sorted(root.rglob("*")):
        if p.is_file() or p.is_dir():
            fsync_path(p)
    fsync_path(root)


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def inside_root(root, name, what: str) -> Path:
    """``root / name`` when that stays inside ``root`` (after resolving ``..`` and symlinks), else a one-line
    error naming ``what`` (the entry and the file it is in). Keeps file names read from a file (an index's
    weight_map, a dataset_info.json file_name) from reaching outside the directory they belong to."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise ConfigError(f"{what}: {name!r} must be a relative path inside {root}; refusing")
    path = Path(root) / name
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise ConfigError(f"{what}: {name!r} leaves {root}; refusing (only files inside it are read)")
    return path


def usual_modes(root) -> None:
    """Give every file under ``root`` mode 0644 and every directory 0755, as ``atomic_file`` does: writers that
    go through a temp file (safetensors' ``save_file``, ``mkstemp``) leave 0600, unreadable to the group."""
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
