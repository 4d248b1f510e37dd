"""Routed experts computed on the model's device (streamed layers, a hybrid layer's GPU share, resident experts):
transformers' grouped experts kernel, and beside it the same computation with expert LoRA kept factorised.

PEFT's parametrisation of a LoRA'd target parameter is the weight ``W + scaling * B @ A``. Built that way on the
device, each call makes a layer-sized tensor per projection (from an fp32 ``B @ A``), and autograd differentiates
through it: backward computes the full weight gradient ``dW = x^T g`` (as many FLOPs as the projection itself) only
to reduce it to ``dA`` and ``dB``, and rounds the small delta into the bf16 weight. Here each projection is
``x W^T + scaling * (x A^T) B^T`` per expert through grouped GEMMs instead: the frozen weights get no gradient, the
factors' gradients come from rank-sized GEMMs, and the delta keeps its own precision. The same function of PEFT's
factors, so adapters are unchanged. Without LoRA (or with the adapters disabled) transformers' own function runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

GPU_EXPERTS_IMPLEMENTATION = "grouped_mm"  # transformers' own, for experts computed on the model's device
RANK_MULTIPLE = 8  # grouped GEMMs need rows of 16 bytes: bf16 ranks padded with zero rows to a multiple of 8


class WeightsOf:
    """The experts module as transformers' kernel sees it, with the device weights in place of the placeholders;
    a hybrid layer's GPU share is a slice of the experts, the others' slots carry transformers' expert-parallel
    sentinel (an id past the slice: no expert)."""

    def __init__(self, module, gate_up, down):
        sliced = gate_up.shape[0] != module.num_experts
        # experts modules of transformers 5.25 carry _is_expert_parallel; those of 5.17 do not
        self.__dict__.update(_module=module, gate_up_proj=gate_up, down_proj=down, num_experts=gate_up.shape[0],
                             _is_expert_parallel=sliced or getattr(module, "_is_expert_parallel", False))

    def __getattr__(self, name):
        return getattr(self._module, name)


def device_experts(module, weights: tuple, factors: tuple, hidden_states, top_k_index, top_k_weights):
    """The experts of ``module`` whose device ``weights`` are (gate_up [E, 2I, H], down [E, H, I]), with
    ``factors`` per projection: None, or PEFT's ``(B [E, out, r], A [E, r, in], scaling)`` of those E experts.
    ``top_k_index`` counts from the first of them; an id of E or more: no expert."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    view = WeightsOf(module, *weights)
    if all(f is None for f in factors):
        return ALL_EXPERTS_FUNCTIONS[GPU_EXPERTS_IMPLEMENTATION](view, hidden_states, top_k_index, top_k_weights)
    if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False):
        raise NotImplementedError(f"{type(module).__name__}: expert LoRA on the model's device is written for "
                                  "HF's [E, out, in] experts without biases")
    return _grouped_with_lora(view, factors, hidden_states, top_k_index, top_k_weights)


def _grouped_with_lora(experts: WeightsOf, factors, hidden_states, top_k_index, top_k_weights):
    """transformers' ``grouped_mm_experts_forward`` (sort the token-slots by expert, one grouped GEMM per
    projection, gate, routing weights, sum per token) with each projection's LoRA term beside its GEMM."""
    top_k = top_k_index.size(-1)
    ids, order = torch.sort(top_k_index.reshape(-1))  # the "no expert" ids (E and past) sort last
    rows = hidden_states[order // top_k]
    counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=experts.num_experts, min=0,
                         max=experts.num_experts - 1)  # histc: no host synchronisation (bincount reads the max)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    # the GEMMs leave rows past the last offset (no expert) unwritten: zero them going in (that zeroes their
    # input gradient coming out) and at the end; between, only the next GEMM reads them, and only its own rows
    idle = (ids >= experts.num_experts).unsqueeze(-1) if experts._is_expert_parallel else None
    if idle is not None:
        rows = rows.masked_fill(idle, 0.0)
    gate_up, down = factors
    mid = _projection(rows, experts.gate_up_proj, gate_up, offsets)
    mid = _gated(experts, mid)
    out = _projection(mid, experts.down_proj, down, offsets)
    if idle is not None:
        out = out.masked_fill(idle, 0.0)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    unsorted = torch.empty_like(out).index_copy_(0, order, out)  # a gather's backward, not index_add's atomics
    return unsorted.view(-1, top_k, out.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def _gated(experts: WeightsOf, gate_up):
    gate = getattr(experts, "_apply_gate", None)  # the module's own (transformers 5.17 on): act(gate) * up
    if gate is not None:
        return gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _projection(rows, weight, factors: Optional[tuple], offsets):
    """``rows`` (sorted by expert) times each expert's ``weight`` [E, out, in] transposed, plus its LoRA term."""
    out = _grouped_mm(rows, weight.transpose(-2, -1), offsets)
    if factors is None:
        return out
    b, a, scale = factors
    a, b = a.to(rows.dtype).contiguous(), b.to(rows.dtype).contiguous()  # PEFT's may be strided views
    pad = -a.shape[1] % RANK_MULTIPLE
    if pad:  # zero rows of A and columns of B: the same product
        a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
    low = _grouped_mm(rows, a.transpose(-2, -1), offsets) * scale  # [S, r]: the scaling on the small side
    return out + _grouped_mm(low, b.transpose(-2, -1), offsets)


def _grouped_mm(rows, weight, offsets):
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10
    return grouped_mm(rows.to(weight.dtype), weight, offs=offsets)
