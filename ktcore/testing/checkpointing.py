"""The gradient checkpointing ktcore did before issue 19, for the tests and benchmarks that compare with it."""

from __future__ import annotations


def checkpoint_attention_only(model) -> list[str]:
    """Checkpoint each attention block and dense MLP of a ktcore model on its own (call before PEFT), as
    ``checkpoint_non_experts`` did before it checkpointed whole layers; returns the wrapped modules' names."""
    import torch
    from torch.utils.checkpoint import checkpoint

    info = model.ktcore
    experts = set(info.layers) | set(info.on_gpu)
    wrapped = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("self_attn", "mlp") or ".layers." not in f".{name}":
            continue
        if any(e == name or e.startswith(name + ".") for e in experts):
            continue

        def checkpointed(*args, _module=module, _forward=module.forward, **kwargs):
            if _module.training and torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        module.forward = checkpointed
        wrapped.append(name)
    model.config.use_cache = False
    return wrapped
