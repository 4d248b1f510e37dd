"""The TRL frontend's final adapter: ``ktcore.frontends.final`` (published into ``output_dir`` as one unit, with
the integrity sidecar and ktcore's marker; a resume at the end of a finished run trains nothing), with this
frontend's checkpoint manifest counted among the trainer's files."""

from __future__ import annotations

from typing import Optional

from ktcore.frontends.final import save_adapter  # noqa: F401 - part of this module's API (train.py, tests)
from ktcore.frontends.final import finish_without_training as _finish

from .checkpoints import MANIFEST


def finish_without_training(cfg, resume) -> Optional[dict]:
    """``ktcore.frontends.final.finish_without_training`` for TRL runs (their checkpoints hold ``MANIFEST``)."""
    return _finish(cfg, resume, "trl", trainer_files=(MANIFEST,))
