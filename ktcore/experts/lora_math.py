"""Expert LoRA in fp32 torch math, for backends whose kernels compute only the frozen base projections.

A projection of expert e with LoRA adds ``out_r += scale * B_e (A_e x_r)`` for the rows r routed to e. The
rows are sorted by expert: expert e owns rows ``offsets[e]:offsets[e+1]``. Factors are ``A [E, r, in]`` and
``B [E, out, r]`` (PEFT's layout, as in :class:`ktcore.experts.ExpertLoRA`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ktcore.experts import ExpertLoRA


def has_gate_up(lora: Optional[ExpertLoRA]) -> bool:
    """True when lora carries both gate/up factors."""
    return lora is not None and lora.gate_up_a is not None and lora.gate_up_b is not None


def has_down(lora: Optional[ExpertLoRA]) -> bool:
    """True when lora carries both down factors."""
    return lora is not None and lora.down_a is not None and lora.down_b is not None


def segments(offsets: torch.Tensor) -> list:
    """(e, r0, r1) for every expert e with rows, from the expert offsets [E+1]."""
    off = offsets.tolist()
    return [(e, off[e], off[e + 1]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def _rows(x: torch.Tensor, rows: Optional[torch.Tensor], r0: int, r1: int) -> torch.Tensor:
    return (x[r0:r1] if rows is None else x[rows[r0:r1].long()]).float()


def lora_forward(x: torch.Tensor, rows: Optional[torch.Tensor], offsets: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, scale: float) -> torch.Tensor:
    """The LoRA term of every expert row, fp32 [R, out]. Row r's input is ``x[rows[r]]`` (rows: the token of
    each row), or ``x[r]`` when rows is None."""
    R = int(offsets[-1])
    out = torch.zeros(R, b.shape[1], dtype=torch.float32)
    for e, r0, r1 in segments(offsets):
        out[r0:r1] = scale * ((_rows(x, rows, r0, r1) @ a[e].float().T) @ b[e].float().T)
    return out


def lora_backward(x: torch.Tensor, rows: Optional[torch.Tensor], grad: torch.Tensor, offsets: torch.Tensor,
                  a: torch.Tensor, b: torch.Tensor, scale: float, row_weight: Optional[torch.Tensor] = None):
    """Gradients of the LoRA term given ``grad`` = dL/d(out) per row [R, out].

    Returns (grad_x [R, in] fp32, to add to the input gradient of the rows, da, db in a's and b's dtypes).
    row_weight [R]: ``out`` is still multiplied per row by it downstream and ``grad`` is taken before that
    multiplication; da/db include the weight, grad_x does not (the caller weights its whole input gradient).
    """
    gx = torch.empty(grad.shape[0], a.shape[2], dtype=torch.float32)
    da, db = torch.zeros(a.shape, dtype=torch.float32), torch.zeros(b.shape, dtype=torch.float32)
    for e, r0, r1 in segments(offsets):
        xe, ge = _rows(x, rows, r0, r1), grad[r0:r1].float()
        ae, be = a[e].float(), b[e].float()
        q = ge @ be  # [m, r]
        gx[r0:r1] = scale * (q @ ae)
        if row_weight is not None:
            w = row_weight[r0:r1].float().unsqueeze(1)
            q, ge = w * q, w * ge
        da[e] = scale * (q.T @ xe)
        db[e] = scale * (ge.T @ (xe @ ae.T))
    return gx, da.to(a.dtype), db.to(b.dtype)
