"""Expert LoRA factors as the native backends take them (ktcore/include/ktcore/expert_lora.hpp).

A native backend computes a projection's LoRA ``out_r += scale * B_e (A_e in_r)`` inside its own tasks. It reads
each factor through an address and strides, rank-major: ``A [E, r, in]`` as ``[r, in]`` and ``B [E, out, r]`` as
``[r, out]`` per expert, so factors in PEFT's layout (often strided views) cross without copies. Factors may be fp32
or bf16; other dtypes are converted to fp32 first. Gradients come back in each factor's own dtype, and in its own
layout where it is a permuted dense tensor (PEFT's ``B`` views of fp32 parameters, ``_grad_buffer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ktcore.experts import ExpertLoRA, ExpertLoRAGrads

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in _NATIVE_DTYPES else t.float()


def _rank_major(t: torch.Tensor, rank_dim: int) -> tuple:
    """(address, bf16, expert stride, rank stride, column stride) of a 3-d factor whose rank is dimension rank_dim."""
    col_dim = 3 - rank_dim
    return t.data_ptr(), t.dtype == torch.bfloat16, t.stride(0), t.stride(rank_dim), t.stride(col_dim)


@dataclass
class NativeProjection:
    """One projection's factors (and, for backward, its gradient buffers) as an extension's ``LoraProjection``."""

    a: torch.Tensor  # [E, r, in]
    b: torch.Tensor  # [E, out, r]
    scale: float
    grad_a: Optional[torch.Tensor] = None
    grad_b: Optional[torch.Tensor] = None

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def native(self, ext):
        grads = (None, None)
        if self.grad_a is not None:
            grads = (_rank_major(self.grad_a, 1), _rank_major(self.grad_b, 2))
        return ext.LoraProjection(self.rank, float(self.scale), _rank_major(self.a, 1), _rank_major(self.b, 2), *grads)


def _grad_buffer(factor: torch.Tensor, alloc, pinned: bool) -> torch.Tensor:
    """A gradient buffer for ``factor`` in its own layout where the factor is a permuted dense tensor, else a
    contiguous one. PEFT's ``B`` is a permuted view of ``lora_B.weight`` (``[E, out, r]`` out of ``[out, r*E]``): its
    gradient in the same layout goes back through autograd's view nodes to the parameter as a view, where a
    contiguous one is copied into the parameter's layout by a strided single-thread torch copy (measured 0.85 ms per
    2 MB factor on the 2-core test host, most of what expert LoRA still cost the main thread). Factors staged from a
    GPU arrive as contiguous pinned copies (``CudaStaging.to_host``), so their gradients stay contiguous for the
    straight host-to-device copy."""
    order = sorted(range(factor.dim()), key=lambda d: -factor.stride(d))  # outermost dimension first
    sizes = [factor.shape[d] for d in order]
    dense = all(factor.stride(d) == math.prod(sizes[i + 1:]) for i, d in enumerate(order) if sizes[i] > 1)
    if factor.is_contiguous() or not dense:
        return alloc(factor.shape, dtype=factor.dtype, pin_memory=pinned)
    return alloc(sizes, dtype=factor.dtype, pin_memory=pinned).permute(*[order.index(d) for d in range(factor.dim())])


def native_projections(lora: Optional[ExpertLoRA], num_experts: int, hidden: int, inter: int,
                       offsets: Optional[torch.Tensor] = None, pinned: bool = False, zero_idle: bool = True
                       ) -> tuple[Optional[NativeProjection], Optional[NativeProjection]]:
    """(gate_up, down) of ``lora`` as NativeProjections (None where that projection has no LoRA), shapes checked.
    With the routing's expert offsets [E+1] (backward) it also allocates the gradient buffers, zeroed when some
    expert has no rows and ``zero_idle`` (a backend that writes only the gradients of the experts with rows; the
    AMX engines' gradient phases write the others' zeros themselves, in parallel); ``pinned`` (the backend's
    ``pin_outputs``) takes them from torch's caching host allocator, which hands the same pages out again step
    after step, where fresh pageable buffers of this size (tens of MB per layer) page-fault on every call."""
    if lora is None:
        return None, None
    out = []
    for name, a, b, scale, n_in, n_out in (("gate_up", lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale, hidden,
                                            2 * inter),
                                           ("down", lora.down_a, lora.down_b, lora.down_scale, inter, hidden)):
        if a is None or b is None:
            out.append(None)
            continue
        rank = a.shape[1] if a.dim() == 3 else -1
        if tuple(a.shape) != (num_experts, rank, n_in) or tuple(b.shape) != (num_experts, n_out, rank) or rank < 1:
            raise ValueError(f"expert LoRA {name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                             f"A [{num_experts}, r, {n_in}] and B [{num_experts}, {n_out}, r]")
        a, b = _native(a.detach()), _native(b.detach())
        proj = NativeProjection(a, b, scale)
        if offsets is not None:
            idle = zero_idle and bool((offsets[1:] == offsets[:-1]).any())
            alloc = torch.zeros if idle else torch.empty
            proj.grad_a, proj.grad_b = _grad_buffer(a, alloc, pinned), _grad_buffer(b, alloc, pinned)
        out.append(proj)
    return out[0], out[1]


def native_grads(lora: ExpertLoRA, gate_up: Optional[NativeProjection], down: Optional[NativeProjection]
                 ) -> ExpertLoRAGrads:
    """The gradients the backend wrote, in the dtypes of lora's own factors."""
    def back(g, like):
        return None if g is None else g.to(like.dtype)

    grads = ExpertLoRAGrads()
    if gate_up is not None:
        grads.gate_up_a, grads.gate_up_b = back(gate_up.grad_a, lora.gate_up_a), back(gate_up.grad_b, lora.gate_up_b)
    if down is not None:
        grads.down_a, grads.down_b = back(down.grad_a, lora.down_a), back(down.grad_b, lora.down_b)
    return grads
