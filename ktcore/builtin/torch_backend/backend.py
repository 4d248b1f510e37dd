"""The reference expert backend: a per-expert loop in PyTorch on the CPU.

It is deliberately plain. Forward builds the math with torch autograd when activations are to be saved, and
backward asks autograd for the gradients of that graph, so its gradients are correct by construction; other
backends are checked against it (``ktcore.testing.ExpertBackendContract``).
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
        num_experts = packed.num_experts
        inter = packed.down.shape[2]
        y = torch.zeros_like(x)
        valid = (topk_ids >= 0) & (topk_ids < num_experts)
        for e in torch.unique(topk_ids[valid]).tolist():
            tok, pos = torch.nonzero(topk_ids == e, as_tuple=True)
            xe = x[tok]
            gu = xe @ packed.gate_up[e].T
            if gu_a is not None:
                gu = gu + lora.gate_up_scale * ((xe @ gu_a[e].T) @ gu_b[e].T)
            h = act(gu[:, :inter]) * gu[:, inter:]
            out = h @ packed.down[e].T
            if d_a is not None:
                out = out + lora.down_scale * ((h @ d_a[e].T) @ d_b[e].T)
            y = y.index_add(0, tok, out * w[tok, pos].unsqueeze(1))
        return y

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
