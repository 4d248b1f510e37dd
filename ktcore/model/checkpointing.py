"""Activation checkpointing for a ktcore model that never runs the CPU experts' forward twice.

transformers' own gradient checkpointing re-runs whole decoder layers in backward, routed experts included,
which would compute every CPU expert forward twice. ``checkpoint_non_experts`` checkpoints whole decoder layers
as well (``torch.utils.checkpoint``, non-reentrant), so a layer keeps only its input for backward, but the
routed experts' output of the forward is kept and handed back when backward recomputes the layer
(``ktcore.experts.replay``): the CPU computes each layer's experts once, and they keep or recompute their own
activations as ``kt_cpu_activation`` says. For DeepSeek-V2-Lite at 2,048 tokens an MoE layer then keeps about
21 MiB (its input and the experts' output, 8 MiB each), where checkpointing its attention alone kept 89 MiB
(float32 inputs of the layer norms, the LoRA'd shared experts' float32 inputs and intermediates;
benchmarks/RESULTS.md, "Peak GPU memory with gradient checkpointing"). The recompute is the layer's GPU work
once more, run in backward; the shared experts' part of it while the CPU computes the layer's expert backward.
The TRL frontend and ``ktcore bench train`` use it.
"""

from __future__ import annotations

import re

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")


def checkpoint_non_experts(model) -> list[str]:
    """Checkpoint every decoder layer of a ktcore model, its routed experts computed once (call before PEFT);
    returns the names of the wrapped layers."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from ..experts import replay

    def wrap(module):
        forward = module.forward

        def checkpointed(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, context_fn=replay.contexts, **kwargs)
            return forward(*args, **kwargs)

        module.forward = checkpointed  # this instance only: names, state_dict, hooks and PEFT targets are unchanged

    wrapped = []
    for name, module in model.named_modules():
        if _DECODER_LAYER.search(name):
            wrap(module)
            wrapped.append(name)
    model.config.use_cache = False  # a KV cache updated inside a checkpointed block would be updated twice
    return wrapped
