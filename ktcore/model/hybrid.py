"""``hybrid`` placement: one MoE layer's experts split between the CPU backend and the GPU stream.

The first ``n`` experts are packed into the CPU backend, the others kept for ``ExpertStream`` (``model/stream.py``),
so each side computes only its own experts' token-slots (the other side's slots carry the backend's and
transformers' "no expert" id) and the layer's output is the sum. On a GPU the backend's share is submitted first
and collected after the GPU's share is enqueued, so both run at once, forward and backward (as
``model/overlap.py`` does for shared experts). ``kt_hybrid_cpu_share`` sets ``n``: ``ktcore plan`` predicts the
share at which both sides finish together from measured rates.
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


def hybrid_forward(module, layer, n_cpu: int, stream, index: int, hidden_states, top_k_index, top_k_weights):
    lora = expert_lora_of(module)
    on_cpu = top_k_index < n_cpu
    cpu_lora = None if lora is None else lora.map(lambda t: t[:n_cpu])
    y_cpu = layer(hidden_states, torch.where(on_cpu, top_k_index, n_cpu), top_k_weights, cpu_lora)
    gpu_ids = torch.where(on_cpu, module.num_experts - n_cpu, top_k_index - n_cpu)
    y_gpu = streamed_forward(module, stream, index, hidden_states, gpu_ids, top_k_weights, lora, first=n_cpu)
    return layer.overlap.collect(y_cpu) + y_gpu
