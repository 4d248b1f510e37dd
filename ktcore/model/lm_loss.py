"""The causal-LM training loss without the ``[tokens, vocab]`` logits.

transformers' models compute the loss from the full logits, upcast to float32: at 2,048 tokens and DeepSeek's
102,400-token vocabulary that is 0.4 GiB of bf16 logits, 0.8 GiB of float32 logits and 0.8 GiB of log-softmax
kept for backward, and as much again for the gradients at the start of backward, on top of every activation
the layers saved (the step's peak). ``chunk_lm_loss`` gives a model a forward that, when it trains on labels,
runs the model's own forward for everything but the logits (``logits_to_keep`` selects none), then the
LM head and the cross-entropy over a few hundred tokens at a time, each chunk under ``torch.utils.checkpoint``
so its logits are recomputed in backward instead of kept. The loss is transformers' (``ForCausalLMLoss``: the
logits in the model's dtype, upcast to float32, labels shifted by one, ``-100`` ignored, summed over
``num_items_in_batch`` or averaged over the labelled tokens), plus the MoE load-balancing term where the model
adds one; the logits are not returned then (None). Evaluation, generation and calls without labels run the model's
forward unchanged, so do models it was not given to. ``ktcore train`` gives it to a ``use_kt`` model in both
frontends (TRL's trainers bypass it where TRL has its own fused LM head), and so does ``ktcore bench train``.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 1 << 24  # logits per chunk: 64 MiB in float32, whatever the vocabulary (163 tokens of 102,400)
IGNORE_INDEX = -100


def chunked_lm_loss(hidden: torch.Tensor, lm_head, labels: torch.Tensor, num_items_in_batch=None,
                    shift_labels: torch.Tensor = None) -> torch.Tensor:
    """transformers' causal-LM loss of ``lm_head(hidden)`` against ``labels`` (``shift_labels``: already shifted),
    computed ``CHUNK_ELEMENTS // vocab`` tokens at a time."""
    if shift_labels is None:
        hidden, shift_labels = hidden[:, :-1], labels[:, 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    vocab = lm_head.weight.shape[0]
    rows = max(1, CHUNK_ELEMENTS // vocab)

    def chunk_loss(h, t):
        return F.cross_entropy(lm_head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")

    total = sum(checkpoint(chunk_loss, hidden[i:i + rows], targets[i:i + rows], use_reentrant=False)
                for i in range(0, hidden.shape[0], rows))
    if num_items_in_batch is None:
        return total / (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def chunk_lm_loss(model) -> None:
    """Give ``model`` (a transformers causal LM, before PEFT wraps it) the chunked training loss (module
    docstring). The forward keeps its signature, so trainers see the same arguments."""
    if getattr(model, "_ktcore_chunked_loss", False):
        return
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, labels=None, **kwargs):
        chunked = (labels is not None and self.training and torch.is_grad_enabled()
                   and kwargs.get("return_dict", True) is not False and "logits_to_keep" not in kwargs)
        if not chunked:
            return original(*args, labels=labels, **kwargs)
        captured = []
        hook = self.get_decoder().register_forward_hook(lambda module, inputs, out: captured.append(out[0]))
        try:
            out = original(*args, logits_to_keep=torch.empty(0, dtype=torch.long, device=self.device), **kwargs)
        finally:
            hook.remove()
        loss = chunked_lm_loss(captured[-1], self.get_output_embeddings(), labels,
                               kwargs.get("num_items_in_batch"), kwargs.get("shift_labels"))
        aux_loss = out.get("aux_loss")
        if aux_loss is not None:  # added by transformers' MoE models only when there are labels
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return type(out)(**{**out, "loss": loss, "logits": None})

    model.forward = types.MethodType(forward, model)
    model._ktcore_chunked_loss = True
