"""Writing files whole or not at all, and their SHA-256.

Every artifact ktcore writes (adapters, merged models, training checkpoints) is written into a temp file or
directory next to its destination, fsynced and renamed into place, so a process killed half way leaves the
old artifact or none, never half of one; readers check sizes and hashes before trusting what they read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

from .errors import KtcoreError


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


@contextmanager
def atomic_file(path):
    """Yield a temp file's path next to ``path``; on success fsync it and rename it to ``path`` (then fsync the
    directory). On failure nothing at ``path`` changes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_bytes(path, data: bytes) -> None:
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


@contextmanager
def atomic_dir(dst, replaces: Iterable[str]):
    """Yield a temp directory next to ``dst``; on success fsync its files and rename it to ``dst``.

    An existing non-empty ``dst`` is replaced only when it holds one of the file names ``replaces`` (an
    artifact of the kind being written), and only then; on failure nothing at ``dst`` changes."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and not dst.is_dir():
        raise KtcoreError(f"{dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not any((dst / n).exists() for n in replaces):
        raise KtcoreError(f"{dst} exists and holds something other than an adapter or model; choose a new or empty "
                          "directory (it would be replaced)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        usual_modes(tmp)
        old = None
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
        os.replace(tmp, dst)
        fsync_path(dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def usual_modes(root) -> None:
    """Give every file under ``root`` mode 0644 and every directory 0755, as ``atomic_file`` does: writers that
    go through a temp file (safetensors' ``save_file``, ``mkstemp``) leave 0600, unreadable to the group."""
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
