"""Activation checkpointing for a ktcore model that never runs the CPU experts' forward twice.

transformers' own gradient checkpointing re-runs whole decoder layers in backward, routed experts included,
which would compute every CPU expert forward twice. ``checkpoint_non_experts`` wraps only the modules without
routed experts (attention blocks, dense MLPs) in ``torch.utils.checkpoint`` (non-reentrant); the experts keep
following ``kt_cpu_activation``. The TRL frontend and ``ktcore bench train`` use it.
"""

from __future__ import annotations


def checkpoint_non_experts(model) -> list[str]:
    """Checkpoint the attention blocks and dense MLPs of a ktcore model (call before PEFT); returns the names of
    the wrapped modules."""
    import torch
    from torch.utils.checkpoint import checkpoint

    info = getattr(model, "ktcore", None)
    expert_names = set(info.layers) | set(info.on_gpu) if info is not None else set()

    def holds_experts(name: str) -> bool:
        return any(e == name or e.startswith(name + ".") for e in expert_names)

    def wrap(module):
        forward = module.forward

        def checkpointed(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        module.forward = checkpointed  # this instance only: names, state_dict and PEFT targets are unchanged

    wrapped = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("self_attn", "mlp") and ".layers." in f".{name}" and not holds_experts(name):
            wrap(module)
            wrapped.append(name)
    model.config.use_cache = False  # a KV cache updated inside a checkpointed block would be updated twice
    return wrapped
