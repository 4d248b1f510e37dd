"""The reference expert backend: PyTorch on the CPU.

It is deliberately plain. Forward builds the math with torch autograd when activations are to be saved, and
backward asks autograd for the gradients of that graph, so its gradients are correct by construction; other
backends are checked against it (``ktcore.testing.ExpertBackendContract``). The routed rows are sorted by expert;
the frozen projections run one matmul per expert with rows, the expert LoRA two batched matmuls per projection
over all experts at once (rows padded to the busiest expert's count), so LoRA costs no Python loop over experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ktcore.experts import ExpertBackendBase, ExpertLoRA, ExpertLoRAGrads, ExpertWeights, activation_function

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class TorchPacked:
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    activation: str

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class _Rows:
    """The (token, slot) pairs routed to an expert, sorted by expert (stably): row r is slot ``slot[r]`` of token
    ``token[r]``; ``segments`` lists (e, r0, r1) for every expert with rows."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int):
        valid = (topk_ids >= 0) & (topk_ids < num_experts)
        token, slot = torch.nonzero(valid, as_tuple=True)
        expert = topk_ids[token, slot]
        order = torch.argsort(expert, stable=True)
        self.token, self.slot, self.expert = token[order], slot[order], expert[order]
        counts = torch.bincount(self.expert, minlength=num_experts)
        starts = torch.cumsum(counts, 0) - counts
        self.segments = [(e, s, s + c) for e, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())) if c]
        # row r's place in an [E, M] padding of the rows, M = the busiest expert's count
        self.width = max(1, int(counts.max()))
        self.padded_index = self.expert * self.width + (torch.arange(len(order)) - starts[self.expert])
        self.num_experts = num_experts

    def project(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``weights[e] rows[r]`` for every row r of expert e (one matmul per expert with rows)."""
        parts = [rows[r0:r1] @ weights[e].T for e, r0, r1 in self.segments]
        return torch.cat(parts) if parts else rows.new_zeros(0, weights.shape[1])

    def lora(self, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``B[e] (A[e] rows[r])`` for every row r of expert e, as two batched matmuls over all experts."""
        padded = rows.new_zeros(self.num_experts * self.width, rows.shape[1])
        padded = padded.index_copy(0, self.padded_index, rows).view(self.num_experts, self.width, -1)
        delta = torch.bmm(torch.bmm(padded, a.transpose(1, 2)), b.transpose(1, 2))
        return delta.reshape(self.num_experts * self.width, -1)[self.padded_index]


@dataclass
class _Saved:
    y: torch.Tensor
    inputs: list  # [x, w, *lora leaves] (None where absent)


class TorchExpertBackend(ExpertBackendBase):
    name = "torch"

    def pack(self, weights: ExpertWeights, activation: str = "silu") -> TorchPacked:
        weights.validate()
        activation_function(activation)
        fmt = self.config.kt_expert_weight_format
        if fmt not in ("auto", *_DTYPES):
            raise ValueError(f"the torch backend packs fp32 or bf16 experts, not {fmt!r}; "
                             "set kt_config.kt_expert_weight_format to auto, fp32 or bf16")
        dtype = weights.gate.dtype if fmt == "auto" else _DTYPES[fmt]
        gate_up = torch.cat([weights.gate, weights.up], dim=1).to("cpu", dtype).contiguous()
        down = weights.down.to("cpu", dtype).contiguous()
        return TorchPacked(gate_up, down, activation)

    def unpack(self, packed: TorchPacked, ids: Optional[torch.Tensor] = None) -> ExpertWeights:
        gate_up, down = (t if ids is None else t.index_select(0, ids) for t in (packed.gate_up, packed.down))
        inter = packed.down.shape[2]
        return ExpertWeights(gate_up[:, :inter], gate_up[:, inter:], down)

    def forward(self, packed: TorchPacked, x, topk_ids, topk_weights, lora: Optional[ExpertLoRA] = None,
                save: bool = False):
        dtype = packed.gate_up.dtype
        with torch.set_grad_enabled(save):
            leaves = [x.to(dtype), topk_weights.to(dtype)]
            lora_leaves = list(lora.tensors()) if lora else [None] * 4
            leaves += [None if t is None else t.to(dtype) for t in lora_leaves]
            if save:
                leaves = [None if t is None else t.detach().requires_grad_(True) for t in leaves]
            y = self._compute(packed, leaves, topk_ids, lora)
        return y.detach().to(x.dtype), (_Saved(y, leaves) if save else None)

    def _compute(self, packed: TorchPacked, leaves, topk_ids, lora):
        x, w, gu_a, gu_b, d_a, d_b = leaves
        act = activation_function(packed.activation)
        inter = packed.down.shape[2]
        rows = _Rows(topk_ids, packed.num_experts)
        xr = x[rows.token]
        gu = rows.project(xr, packed.gate_up)
        if gu_a is not None:
            gu = gu + lora.gate_up_scale * rows.lora(xr, gu_a, gu_b)
        h = act(gu[:, :inter]) * gu[:, inter:]
        out = rows.project(h, packed.down)
        if d_a is not None:
            out = out + lora.down_scale * rows.lora(h, d_a, d_b)
        return torch.zeros_like(x).index_add(0, rows.token, out * w[rows.token, rows.slot].unsqueeze(1))

    def backward(self, packed: TorchPacked, ctx: _Saved, grad_y, lora: Optional[ExpertLoRA] = None):
        wanted = [t for t in ctx.inputs if t is not None]
        grads = torch.autograd.grad(ctx.y, wanted, grad_y.to(ctx.y.dtype), allow_unused=True)
        by_leaf = iter(grads)
        out = []
        for leaf in ctx.inputs:
            if leaf is None:
                out.append(None)
                continue
            g = next(by_leaf)
            out.append(torch.zeros_like(leaf) if g is None else g)
        grad_x, grad_w, *lora_grads = out
        lora_dtypes = [None if t is None else t.dtype for t in (lora.tensors() if lora else [None] * 4)]
        lora_grads = [None if g is None else g.to(dt) for g, dt in zip(lora_grads, lora_dtypes)]
        return grad_x.to(grad_y.dtype), grad_w, ExpertLoRAGrads(*lora_grads)
