"""The final adapter of a training run, for every frontend: written into ``output_dir`` as one unit, and a resume
that finds the run already finished trains nothing.

``output_dir`` also holds the checkpoints and logs, so the adapter cannot be renamed in as one directory.
Instead ``adapter_config.json`` (what makes a directory a PEFT adapter for PEFT, ``ktcore adapter verify`` and
``ktcore chat``) is the commit point: the new files are written and fsynced in a temp directory, the old
``adapter_config.json`` is removed, the other files are moved in, and the new ``adapter_config.json`` last. A kill
at any point leaves the old adapter whole, the new one whole, or no adapter (never new weights beside an old
config); a resume of the finished run then writes the final adapter from the last checkpoint. ktcore's marker
(``.ktcore-output.json``, command ``train``) lists the files of the save, so the next save removes those it does not
write again (a stale chat template would change how ``ktcore chat`` formats prompts) and nothing else. Every
final adapter carries ``kt_integrity.json`` (SHA-256 of its weights and config), checked on every load.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

from ..adapters.integrity import PEFT_FILES, write_sidecar
from ..files import (atomic_write_bytes, clean_leftovers, fault_point, fsync_path, sha256_file, temp_prefix,
                     usual_modes)
from ..outputs import MARKER
from ..plugins.threads import is_main_rank

COMMIT = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# what transformers' Trainer puts in a checkpoint beside the adapter (rng_state*.pth too): not part of the adapter
TRAINER_FILES = {"optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin"}


def _staging(out: Path) -> Path:
    clean_leftovers(out / "adapter")  # temp dirs of saves that were killed
    return Path(tempfile.mkdtemp(prefix=temp_prefix(out / "adapter"), dir=out))


def _published(out: Path) -> set[str]:
    """The files the previous final save in ``out`` listed in its marker (``ktcore.outputs.MARKER``): what ktcore
    wrote there, so what it may remove."""
    try:
        data = json.loads((out / MARKER).read_text(encoding="utf-8"))
        files = data["files"] if data.get("command") == "train" else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str) and "/" not in f and f not in (".", "..", MARKER)} \
        if isinstance(files, list) else set()


def publish_files(staged: Path, out: Path) -> None:
    """Move the (fsynced) files of ``staged`` into ``out``: ``adapter_config.json`` removed first (and the files
    of the previous save that this one does not write, e.g. an old chat template), moved in last; the marker lists
    the new files."""
    names = sorted(p.name for p in staged.iterdir() if p.is_file())
    stale = _published(out) - set(names)
    (out / COMMIT).unlink(missing_ok=True)
    fsync_path(out)
    fault_point("save_adapter:old-config-removed")
    for name in sorted(stale):
        if (out / name).is_file() and not (out / name).is_symlink():
            (out / name).unlink()
    for name in names:
        if name != COMMIT:
            os.replace(staged / name, out / name)
            fault_point("save_adapter:file-moved")
    atomic_write_bytes(out / MARKER, json.dumps({"command": "train", "complete": True, "files": names}).encode())
    os.replace(staged / COMMIT, out / COMMIT)
    fsync_path(out)


def publish_adapter(output_dir, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` writes the adapter's files into a temp dir of ``output_dir``; they get the usual modes, the
    integrity sidecar and an fsync, and are published as one unit (``publish_files``)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = _staging(out)
    try:
        write(tmp)
        usual_modes(tmp)  # safetensors writes adapter_model.safetensors 0600
        write_sidecar(tmp, PEFT_FILES)  # SHA-256 of the weights and config, checked on every load
        for path in tmp.iterdir():
            fsync_path(path)
        publish_files(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_adapter(model, tokenizer, output_dir) -> None:
    """PEFT's own save_pretrained (and the tokenizer's), published into ``output_dir`` as one unit."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    publish_adapter(output_dir, write)


def final_step(checkpoint, cfg) -> Optional[int]:
    """The checkpoint's step when it is the last step of the run ``cfg`` describes (max_steps, or the epochs the
    checkpoint was trained for when max_steps is not set), else None."""
    try:
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
        step, planned = int(state["global_step"]), int(state["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if cfg.max_steps and cfg.max_steps > 0:
        planned = cfg.max_steps
    elif float(state.get("num_train_epochs") or 0) not in (cfg.num_train_epochs, math.ceil(cfg.num_train_epochs)):
        return None  # more (or fewer) epochs asked for than the checkpoint's run planned (transformers rounds up)
    return step if step >= planned else None


def _same_adapter(a: Path, b: Path) -> bool:
    return all((a / n).is_file() and (b / n).is_file() and sha256_file(a / n) == sha256_file(b / n)
               for n in (COMMIT, WEIGHTS))


def finish_without_training(cfg, resume, frontend: str, trainer_files: Iterable[str] = ()) -> Optional[dict]:
    """When ``resume`` is the last step of the run: nothing to train. The final adapter is left as it is when it
    is that checkpoint's; otherwise (the final save was killed) it is written from the checkpoint (all but
    ``TRAINER_FILES``, ``trainer_files`` and ``rng_state*``). Says so in one line; returns the summary, or None
    when there is training to do."""
    if resume is None:
        return None
    step = final_step(resume, cfg)
    if step is None:
        return None
    out, ckpt = Path(cfg.output_dir), Path(resume)
    skip = TRAINER_FILES | set(trainer_files)
    if _same_adapter(ckpt, out):
        what = f"{out} holds its final adapter"
    elif not is_main_rank():  # launched on several ranks: rank 0 writes it
        what = "rank 0 writes its final adapter"
    else:
        def copy(tmp: Path) -> None:
            for path in ckpt.iterdir():
                if path.is_file() and path.name not in skip and not path.name.startswith("rng_state"):
                    shutil.copy2(path, tmp / path.name)

        publish_adapter(out, copy)
        what = f"its final adapter was missing or not this run's (a final save cut short): written from {ckpt.name}"
    if is_main_rank():
        print(f"ktcore: nothing to train: {ckpt} is the last step of this run (step {step}) and {what}; raise "
              "max_steps or num_train_epochs to train further", file=sys.stderr)
    return {"frontend": frontend, "stage": cfg.stage, "steps": step, "nothing_to_train": True,
            "resumed_from": str(ckpt), "output_dir": str(out)}
