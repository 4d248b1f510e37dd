"""ktcore behind LLaMA-Factory's model loading.

Three functions with the signatures that LLaMA-Factory releases with KT support call
(``load_kt_pretrained_model``, ``get_kt_peft_model``, ``load_kt_peft_model``), backed by ktcore, and
``loader_for(cfg)``: a drop-in for ``llamafactory.model.load_model`` that runs LLaMA-Factory's own config and
model patching around them, for the run ``cfg`` describes. ``ktcore_llamafactory.train.run`` installs it only
for the duration of one training run (see ``train.patched_llamafactory``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ktcore.config import ConfigError, KTConfig, TrainConfig


def _dtype(model_args) -> torch.dtype:
    """fp32 unless the run computes in bf16; fp16 training keeps fp32 weights (AMP casts), as in ktcore-trl."""
    compute = getattr(model_args, "compute_dtype", None)
    return torch.bfloat16 if compute == torch.bfloat16 else torch.float32


def _adapter_path(model_args) -> Optional[str]:
    value = getattr(model_args, "adapter_name_or_path", None)
    if not value:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ConfigError(f"adapter_name_or_path: ktcore loads one adapter onto CPU experts, got {len(value)}; "
                              "merge the others first (`ktcore export`)")
        value = value[0]
    return str(value)


def load_kt_pretrained_model(config, model_args, kt: Optional[KTConfig] = None, path=None):
    """The base model of ``model_args.model_name_or_path`` (or ``path``: a ``.gguf`` file whose metadata
    directory LLaMA-Factory read) built from the transformers ``config`` (as LLaMA-Factory patched it), with
    routed experts in the ktcore expert backend ``kt`` chooses (default: ``KTConfig()``, the best backend usable
    here)."""
    import ktcore

    return ktcore.load_model(path or model_args.model_name_or_path, kt, dtype=_dtype(model_args), hf_config=config,
                             progress=False)


def _arch_of(model):
    from ktcore.model.wrap import find_arch

    info = getattr(model, "ktcore", None)
    return info.arch if info is not None else find_arch(model.config)


def get_kt_peft_model(model, peft_kwargs: dict[str, Any]):
    """PEFT-wrap ``model`` with a LoRA from LLaMA-Factory's ``peft_kwargs`` (r, target_modules, lora_alpha,
    lora_dropout, ...). ``target_modules`` is resolved the ktcore way: ``all`` (or ``["all"]``) means the
    architecture's linear layers plus routed-expert LoRA on gate_up_proj/down_proj; ``experts`` in a list adds
    the routed experts. An explicit ``target_parameters`` is used as given."""
    from peft import LoraConfig, TaskType, get_peft_model

    from ktcore.model.peft_expert_lora import lora_targets, peft_wrapping

    kwargs = {k: v for k, v in dict(peft_kwargs).items() if v is not None}
    targets = kwargs.pop("target_modules", "all")
    params = kwargs.pop("target_parameters", None)
    for flag in ("use_dora", "use_rslora"):
        if kwargs.get(flag) is False:
            kwargs.pop(flag)
    if params is None:
        names = targets if isinstance(targets, str) else ",".join(targets)
        try:
            modules, params = lora_targets(model, _arch_of(model), names)
        except ValueError as exc:
            raise ConfigError(f"lora_target: {exc}") from exc
    else:
        modules = [targets] if isinstance(targets, str) else list(targets)
    if params and kwargs.get("use_dora"):
        raise ConfigError(f"use_dora: DoRA is not available for PEFT's target_parameters LoRA ({', '.join(params)}); "
                          "drop use_dora or leave those out of lora_target")
    if params and kwargs.get("lora_dropout"):
        raise ConfigError(f"lora_dropout={kwargs['lora_dropout']}: PEFT's target_parameters LoRA "
                          f"({', '.join(params)}) has no dropout; set lora_dropout: 0, or leave those out of "
                          "lora_target")
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, target_modules=modules or None,
                        target_parameters=params or None, **kwargs)
    with peft_wrapping(model):
        return get_peft_model(model, config)


def load_kt_peft_model(model_args, model, is_trainable: bool = True):
    """``model`` with the adapter in ``model_args.adapter_name_or_path`` (incl. expert LoRA) in any installed
    adapter format (a PEFT directory, a fused-expert directory, a GGUF LoRA file: ``ktcore.adapters`` sniffs it,
    verifies it against the local base model and hands PEFT a PEFT directory)."""
    from pathlib import Path

    from ktcore.adapters import load_adapter_into

    path = _adapter_path(model_args)
    if path is None:
        raise ConfigError("adapter_name_or_path is not set: nothing to load")
    base = getattr(model_args, "model_name_or_path", None)  # a Hub ID or absent: checked without the base
    base = Path(base) if base and Path(base).exists() else None
    return load_adapter_into(model, path, base=base, is_trainable=is_trainable)


def _peft_kwargs(finetuning_args) -> dict:
    target = finetuning_args.lora_target
    return {
        "r": finetuning_args.lora_rank,
        "target_modules": target if isinstance(target, str) else ",".join(target),
        "lora_alpha": finetuning_args.lora_alpha,
        "lora_dropout": finetuning_args.lora_dropout,
        "use_rslora": finetuning_args.use_rslora,
        "use_dora": finetuning_args.use_dora,
        "modules_to_save": finetuning_args.additional_target,
    }


def loader_for(cfg: TrainConfig):
    """``llamafactory.model.load_model`` with ktcore building the model (its experts in the backend
    ``cfg.kt`` chooses when ``cfg.use_kt``) and its LoRA.

    LLaMA-Factory's own steps run around it: ``patch_config`` (dtype, attention implementation, MoE aux loss),
    ``patch_model`` (gradient checkpointing, generation config), ``register_autoclass``, the fp32 upcast of
    trainable parameters and its parameter report.
    """

    def load_model(tokenizer, model_args, finetuning_args, is_trainable: bool = False, add_valuehead: bool = False):
        from llamafactory.model import loader, patcher
        from transformers import AutoModelForCausalLM

        from ktcore.config import resolve_model_path
        from ktcore.model.lm_loss import chunk_lm_loss
        from ktcore.frontends.skeleton import count_parameters, describe_parameters
        from ktcore.weights.model_path import is_gguf, load_plain_model

        if add_valuehead:
            raise ConfigError("the llamafactory frontend runs stage sft and dpo (no value-head models)")
        if finetuning_args.finetuning_type != "lora":
            raise ConfigError(f"finetuning_type {finetuning_args.finetuning_type!r}: ktcore trains LoRA only")
        init_kwargs = loader._get_init_kwargs(model_args)
        config = loader.load_config(model_args)
        patcher.patch_config(config, tokenizer, model_args, init_kwargs, is_trainable)
        weights = resolve_model_path(cfg, hub_ok=True)  # a .gguf: LLaMA-Factory read its metadata directory
        if cfg.use_kt:
            model = load_kt_pretrained_model(config, model_args, cfg.kt, path=weights if is_gguf(weights) else None)
            if is_trainable:
                chunk_lm_loss(model)  # the trainers read only the loss of a training forward
        elif is_gguf(weights):
            model = load_plain_model(weights, dtype=_dtype(model_args), config=config)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config,
                                                         dtype=_dtype(model_args),
                                                         trust_remote_code=model_args.trust_remote_code)
        patcher.patch_model(model, tokenizer, model_args, is_trainable, add_valuehead=False)
        loader.register_autoclass(config, model, tokenizer)

        if _adapter_path(model_args) is not None:
            model = load_kt_peft_model(model_args, model, is_trainable=is_trainable)
        elif is_trainable:
            model = get_kt_peft_model(model, _peft_kwargs(finetuning_args))

        if is_trainable:
            if not finetuning_args.pure_bf16:
                for param in filter(lambda p: p.requires_grad, model.parameters()):
                    param.data = param.data.to(torch.float32)
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()
        print(describe_parameters(count_parameters(model)), flush=True)
        return model

    return load_model
