"""``ktcore train CFG.yaml --frontend llamafactory``: LLaMA-Factory's own ``run_exp`` trains the model.

The YAML is LLaMA-Factory's format plus ``use_kt``/``kt_*``. ``run(cfg)`` hands LLaMA-Factory its own keys
(the kt ones stay with ktcore) and runs ``llamafactory.train.tuner.run_exp``: LLaMA-Factory's data pipeline,
templates, collators, ``CustomSeq2SeqTrainer`` / ``CustomDPOTrainer``, checkpointing, logging and plots.

LLaMA-Factory 0.9.5 has no extension point for the model loader (its own ``use_kt`` path requires the
KTransformers packages ``kt-kernel``/``transformers-kt``/``accelerate-kt``), so for the duration of ``run`` —
and only then — ``patched_llamafactory`` rebinds two names:

* ``load_model`` in the LLaMA-Factory modules that imported it (``llamafactory.model``, the sft and dpo
  workflows, ``trainer_utils`` for an explicit ``ref_model``) -> ``integration.load_model``, which keeps
  LLaMA-Factory's config/model patching and lets ktcore build the model and the LoRA (expert LoRA included);
* the trainer classes the workflows instantiate -> subclasses that record every optimizer step's exact
  loss (the logged loss is rounded to 4 decimals) and the tokens seen.

Everything is restored when ``run`` returns or raises. The DPO reference is LLaMA-Factory's own: with
``ref_model`` unset it runs the policy under ``disable_adapter()``, which turns expert LoRA off too
(tests/test_llamafactory_train.py proves it).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from ktcore.config import ConfigError, TrainConfig
from ktcore.frontends import peak_memory

from . import integration

STAGES = ("sft", "dpo")
IGNORE_INDEX = -100
TRUE = ("1", "true", "yes", "y", "on")


def _where(cfg) -> str:
    return cfg.source or "<config>"


def apply_env(cfg: TrainConfig) -> TrainConfig:
    """``USE_KT=1`` in the environment means ``use_kt: true`` (as in LLaMA-Factory's KT releases)."""
    if os.environ.get("USE_KT", "").strip().lower() in TRUE and not cfg.use_kt:
        cfg = replace(cfg, use_kt=True)
    return cfg


def check_config(cfg: TrainConfig) -> None:
    where = _where(cfg)
    if cfg.stage not in STAGES:
        raise ConfigError(f"{where}: stage {cfg.stage!r} is not supported by the llamafactory frontend "
                          f"(it runs: {', '.join(STAGES)})")
    if cfg.precompute_ref_log_probs:
        raise ConfigError(f"{where}: precompute_ref_log_probs: LLaMA-Factory computes the DPO reference on the fly "
                          "(policy with adapters disabled); drop the key or use --frontend trl")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError(f"{where}: bf16 and fp16 are both true; choose one")
    model_dir = Path(cfg.model_name_or_path)
    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        raise ConfigError(f"{where}: model_name_or_path {cfg.model_name_or_path!r} is not a model directory with "
                          "config.json; fix the path (for examples/demo.yaml run `ktcore demo` first)")
    if cfg.adapter_name_or_path and not (Path(cfg.adapter_name_or_path) / "adapter_config.json").is_file():
        raise ConfigError(f"{where}: adapter_name_or_path {cfg.adapter_name_or_path!r} has no adapter_config.json; "
                          "point it at a directory written by save_pretrained")
    info = Path(cfg.dataset_dir) / "dataset_info.json"
    if not info.is_file():
        raise ConfigError(f"{where}: dataset_dir {cfg.dataset_dir!r} has no dataset_info.json; point dataset_dir at "
                          "the folder holding it")
    if not cfg.dataset:
        raise ConfigError(f"{where}: dataset is required: a comma list of names from {info}")


def llamafactory_args(cfg: TrainConfig) -> dict:
    """The YAML as LLaMA-Factory's ``run_exp`` arguments (its own keys; ktcore keeps the kt ones)."""
    import torch

    args = {
        "model_name_or_path": cfg.model_name_or_path,
        "trust_remote_code": cfg.trust_remote_code,
        "stage": cfg.stage,
        "do_train": cfg.do_train,
        "finetuning_type": cfg.finetuning_type,
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.effective_lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "lora_target": cfg.lora_target,
        "dataset": cfg.dataset,
        "dataset_dir": cfg.dataset_dir,
        "cutoff_len": cfg.cutoff_len,
        "overwrite_cache": cfg.overwrite_cache,
        "output_dir": cfg.output_dir,
        "logging_steps": cfg.logging_steps,
        "logging_first_step": True,
        "save_steps": cfg.save_steps,
        "plot_loss": cfg.plot_loss,
        "save_only_model": cfg.save_only_model,
        "report_to": cfg.report_to,
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "learning_rate": cfg.learning_rate,
        "num_train_epochs": cfg.num_train_epochs,
        "max_steps": cfg.max_steps,
        "lr_scheduler_type": cfg.lr_scheduler_type,
        "warmup_ratio": cfg.warmup_ratio,
        "warmup_steps": cfg.warmup_steps,
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        "optim": cfg.optim,
        "seed": cfg.seed,
        "data_seed": cfg.seed,
        "bf16": cfg.bf16,
        "fp16": cfg.fp16,
        "dataloader_num_workers": cfg.dataloader_num_workers,
        "ddp_timeout": cfg.ddp_timeout,
        # gradient checkpointing as the YAML says (LLaMA-Factory's default is on, reentrant, which would run
        # the CPU experts' forward twice)
        "disable_gradient_checkpointing": not cfg.gradient_checkpointing,
        "use_reentrant_gc": False,
        # ktcore computes the experts; LLaMA-Factory's own use_kt path needs the KTransformers packages
        "use_kt": False,
        "use_cpu": not torch.cuda.is_available(),
    }
    if cfg.stage == "dpo":
        args.update(pref_beta=cfg.pref_beta, pref_loss=cfg.pref_loss)
    aux = _router_aux_loss_coef(cfg.model_name_or_path)
    if aux:
        # The MoE load-balancing loss with the model's coefficient is part of the objective, as TRL's trainers
        # make it for every MoE model; LLaMA-Factory adds it only when moe_aux_loss_coef is set, so we set it.
        args["moe_aux_loss_coef"] = aux
    if cfg.template not in (None, "", "default"):  # 'default': the tokenizer's own template, LLaMA-Factory's None
        args["template"] = cfg.template
    optional = {"adapter_name_or_path": cfg.adapter_name_or_path, "eval_dataset": cfg.eval_dataset,
                "max_samples": cfg.max_samples, "preprocessing_num_workers": cfg.preprocessing_num_workers,
                "save_total_limit": cfg.save_total_limit, "resume_from_checkpoint": cfg.resume_from_checkpoint}
    args.update({k: v for k, v in optional.items() if v not in (None, False)})
    if cfg.resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(cfg.output_dir) if Path(cfg.output_dir).is_dir() else None
        if last is None:
            raise ConfigError(f"{_where(cfg)}: resume_from_checkpoint: true, but {cfg.output_dir} has no checkpoint-*")
        args["resume_from_checkpoint"] = last
    if cfg.overwrite_output_dir:
        args["overwrite_output_dir"] = True
    return args


def _router_aux_loss_coef(model_dir):
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    value = config.get("router_aux_loss_coef")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


# ---- the scoped patch ----------------------------------------------------------------------------------------


class StepRecorder:
    """Exact loss of every optimizer step and the tokens seen (shared by the recording trainer subclasses).

    SFT: with ``num_items_in_batch`` each micro-batch's loss is already its share of the step's token mean, so
    the shares add up; without it, micro-batch means are weighted by their answer tokens. DPO: the loss is a
    mean over pairs, and micro-batches hold equally many pairs, so their losses are averaged.
    """

    def __init__(self, pairwise: bool):
        self.pairwise = pairwise
        self.step_loss = defaultdict(lambda: [0.0, 0])  # step -> [loss sum, weight]
        self.tokens = 0
        self.trainer = None

    def record(self, trainer, model, inputs, loss, num_items_in_batch):
        if not model.training:
            return
        entry = self.step_loss[trainer.state.global_step]
        value = float(loss.detach())
        if self.pairwise:
            entry[0] += value
            entry[1] += 1
        elif num_items_in_batch is not None:
            entry[0] += value
            entry[1] = 1
        else:
            n = int((inputs["labels"][..., 1:] != IGNORE_INDEX).sum())
            entry[0] += value * n
            entry[1] += n
        mask = inputs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())

    def losses(self) -> list[float]:
        return [s / max(n, 1) for _, (s, n) in sorted(self.step_loss.items())]


def _recording(base, recorder: StepRecorder):
    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorder.trainer = self

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            loss = result[0] if isinstance(result, tuple) else result
            recorder.record(self, model, inputs, loss, kwargs.get("num_items_in_batch"))
            return result

    Recording.__name__ = Recording.__qualname__ = f"Kt{base.__name__}"
    return Recording


@contextlib.contextmanager
def patched_llamafactory(recorder: StepRecorder):
    """Rebind LLaMA-Factory's ``load_model`` and trainer classes for one run; restored on exit."""
    import llamafactory.model as lf_model
    import llamafactory.model.loader as lf_loader
    import llamafactory.train.dpo.trainer as dpo_trainer
    import llamafactory.train.dpo.workflow as dpo_workflow
    import llamafactory.train.sft.workflow as sft_workflow
    import llamafactory.train.trainer_utils as trainer_utils

    original = lf_loader.load_model
    saved = []

    def rebind(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    try:
        for module in (lf_model, sft_workflow, dpo_workflow, trainer_utils):
            if getattr(module, "load_model", None) is original:
                rebind(module, "load_model", integration.load_model)
        rebind(sft_workflow, "CustomSeq2SeqTrainer", _recording(sft_workflow.CustomSeq2SeqTrainer, recorder))
        # run_dpo imports CustomDPOTrainer from .trainer inside the function: rebinding the module attribute
        rebind(dpo_trainer, "CustomDPOTrainer", _recording(dpo_trainer.CustomDPOTrainer, recorder))
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


# ---- entry ---------------------------------------------------------------------------------------------------


def _dpo_metrics(trainer) -> dict:
    history = [h for h in trainer.state.log_history if "rewards/accuracies" in h]
    if not history:
        return {}
    return {"reward_accuracies": [h["rewards/accuracies"] for h in history],
            "reward_margins": [h["rewards/margins"] for h in history],
            "reward_steps": [h.get("step") for h in history]}


def run(cfg: TrainConfig) -> dict:
    """Train the LoRA adapter the YAML describes with LLaMA-Factory's ``run_exp``; returns the summary."""
    return run_with_trainer(cfg)[0]


def run_with_trainer(cfg: TrainConfig):
    """``run``, also returning LLaMA-Factory's trainer (its model, state and reference computation)."""
    import torch

    cfg = apply_env(cfg)
    check_config(cfg)
    os.environ["DISABLE_VERSION_CHECK"] = "1"  # llamafactory 0.9.5 asks peft<=0.20; expert LoRA needs peft>=0.21
    from llamafactory.train.tuner import run_exp

    args = llamafactory_args(cfg)
    recorder = StepRecorder(pairwise=cfg.stage == "dpo")
    integration._ACTIVE_CFG = cfg
    start = time.perf_counter()
    try:
        with patched_llamafactory(recorder):
            run_exp(args)
    except ValueError as exc:  # LLaMA-Factory's argument and data errors are ValueErrors with one message
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{_where(cfg)}: llamafactory: {msg}") from exc
    finally:
        integration._ACTIVE_CFG = None
    runtime = time.perf_counter() - start
    trainer = recorder.trainer
    losses = recorder.losses()
    model = trainer.model if trainer is not None else None
    out = {
        "frontend": "llamafactory",
        "stage": cfg.stage,
        "steps": trainer.state.global_step if trainer is not None else 0,
        "first_loss": losses[0] if losses else math.nan,
        "last_loss": losses[-1] if losses else math.nan,
        "losses": losses,
        "tokens": recorder.tokens,
        "train_seconds": round(runtime, 3),
        "tokens_per_s": round(recorder.tokens / runtime, 1) if runtime > 0 else None,
        "output_dir": str(cfg.output_dir),
        "use_kt": cfg.use_kt,
    }
    if model is not None:
        trainable = [(n, p.numel()) for n, p in model.named_parameters() if p.requires_grad]
        out["trainable_params"] = sum(n for _, n in trainable)
        out["expert_lora_params"] = sum(n for name, n in trainable if ".experts." in name)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        info = getattr(base, "ktcore", None)
        if info is not None:
            out["kt_backend"] = type(info.backend).__name__
    if cfg.stage == "dpo" and trainer is not None:
        out.update(_dpo_metrics(trainer))
    if cfg.plot_loss and (Path(cfg.output_dir) / "training_loss.png").is_file():
        out["loss_plot"] = str(Path(cfg.output_dir) / "training_loss.png")
    out.update(peak_memory())
    sys.stdout.flush()
    return out, trainer
