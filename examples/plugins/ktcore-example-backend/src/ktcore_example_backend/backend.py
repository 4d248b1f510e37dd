"""The example backend: the op boundary of ``ktcore.experts`` written out by hand.

For each expert e and the tokens routed to it (rows ``tok``, top-k slots ``slot``)::

    gu  = x W_gu[e]^T  (+ s1 (x A1[e]^T) B1[e]^T)        gate = gu[:, :I], up = gu[:, I:]
    h   = silu(gate) * up
    o   = h W_down[e]^T (+ s2 (h A2[e]^T) B2[e]^T)
    y[tok] += w[tok, slot] * o

Backward applies the chain rule to the same steps in reverse. A native backend does exactly this, only
in C++ with its own kernels; this one uses torch matmuls on the CPU in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ktcore.experts import ExpertBackendBase, ExpertLoRA, ExpertLoRAGrads, ExpertWeights


@dataclass
class ExamplePacked:
    gate: torch.Tensor  # [E, I, H] fp32
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]


@dataclass
class _Route:
    """What forward keeps for backward, for one expert."""

    expert: int
    tok: torch.Tensor  # token rows routed to the expert
    slot: torch.Tensor  # their top-k slots
    x: torch.Tensor  # [n, H]
    w: torch.Tensor  # [n] routing weights
    gate: torch.Tensor  # [n, I] pre-activation
    up: torch.Tensor  # [n, I]
    h: torch.Tensor  # [n, I]
    out: torch.Tensor  # [n, H] expert output before the routing weight


@dataclass
class _Ctx:
    routes: list = field(default_factory=list)
    tokens: int = 0
    topk_shape: tuple = ()
    topk_dtype: torch.dtype = torch.float32


def _silu_and_grad(t: torch.Tensor):
    s = torch.sigmoid(t)
    return t * s, s * (1 + t * (1 - s))


class ExampleExpertBackend(ExpertBackendBase):
    """``ExpertBackendBase`` gives ``config`` (a KTConfig) and the async submit_*/wait methods."""

    name = "example"

    def pack(self, weights: ExpertWeights, activation: str = "silu") -> ExamplePacked:
        weights.validate()
        if activation != "silu":
            raise ValueError(f"the example backend implements silu only, not {activation!r}")
        if self.config.kt_expert_weight_format not in ("auto", "fp32"):
            raise ValueError("the example backend packs fp32 experts; set kt_expert_weight_format to auto or fp32")
        return ExamplePacked(*(t.detach().to("cpu", torch.float32).contiguous()
                               for t in (weights.gate, weights.up, weights.down)))

    def forward(self, packed: ExamplePacked, x, topk_ids, topk_weights, lora: ExpertLoRA | None = None,
                save: bool = False):
        xf, wf = x.float(), topk_weights.float()
        y = torch.zeros_like(xf)
        ctx = _Ctx(tokens=x.shape[0], topk_shape=tuple(topk_weights.shape), topk_dtype=topk_weights.dtype)
        inter = packed.gate.shape[1]
        for e in range(packed.num_experts):
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # ids outside [0, E) never match
            if tok.numel() == 0:
                continue
            xe, we = xf[tok], wf[tok, slot]
            gate, up = xe @ packed.gate[e].T, xe @ packed.up[e].T
            if lora is not None and lora.gate_up_a is not None:
                delta = lora.gate_up_scale * (xe @ lora.gate_up_a[e].float().T) @ lora.gate_up_b[e].float().T
                gate, up = gate + delta[:, :inter], up + delta[:, inter:]
            h = _silu_and_grad(gate)[0] * up
            out = h @ packed.down[e].T
            if lora is not None and lora.down_a is not None:
                out = out + lora.down_scale * (h @ lora.down_a[e].float().T) @ lora.down_b[e].float().T
            y.index_add_(0, tok, out * we[:, None])
            if save:
                ctx.routes.append(_Route(e, tok, slot, xe, we, gate, up, h, out))
        return y.to(x.dtype), (ctx if save else None)

    def backward(self, packed: ExamplePacked, ctx: _Ctx, grad_y, lora: ExpertLoRA | None = None):
        gy = grad_y.float()
        grad_x = torch.zeros(ctx.tokens, packed.gate.shape[2])
        grad_w = torch.zeros(ctx.topk_shape)
        lora = lora or ExpertLoRA()
        grads = [None if t is None else torch.zeros(t.shape) for t in lora.tensors()]
        ga1, gb1, ga2, gb2 = grads
        for r in ctx.routes:
            e, gye = r.expert, gy[r.tok]
            grad_w[r.tok, r.slot] = (gye * r.out).sum(1)  # d y / d w = expert output
            go = gye * r.w[:, None]  # gradient at the expert output
            gh = go @ packed.down[e]
            if lora.down_a is not None:
                a2, b2, s2 = lora.down_a[e].float(), lora.down_b[e].float(), lora.down_scale
                g_mid = go @ b2  # [n, r]
                gh = gh + s2 * g_mid @ a2
                gb2[e] += s2 * go.T @ (r.h @ a2.T)
                ga2[e] += s2 * g_mid.T @ r.h
            act, dact = _silu_and_grad(r.gate)
            g_gate, g_up = gh * r.up * dact, gh * act
            gx = g_gate @ packed.gate[e] + g_up @ packed.up[e]
            if lora.gate_up_a is not None:
                a1, b1, s1 = lora.gate_up_a[e].float(), lora.gate_up_b[e].float(), lora.gate_up_scale
                g_gu = torch.cat([g_gate, g_up], dim=1)  # [n, 2I], gate rows first as in PEFT's layout
                g_mid = g_gu @ b1
                gx = gx + s1 * g_mid @ a1
                gb1[e] += s1 * g_gu.T @ (r.x @ a1.T)
                ga1[e] += s1 * g_mid.T @ r.x
            grad_x.index_add_(0, r.tok, gx)
        lora_grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, lora.tensors())]
        return grad_x.to(grad_y.dtype), grad_w.to(ctx.topk_dtype), ExpertLoRAGrads(*lora_grads)
