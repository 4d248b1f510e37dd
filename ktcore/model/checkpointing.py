"""Activation checkpointing for a ktcore model that never runs the CPU experts' forward twice.

transformers' own gradient checkpointing re-runs whole decoder layers in backward, routed experts included,
which would compute every CPU expert forward twice. ``checkpoint_non_experts`` wraps, each in its own
``torch.utils.checkpoint`` (non-reentrant), every piece of a decoder layer that holds no routed experts: the
attention block, the dense MLP, the layer norms and the shared experts of an MoE block; the routed experts keep
following ``kt_cpu_activation``. A wrapped piece keeps only its input for backward, which it recomputes: for
DeepSeek-V2-Lite at 2,048 tokens a layer norm would keep its input in float32 (16 MiB, against 8 MiB in bf16)
and the LoRA'd shared experts 41 MiB (against their 8 MiB input), so an MoE layer keeps about 40 MiB instead of
89 MiB (measured: benchmarks/RESULTS.md, "Peak GPU memory with gradient checkpointing"). The recompute is GPU
work the size of the pieces' forward; the shared experts' runs while the CPU computes that layer's expert
backward. The TRL frontend and ``ktcore bench train`` use it.
"""

from __future__ import annotations

import re

_LAYER_CHILD = re.compile(r"(^|\.)layers\.\d+\.([^.]+)$")  # a direct child of a decoder layer


def checkpoint_non_experts(model) -> list[str]:
    """Checkpoint the attention blocks, dense MLPs, layer norms and shared experts of a ktcore model (call
    before PEFT); returns the names of the wrapped modules."""
    import torch
    from torch.utils.checkpoint import checkpoint

    info = getattr(model, "ktcore", None)
    expert_names = set(info.layers) | set(info.on_gpu) if info is not None else set()
    shared_pattern = info.arch.shared_experts_module if info is not None else ""
    layers = model.config.get_text_config().num_hidden_layers
    shared = {shared_pattern.format(layer=i) for i in range(layers)} if shared_pattern else set()

    def holds_experts(name: str) -> bool:
        return any(e == name or e.startswith(name + ".") for e in expert_names)

    def wrap(module):
        forward = module.forward

        def checkpointed(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        module.forward = checkpointed  # this instance only: names, state_dict, hooks and PEFT targets are unchanged

    wrapped = []
    for name, module in model.named_modules():
        child = _LAYER_CHILD.search(name)
        leaf = child.group(2) if child else ""
        if (leaf in ("self_attn", "mlp") or "norm" in leaf or name in shared) and not holds_experts(name):
            wrap(module)
            wrapped.append(name)
    model.config.use_cache = False  # a KV cache updated inside a checkpointed block would be updated twice
    return wrapped
