"""Routed experts inside a checkpointed decoder layer: computed once, replayed when the layer is recomputed.

``ktcore.model.checkpointing`` checkpoints whole decoder layers; backward then re-runs a layer's forward to get
back what its other pieces saved. The routed experts' own backward needs nothing from that re-run (the backend
kept its activations, or recomputes them itself: ``kt_cpu_activation``), so the re-run must not compute them on
the CPU again: ``contexts`` (a ``context_fn`` for ``torch.utils.checkpoint``) records each experts call's output
during the forward and hands the same tensors back, in order, during the recomputation. A call that decides
something in its forward the recomputation must repeat (which experts are resident on the device:
``model/resident.py``) keeps it on the same tape (``keep``, ``kept``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

import torch

_state = threading.local()  # the recompute runs on autograd's thread, the forward on the caller's


class Tape:
    """The experts outputs of one checkpointed call, in call order."""

    def __init__(self):
        self.outputs: list[torch.Tensor] = []
        self.replayed = 0
        self.decisions: list = []
        self.repeated = 0


@contextmanager
def _active(mode: str, tape: Tape):
    previous = getattr(_state, "active", None)
    _state.active = (mode, tape)
    try:
        yield
    finally:
        _state.active = previous


def contexts():
    """(forward context, recompute context) sharing one tape: ``checkpoint(..., context_fn=contexts)``."""
    tape = Tape()
    return _active("record", tape), _active("replay", tape)


def _tape(mode: str) -> Optional[Tape]:
    """The tape of the checkpointed layer being run in ``mode`` ("record": its forward, "replay": its
    recomputation), else None."""
    active = getattr(_state, "active", None)
    return active[1] if active is not None and active[0] == mode else None


def recomputing() -> bool:
    """True while a checkpointed layer is being recomputed in backward."""
    return _tape("replay") is not None


def replayed() -> Optional[torch.Tensor]:
    """The recorded output of this experts call when a checkpointed layer is being recomputed, else None."""
    tape = _tape("replay")
    if tape is None:
        return None
    y = tape.outputs[tape.replayed]
    tape.replayed += 1
    return y


def record(y: torch.Tensor) -> None:
    """Keep ``y`` for the recomputation when called inside a checkpointed layer's forward."""
    tape = _tape("record")
    if tape is not None:
        tape.outputs.append(y)


def keep(decision) -> None:
    """Keep a call's decision for the recomputation when called inside a checkpointed layer's forward."""
    tape = _tape("record")
    if tape is not None:
        tape.decisions.append(decision)


def kept():
    """The decision the forward kept (``keep``) for this call while a checkpointed layer is recomputed, else None."""
    tape = _tape("replay")
    if tape is None:
        return None
    decision = tape.decisions[tape.repeated]
    tape.repeated += 1
    return decision
