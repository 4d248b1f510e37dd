"""Where a command may write its output: never over what ktcore did not write.

``ktcore export --out D`` and ``ktcore adapter convert SRC D`` write D through ``output_path``. A destination that
exists and is not empty is refused unless it is a complete earlier output of the same command (a directory with
ktcore's marker ``.ktcore-output.json`` naming that command, written last; for a single-file output, a file the
caller recognises as its own) and ``--overwrite`` was given. The new output is written whole beside D, and the
old one is removed only once the new one is in place (``ktcore.files.replace_path``), so a kill at any point leaves
the old or the new output at D; what a killed run left beside D is cleaned (or, where the old copy had been moved
aside, put back) by the next run to the same D.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from .errors import KtcoreError
from .files import (atomic_write_bytes, fault_point, fsync_path, fsync_tree, recover, remove_path, replace_path,
                    temp_prefix)

MARKER = ".ktcore-output.json"


def marker_command(path) -> Optional[str]:
    """The command named by the marker of the directory ``path``, or None when it has no readable marker."""
    try:
        data = json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("command") if isinstance(data, dict) and data.get("complete") is True else None


def check_destination(dst: Path, command: str, overwrite: bool,
                      owns_file: Optional[Callable[[Path], bool]] = None) -> None:
    """Raise a one-line KtcoreError unless ``command`` may write ``dst`` (see the module's docstring)."""
    if dst.is_dir() and not dst.is_symlink():
        if not any(dst.iterdir()):
            return
        ours = marker_command(dst)
        if ours is None:
            raise KtcoreError(f"{dst} is not empty and was not written by `ktcore {command}` (no {MARKER} in it); "
                              "ktcore never replaces what it did not write: choose a new or empty directory")
        if ours != command:
            raise KtcoreError(f"{dst} holds the output of `ktcore {ours}`, not of `ktcore {command}`; choose a new "
                              "or empty directory")
    elif dst.exists() or dst.is_symlink():
        if dst.is_symlink() or owns_file is None or not owns_file(dst):
            raise KtcoreError(f"{dst} exists and was not written by `ktcore {command}`; ktcore never replaces what "
                              "it did not write: choose another path")
    else:
        return
    if not overwrite:
        raise KtcoreError(f"{dst} holds an earlier output of `ktcore {command}`; pass --overwrite to replace it, "
                          "or choose another path")


@contextmanager
def output_path(dst, command: str, overwrite: bool = False, owns_file: Optional[Callable[[Path], bool]] = None):
    """Yield a path beside ``dst`` that does not exist yet; the body writes the command's output there (a
    directory or one file). On success it is fsynced, marked (directories) and put at ``dst``; on failure or a
    refusal nothing at ``dst`` changes."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    recover(dst)  # what a killed run to the same destination left beside it
    check_destination(dst, command, overwrite, owns_file)
    stage = dst.with_name(temp_prefix(dst) + "new")
    try:
        yield stage
        if not stage.exists():
            raise RuntimeError(f"ktcore {command} wrote nothing to {stage}")
        if stage.is_dir():
            atomic_write_bytes(stage / MARKER, json.dumps({"command": command, "complete": True}).encode())
        fsync_tree(stage) if stage.is_dir() else fsync_path(stage)
        fault_point("output:written")
        replace_path(stage, dst, dst.with_name(temp_prefix(dst) + "old"))
    finally:
        if stage.exists() or stage.is_symlink():
            remove_path(stage)
