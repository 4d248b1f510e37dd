"""Crash-safe checkpoints for the TRL frontend.

transformers writes a checkpoint file by file into ``output_dir/checkpoint-N``; a process killed half way
leaves a directory that ``get_last_checkpoint`` would happily resume from. Here a checkpoint is written into
``output_dir/.tmp-checkpoint-N`` (a name transformers never resumes from), every file is fsynced, a manifest
``ktcore_checkpoint.json`` (each file's size and SHA-256) is written last, and only then is the directory
renamed to ``checkpoint-N``. Resuming validates the manifest first: a checkpoint with a missing, truncated or
altered file is refused with one line saying which file and what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

from ktcore.config import ConfigError
from ktcore.files import atomic_write_bytes, fsync_path, replace_path, sha256_file, usual_modes

MANIFEST = "ktcore_checkpoint.json"
PREFIX = "checkpoint"
STAGING_PREFIX = ".tmp-"
_STEP = re.compile(rf"^{PREFIX}-(\d+)$")


def seal(staging: Path, step: int) -> None:
    """fsync every file of ``staging`` and write its manifest (last, so its presence means 'complete')."""
    files = {}
    usual_modes(staging)  # safetensors writes the adapter weights 0600
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        fsync_path(path)
        files[str(path.relative_to(staging))] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    atomic_write_bytes(staging / MANIFEST, json.dumps({"format": 1, "step": step, "files": files}, indent=1).encode())
    for sub in {p.parent for p in staging.rglob("*")} | {staging}:
        fsync_path(sub)


def publish(staging: Path, final: Path) -> None:
    """Put a sealed staging directory at its final name; an older checkpoint of that step is removed only once the
    new one is in place (``ktcore.files.replace_path``)."""
    replace_path(staging, final, final.with_name(f"{STAGING_PREFIX}old-{final.name}"))


def problem(checkpoint: Path) -> Optional[str]:
    """Why ``checkpoint`` cannot be resumed from, or None when its manifest checks out."""
    manifest = checkpoint / MANIFEST
    if not checkpoint.is_dir():
        return "it is not a directory"
    if not manifest.is_file():
        return (f"it has no {MANIFEST}, so it was never completed (a save interrupted mid-write, or not written by "
                "ktcore)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"
    for name, meta in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"file {name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"file {name} is truncated ({path.stat().st_size} of {meta['bytes']} bytes)"
        if sha256_file(path) != meta["sha256"]:
            return f"file {name} does not match its checksum"
    return None


def checkpoints(output_dir) -> list[tuple[int, Path]]:
    """(step, path) of every ``checkpoint-N`` directory in ``output_dir``, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def clean_staging(output_dir) -> None:
    """Remove leftovers of saves that were interrupted (``.tmp-checkpoint-*``, ``.tmp-old-checkpoint-*``). Where a
    kill inside ``publish`` left ``checkpoint-N`` missing, a complete copy of it (the new one, else the old) is
    put back first; a complete copy is never deleted while ``checkpoint-N`` is missing."""
    out = Path(output_dir)
    if not out.is_dir():
        return
    for path in sorted(out.iterdir()):
        m = re.match(rf"^{re.escape(STAGING_PREFIX)}(?:old-)?({PREFIX}-\d+)$", path.name)
        if not (m and path.is_dir()):
            continue
        final = out / m.group(1)
        copies = [out / f"{STAGING_PREFIX}{final.name}" / final.name, out / f"{STAGING_PREFIX}old-{final.name}"]
        if not final.exists():
            for copy in copies:
                if copy.is_dir() and problem(copy) is None:
                    os.replace(copy, final)
                    fsync_path(out)
                    print(f"ktcore: put back {final.name} from {copy.relative_to(out)} (a save was cut short)",
                          file=sys.stderr)
                    break
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)


def resolve_resume(value, output_dir, where: str) -> Optional[str]:
    """The checkpoint directory to resume from for ``resume_from_checkpoint`` (path, true/false or None).

    ``true``: the newest *complete* checkpoint in output_dir (incomplete ones are skipped with a note).
    A path: that checkpoint, refused with one line when it is incomplete.
    """
    if value in (None, False, "", "false", "False"):
        return None
    if value is True or value in ("true", "True"):
        found = checkpoints(output_dir)
        for step, path in reversed(found):
            why = problem(path)
            if why is None:
                return str(path)
            print(f"ktcore: skipping {path}: {why}", file=sys.stderr)
        have = f" ({len(found)} found, none complete)" if found else ""
        raise ConfigError(f"{where}: resume_from_checkpoint: true, but output_dir {str(output_dir)!r} has no complete "
                          f"checkpoint-N directory{have}; train without resume_from_checkpoint, or point it at "
                          "a checkpoint directory")
    path = Path(str(value))
    if not path.exists():
        raise ConfigError(f"{where}: resume_from_checkpoint {str(path)!r} does not exist; point it at a checkpoint-N "
                          "directory in output_dir, or set it to true for the latest")
    why = problem(path)
    if why is not None:
        complete = [str(p) for _, p in checkpoints(path.parent) if p != path and problem(p) is None]
        hint = f"resume from {complete[-1]} instead" if complete else "start the run again without it"
        raise ConfigError(f"{where}: resume_from_checkpoint {str(path)!r} is incomplete: {why}; it cannot be resumed "
                          f"from; {hint} (or delete it)")
    return str(path)


def rotate(output_dir, limit: Optional[int], keep: Optional[str] = None) -> None:
    """Keep the newest ``limit`` complete checkpoints (and ``keep``)."""
    if not limit:
        return
    found = checkpoints(output_dir)
    for _, path in found[: max(0, len(found) - limit)]:
        if keep is None or Path(keep).resolve() != path.resolve():
            shutil.rmtree(path, ignore_errors=True)
