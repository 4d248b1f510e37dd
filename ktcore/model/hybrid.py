"""``hybrid`` placement: one MoE layer's experts split between the CPU backend and the GPU stream.

The first ``n`` experts are packed into the CPU backend, the others kept for ``ExpertStream`` (``model/stream.py``),
so each side computes only its own experts' token-slots (the other side's slots carry the backend's and
transformers' "no expert" id) and the layer's output is the sum. On a GPU the backend's share is submitted first
and collected after the GPU's share is enqueued, so both run at once, forward and backward (as
``model/overlap.py`` does for shared experts). ``kt_hybrid_cpu_share`` sets ``n``: ``ktcore plan`` predicts the
share at which both sides finish together from measured rates. ``auto`` placement (``model/auto.py``) calls the
two parts with an ``n`` of each call's choosing, its backend holding more experts than the call gives it.
"""

from __future__ import annotations

import torch

from ..experts import ExpertsResult
from .peft_expert_lora import expert_lora_of
from .stream import streamed_forward


class HybridPoint:
    """Lets the CPU share's call return before the backend is done; ``collect`` makes its output valid."""

    def __init__(self):
        self._pending = None

    def __deepcopy__(self, memo):
        return self

    def defers(self, x) -> bool:
        return x.is_cuda

    def hold(self, job, y) -> None:
        self._pending = (job, y)

    def collect(self, y):
        if self._pending is None:  # not deferred (the model is on the CPU): y is complete
            return y
        job, y = self._pending
        self._pending = None
        return ExpertsResult.apply(job, y)


def cpu_experts(share: float, experts: int, name: str) -> int:
    """How many of a layer's experts the CPU computes; each side needs at least one."""
    n = round(share * experts)
    if not 1 <= n <= experts - 1:
        raise ValueError(f"{name}: kt_hybrid_cpu_share {share} gives the CPU {n} of {experts} experts; a hybrid "
                         f"layer needs 1 to {experts - 1} (use cpu or gpu_stream placement instead)")
    return n


def cpu_share(module, layer, n: int, packed: int, hidden_states, top_k_index, top_k_weights, lora):
    """The CPU backend's part of a split layer: experts ``..n`` of the ``..packed`` it holds (an auto layer's
    backend may hold more than it computes now); every other slot carries ``packed``, the backend's "no expert"
    id. Deferred on a GPU until ``layer.overlap.collect`` when the layer's overlap point defers."""
    ids = top_k_index if n == packed else torch.where(top_k_index < n, top_k_index, packed)
    if lora is not None and packed != module.num_experts:
        lora = lora.map(lambda t: t[:packed])
    return layer(hidden_states, ids, top_k_weights, lora)


def gpu_share(module, stream, index: int, n: int, hidden_states, top_k_index, top_k_weights, lora, on_fetched=None):
    """The stream's part of a split layer: experts ``n..``, ids counted from n (the CPU's slots: one past them)."""
    ids = top_k_index if n == 0 else torch.where(top_k_index < n, module.num_experts - n, top_k_index - n)
    return streamed_forward(module, stream, index, hidden_states, ids, top_k_weights, lora, first=n,
                            on_fetched=on_fetched)


def hybrid_forward(module, layer, n_cpu: int, stream, index: int, hidden_states, top_k_index, top_k_weights):
    lora = expert_lora_of(module)
    y_cpu = cpu_share(module, layer, n_cpu, n_cpu, hidden_states, top_k_index, top_k_weights, lora)
    y_gpu = gpu_share(module, stream, index, n_cpu, hidden_states, top_k_index, top_k_weights, lora)
    return layer.overlap.collect(y_cpu) + y_gpu
