"""Routed-expert LoRA in PEFT's own ``target_parameters`` layout.

PEFT wraps each targeted expert parameter in a ``ParamWrapper`` and, while it runs, parametrizes it as
``W + scaling * lhs @ rhs``. ktcore's placeholders turn that into a record of the factors
(``ktcore.model.placeholder``); this module reads them back as an ``ExpertLoRA`` for the backend, and builds the
PEFT ``LoraConfig`` for a training YAML.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import torch

from ..experts import ExpertLoRA
from . import host_lora
from .placeholder import is_placeholder


@contextlib.contextmanager
def peft_wrapping(model=None):
    """Around a call that makes a PeftModel (``get_peft_model``, ``PeftModel.from_pretrained``, a TRL trainer
    given a ``peft_config``) on the ktcore ``model``.

    PEFT (0.21.2, ``PeftModel.__init__``) reads ``model.is_gradient_checkpointing``, which transformers 5.2x
    deprecated in favour of ``is_activation_checkpointing``, so every wrap printed a FutureWarning no ktcore user
    can act on. Exactly that warning, only inside the call; PEFT gets the same answer (the property still returns
    ``is_activation_checkpointing``). Afterwards, with ``kt_expert_lora_device: host``, the expert LoRA the call
    created moves to host memory (``host_lora.keep_on_host``) before anything (a trainer's optimizer or its
    resumed state) is created beside it on the GPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
    if model is not None and host_lora.wants_host(model):
        host_lora.keep_on_host(model)


def _factors(module, name: str):
    """(B [E, out, r], A [E, r, in], scaling) of the LoRA on ``module.<name>``, or None."""
    param = getattr(module, name)
    if not is_placeholder(param) or param.lora is None:
        return None
    lhs, rhs, scaling = param.lora
    if getattr(module, "is_transposed", False):  # stored [E, in, out]: lhs = A^T, rhs = B^T
        return rhs.transpose(-1, -2), lhs.transpose(-1, -2), scaling
    return lhs, rhs, scaling


def expert_lora_of(module) -> Optional[ExpertLoRA]:
    """The active expert LoRA of one experts module (None when PEFT is absent or adapters are disabled)."""
    gate_up, down = _factors(module, "gate_up_proj"), _factors(module, "down_proj")
    if gate_up is None and down is None:
        return None
    lora = ExpertLoRA()
    if gate_up is not None:
        b, a, scale = gate_up
        if not getattr(module, "is_concatenated", True):  # interleaved [g0, u0, g1, u1, ...] rows
            b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale = a, b, float(scale)
    if down is not None:
        b, a, scale = down
        lora.down_a, lora.down_b, lora.down_scale = a, b, float(scale)
    return lora


def lora_targets(model, arch, lora_target: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for ``lora_target`` ('all', or a comma list of names).

    'all' means the architecture's linear layers plus the routed experts; 'experts' in a list means the
    routed experts' gate_up_proj and down_proj.
    """
    present = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    experts_suffix = arch.experts_module.split("{layer}.", 1)[-1]
    expert_params = [f"{experts_suffix}.{p}" for p in arch.expert_lora_parameters]
    wanted = [t.strip() for t in lora_target.split(",") if t.strip()]
    if wanted == ["all"]:
        return [t for t in arch.default_lora_targets if t in present], expert_params
    modules, params = [], []
    for target in wanted:
        if target == "experts":
            params += expert_params
        elif target in arch.expert_lora_parameters:
            params.append(f"{experts_suffix}.{target}")
        elif target in present:
            modules.append(target)
        else:
            choices = sorted(present | {"all", "experts"})
            raise ValueError(f"lora_target {target!r} matches no linear layer of this model; choose from "
                             f"{', '.join(choices)}")
    return modules, params


def lora_config_for(model, arch, cfg):
    """A peft.LoraConfig for a TrainConfig ``cfg`` on ``model`` (arch: its ArchSpec)."""
    from peft import LoraConfig

    modules, params = lora_targets(model, arch, cfg.lora_target)
    if params and cfg.lora_dropout:
        raise ValueError(f"lora_dropout={cfg.lora_dropout}: PEFT's expert LoRA (target_parameters) has no dropout; "
                         "set lora_dropout: 0, or leave the experts out of lora_target")
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.effective_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=modules or None, target_parameters=params or None, task_type="CAUSAL_LM")
