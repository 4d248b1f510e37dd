"""``ktcore train CFG.yaml --frontend trl``: LoRA SFT and DPO with TRL's own ``SFTTrainer`` / ``DPOTrainer``.

ktcore supplies the model (routed experts in the CPU backend when ``use_kt: true``) and the LoRA config
(expert LoRA in PEFT's ``target_parameters`` layout); TRL and transformers run the training loop unchanged.

Order of work, so that bad input fails fast: validate the config and read every dataset file -> load the
tokenizer and tokenize (template and cutoff_len checks) -> only then load the model.

The pieces (``load_base_model``, ``attach_lora``, ``trainer_kwargs``, ``save_adapter`` from ``final.py``) are shared
by both stages. ``KtTrainerMixin`` adds what both trainers need on top of TRL: exact per-step records (loss, tokens,
DPO rewards: ``ktcore.frontends.skeleton.StepRecorder``), crash-safe checkpoints (``checkpoints.py``) and the
progress bar (``report.py``). The summary is the skeleton's ``run_summary``, as for every frontend.

DPO reference: with ``ref_model=None`` on a PEFT model TRL computes the reference under
``model.disable_adapter()``; ktcore's expert LoRA lives in PEFT's own ``target_parameters`` wrappers, so that
context switches it off as well and the reference is exactly the base model. ``KtDPOTrainer`` routes every
reference pass through TRL's ``compute_ref_log_probs`` (also used by ``precompute_ref_log_probs``) and keeps the
last one (``last_reference``) so tests can compare it with a fresh base model.

Gradient checkpointing with CPU experts: transformers checkpoints whole decoder layers, so backward re-runs the
layer's forward, routed experts included -- a second CPU expert forward per layer, although
``kt_cpu_activation: retain`` already kept what the experts' backward needs. (torch's early stop of a
non-reentrant recompute hides this only where nothing after the experts saves a tensor, as in Qwen3-MoE;
DeepSeek's shared experts run after them.) With ``use_kt`` the frontend
therefore checkpoints whole layers its own way (``ktcore.model.checkpointing``): the routed experts' output is
replayed in the recompute, so they run once forward and keep (retain) or recompute (recompute) their own
activations, as configured. ``use_kt`` models also get the chunked training loss (``ktcore.model.lm_loss``).
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from ktcore.model.checkpointing import checkpoint_non_experts
from ktcore.model.lm_loss import chunk_lm_loss
from ktcore.model.placeholder import hide_from_ddp
from ktcore.plugins.threads import is_main_rank
from ktcore.config import ConfigError, TrainConfig
from ktcore.frontends.skeleton import (StepRecorder, check_model_and_adapter, count_parameters, describe_parameters,
                                       run_summary, training_arguments)

from . import data
from .final import finish_without_training, save_adapter  # noqa: F401 - save_adapter: part of this module's API

PREF_LOSSES = {"sigmoid": "sigmoid", "ipo": "ipo", "hinge": "hinge"}  # YAML pref_loss -> TRL loss_type


# ---- checks that need no model -------------------------------------------------------------------------------


def check_config(cfg: TrainConfig) -> None:
    """What TRL training needs beyond the schema's checks (stage, values) and ``ktcore train``'s (the model
    and output_dir are set)."""
    where = cfg.where
    check_model_and_adapter(cfg, hub_ok=True)
    reporters = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to or [])
    if "tensorboard" in reporters or "all" in reporters:
        import importlib.util

        if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):
            raise ConfigError(f"{where}: report_to: tensorboard needs the tensorboard package; pip install "
                              "tensorboard (or ktcore-trl[tensorboard]), or set report_to: none")
    if cfg.llamafactory_keys:  # refused now, not after the model loaded
        from trl import DPOConfig, SFTConfig

        stage_kwargs(cfg, DPOConfig if cfg.stage == "dpo" else SFTConfig)
    out = Path(cfg.output_dir)
    if (out.is_dir() and any(p.name != "runs" for p in out.iterdir()) and not cfg.overwrite_output_dir
            and not cfg.resume_from_checkpoint):
        raise ConfigError(f"{where}: output_dir {str(out)!r} is not empty; set overwrite_output_dir: true, "
                          "resume_from_checkpoint, or choose another output_dir")


def load_tokenizer(cfg):
    """The model's tokenizer (a model directory's files, or a ``.gguf`` file's metadata)."""
    from ktcore.weights.model_path import load_tokenizer as load

    try:
        tokenizer = load(model_path(cfg), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{cfg.where}: model_name_or_path {cfg.model_name_or_path!r}: cannot load its "
                          f"tokenizer ({first}); point it at a model directory with tokenizer files or a .gguf "
                          "file with tokenizer metadata") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- model ---------------------------------------------------------------------------------------------------


def model_path(cfg):
    """What ``model_name_or_path`` names: a local directory or ``.gguf`` file (a ``package:`` path resolved), or
    a Hub ID as given."""
    from ktcore.config import resolve_model_path

    return resolve_model_path(cfg, hub_ok=True)


def compute_dtype(cfg):
    import torch

    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


def load_base_model(cfg):
    """The base model: ktcore's (routed experts in the CPU backend) when use_kt, else plain transformers."""
    import torch

    dtype = compute_dtype(cfg)
    if cfg.fp16 and cfg.use_kt:
        dtype = torch.float32  # fp16 training keeps fp32 master weights; AMP does the casting
    if cfg.use_kt:
        import ktcore

        return ktcore.load_model(model_path(cfg), cfg, dtype=dtype)
    from ktcore.weights.model_path import load_plain_model

    return load_plain_model(model_path(cfg), dtype=dtype, trust_remote_code=cfg.trust_remote_code)


def attach_lora(model, cfg):
    """PEFT-wrap ``model``: a new LoRA from the YAML, or ``adapter_name_or_path`` to keep training (validated
    as every adapter ktcore reads: ``ktcore.adapters.load_adapter_into``)."""
    from peft import get_peft_model

    from ktcore.adapters import load_adapter_into
    from ktcore.model.peft_expert_lora import peft_wrapping

    if cfg.adapter_name_or_path:
        base = Path(cfg.model_name_or_path)
        return load_adapter_into(model, cfg.adapter_name_or_path, base=base if base.exists() else None,
                                 is_trainable=True)
    with peft_wrapping(model):
        return get_peft_model(model, lora_config(model, cfg))


def lora_config(model, cfg):
    """The peft.LoraConfig the YAML asks for (expert LoRA in PEFT's target_parameters layout)."""
    from ktcore.model.peft_expert_lora import lora_config_for
    from ktcore.model.wrap import find_arch

    info = getattr(model, "ktcore", None)
    arch = info.arch if info is not None else find_arch(model.config)
    try:
        return lora_config_for(model, arch, cfg)
    except ValueError as exc:
        raise ConfigError(f"{cfg.where}: {exc}") from exc


# ---- trainer -------------------------------------------------------------------------------------------------


def _checkpointing_kwargs(cfg, args_cls) -> dict:
    """Gradient checkpointing under the name this transformers uses (``activation_checkpointing`` since 5.2x)."""
    from dataclasses import fields

    names = {f.name for f in fields(args_cls)}
    prefix = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    enabled = cfg.gradient_checkpointing and not cfg.use_kt  # with use_kt: checkpoint_non_experts instead
    extra = {"use_reentrant": False} if enabled else None
    kwargs = {prefix: enabled, f"{prefix}_kwargs": extra}
    if prefix == "activation_checkpointing" and "gradient_checkpointing" in names:
        kwargs.update(gradient_checkpointing=None, gradient_checkpointing_kwargs=None)  # TRL's defaults would warn
    return kwargs


def trainer_kwargs(cfg, args_cls) -> dict:
    """TrainingArguments keys shared by every stage, mapped from the YAML (``args_cls``: SFTConfig, DPOConfig...)."""
    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else cfg.warmup_ratio  # a float < 1 is a ratio
    # Several ranks (DDP): every trainable parameter is a LoRA factor of a module each forward runs (expert LoRA
    # is one tensor per layer, whichever experts the tokens pick), so DDP need not search the graph for unused ones
    # (transformers would ask for that search on a PEFT model, and DDP warns that it found none, every run).
    return dict(training_arguments(cfg), save_strategy="steps", save_total_limit=cfg.save_total_limit,
                warmup_steps=warmup, remove_unused_columns=False, ddp_find_unused_parameters=False,
                **_checkpointing_kwargs(cfg, args_cls))


def _stage_settings(cfg) -> dict:
    """What the stage's TRL config gets beside ``trainer_kwargs``."""
    if cfg.stage == "dpo":
        # DPO optimises the preference loss alone: LLaMA-Factory's DPO trainer never adds the MoE load-balancing
        # loss, so the same YAML gives the same objective in both frontends (SFT keeps it in both).
        return dict(beta=cfg.pref_beta, loss_type=[PREF_LOSSES[cfg.pref_loss]], max_length=None,
                    precompute_ref_log_probs=False, dataset_num_proc=None,  # precomputed by ktcore beforehand
                    router_aux_loss_coef=0.0)
    return dict(max_length=cfg.cutoff_len, packing=False, dataset_num_proc=None, completion_only_loss=None,
                assistant_only_loss=False, shuffle_dataset=False)


def stage_kwargs(cfg, args_cls) -> dict:
    """Every keyword of the stage's TRL config (``args_cls``: SFTConfig or DPOConfig): ktcore's mapping of the
    YAML, and the YAML's LLaMA-Factory keys that are fields of ``args_cls`` (transformers' TrainingArguments
    mostly) as they are. A LLaMA-Factory key TRL has no field for, or one ktcore sets itself, is one line."""
    import dataclasses

    kwargs = {**trainer_kwargs(cfg, args_cls), **_stage_settings(cfg)}
    extra = cfg.llamafactory_keys
    fields = {f.name for f in dataclasses.fields(args_cls)}
    if unknown := sorted(set(extra) - fields):
        raise ConfigError(f"{cfg.where}: {', '.join(unknown)}: LLaMA-Factory key(s) the TRL frontend has no "
                          "counterpart for; run --frontend llamafactory, or drop them")
    if clash := sorted(set(extra) & set(kwargs)):
        raise ConfigError(f"{cfg.where}: {', '.join(clash)}: ktcore sets these for the TRL run itself "
                          f"({', '.join(f'{k}={kwargs[k]!r}' for k in clash)}); drop them from the YAML")
    return {**kwargs, **extra}


class KtTrainerMixin:
    """Added in front of TRL's trainers: exact per-step records (``recorder``), crash-safe checkpoints, the
    progress bar."""

    def _kt_init(self, pairwise: bool):
        from transformers.trainer_callback import ProgressCallback

        from .report import KtProgressCallback

        self.recorder = StepRecorder(pairwise)
        self._kt_staging = None
        if not self.args.disable_tqdm:
            self.remove_callback(ProgressCallback)
            self.add_callback(KtProgressCallback(self.recorder))

    # -- checkpoints: written to output_dir/.tmp-checkpoint-N, sealed with a manifest, then renamed ------------

    def _get_output_dir(self, trial):
        return str(self._kt_staging) if self._kt_staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        from .checkpoints import PREFIX, STAGING_PREFIX, publish, rotate, seal

        # With several ranks every rank writes into the same staging directory (rank 0 the adapter, optimizer and
        # state, each rank its rng_state_N.pth), so rank 0 alone creates, seals and publishes it, between barriers.
        main, wait = self.is_world_process_zero(), self.accelerator.wait_for_everyone
        run_dir = Path(self._get_output_dir(trial))
        step = self.state.global_step
        staging = run_dir / f"{STAGING_PREFIX}{PREFIX}-{step}"
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        wait()
        self._kt_staging = staging
        try:
            super()._save_checkpoint(model, trial)  # transformers/TRL write everything into staging/checkpoint-N
        finally:
            self._kt_staging = None
        wait()
        if main:
            written = staging / f"{PREFIX}-{step}"
            seal(written, step)
            publish(written, run_dir / f"{PREFIX}-{step}")
            shutil.rmtree(staging, ignore_errors=True)
            rotate(run_dir, self.args.save_total_limit)
        wait()  # no rank trains on (and may save again) before the checkpoint is in place


def make_sft_trainer(model, tokenizer, dataset, cfg, callbacks=()):
    from trl import SFTConfig, SFTTrainer

    class KtSFTTrainer(KtTrainerMixin, SFTTrainer):
        """SFTTrainer that also records the exact loss and token count of every optimizer step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._kt_init(pairwise=False)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # (asking TRL for the outputs would cost an extra forward pass, so only the loss is read)
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            if model.training:
                loss = result[0] if return_outputs else result
                self.recorder.record(self.state.global_step, loss, inputs, num_items_in_batch)
            return result

    args = SFTConfig(**stage_kwargs(cfg, SFTConfig))
    return KtSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=list(callbacks))


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "aux_loss")


def make_dpo_trainer(model, tokenizer, dataset, cfg, callbacks=(), peft_config=None):
    from trl import DPOConfig, DPOTrainer

    class KtDPOTrainer(KtTrainerMixin, DPOTrainer):
        """DPOTrainer with per-step reward records; every reference pass goes through ``compute_ref_log_probs``
        (TRL's: the PEFT model under ``disable_adapter()``, which switches ktcore's expert LoRA off too)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._kt_init(pairwise=True)
            self.micro_batches = []  # per training micro-batch: the numbers the loss was computed from
            if cfg.precompute_ref_log_probs:
                self.train_dataset = self._precompute_reference(self.train_dataset)
                self.precompute_ref_logps = True

        def _precompute_reference(self, dataset):
            """ref_chosen_logps / ref_rejected_logps columns, computed before step one with every adapter off.

            (TRL's own precompute fingerprints the model by hashing its state_dict, which cannot read the
            zero-storage expert placeholders; the reference pass itself is TRL's ``compute_ref_log_probs``.)
            """
            from torch.utils.data import DataLoader
            from tqdm.auto import tqdm

            batch_size = self.args.precompute_ref_batch_size or self.args.per_device_train_batch_size
            loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
            chosen, rejected = [], []
            was_training = self.model.training
            self.model.eval()
            try:
                for batch in tqdm(loader, desc="reference log-probs", disable=self.args.disable_tqdm):
                    c, r = self.compute_ref_log_probs(self.model, self._prepare_inputs(batch))
                    chosen += c.float().cpu().tolist()
                    rejected += r.float().cpu().tolist()
            finally:
                self.model.train(was_training)
            fingerprint = f"{dataset._fingerprint}-ref"
            dataset = dataset.add_column("ref_chosen_logps", chosen, new_fingerprint=fingerprint + "c")
            return dataset.add_column("ref_rejected_logps", rejected, new_fingerprint=fingerprint + "r")

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:  # tokenized by ktcore_trl.data (template, cutoff_len)
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def compute_ref_log_probs(self, model, inputs):
            chosen, rejected = super().compute_ref_log_probs(model, inputs)
            self.last_reference = {"input_ids": inputs["input_ids"].detach().cpu(),
                                   "attention_mask": inputs["attention_mask"].detach().cpu(),
                                   "completion_mask": inputs["completion_mask"].detach().cpu(),
                                   "chosen": chosen.detach().cpu(), "rejected": rejected.detach().cpu()}
            return chosen, rejected

        def _compute_loss(self, model, inputs, return_outputs):
            if "ref_chosen_logps" in inputs:  # precompute_ref_log_probs: computed before step one
                ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                ref_chosen, ref_rejected = self.compute_ref_log_probs(self.ref_model or model, inputs)
                inputs = {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
            precompute, self.precompute_ref_logps = self.precompute_ref_logps, True  # TRL reads them from inputs
            try:
                result = super()._compute_loss(model, inputs, return_outputs)
            finally:
                self.precompute_ref_logps = precompute
            if self.model.training:
                loss = result[0] if return_outputs else result
                step = self.state.global_step
                metrics = {k: v[-1] for k, v in self._metrics["train"].items() if k in DPO_METRICS and v}
                self.recorder.record(step, loss, inputs)
                self.recorder.record_metrics(step, metrics)
                chosen_mask, rejected_mask = inputs["completion_mask"].chunk(2, dim=0)
                self.micro_batches.append({
                    "step": step, "loss": float(loss.detach()), **metrics,
                    "ref_chosen": ref_chosen.detach().cpu().tolist(), "ref_rejected": ref_rejected.detach().cpu().tolist(),
                    "chosen_tokens": chosen_mask.sum(dim=1).cpu().tolist(),
                    "rejected_tokens": rejected_mask.sum(dim=1).cpu().tolist()})
            return result

    args = DPOConfig(**stage_kwargs(cfg, DPOConfig))
    return KtDPOTrainer(model=model, ref_model=None, args=args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=list(callbacks), peft_config=peft_config)

# ---- entry ---------------------------------------------------------------------------------------------------


def prepare(cfg: TrainConfig):
    """(tokenizer, dataset, resume checkpoint) for the configured stage: every check that needs no model."""
    from .checkpoints import clean_staging, resolve_resume

    check_config(cfg)
    data.resolve_template(cfg)  # an unknown template name fails before anything is read
    clean_staging(cfg.output_dir)  # leftovers of a checkpoint save that was killed (a complete copy is put back)
    resume = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir, cfg.where)
    examples = data.load_examples(cfg, ranking=cfg.stage == "dpo")
    tokenizer = load_tokenizer(cfg)
    template = data.resolve_template(cfg, tokenizer)
    if cfg.stage == "dpo":
        dataset = data.tokenize_pairs(examples, tokenizer, cfg, template)
    else:
        dataset = data.tokenize_sft(examples, tokenizer, cfg, template)
    if template is not None:
        tokenizer.chat_template = template  # saved with the adapter, so inference formats prompts the same way
    return tokenizer, dataset, resume


def build_trainer(cfg: TrainConfig, tokenizer, dataset, callbacks=()):
    """Model (ktcore's when use_kt) + LoRA + the stage's trainer; returns (trainer, parameter counts)."""
    from transformers import set_seed

    set_seed(cfg.seed)
    base = load_base_model(cfg)
    if cfg.use_kt:
        chunk_lm_loss(base)  # TRL's own fused LM head, where it has one, bypasses it
    if cfg.gradient_checkpointing and cfg.use_kt:
        checkpoint_non_experts(base)
    if cfg.stage == "dpo" and not cfg.adapter_name_or_path:
        # TRL wraps the model itself; with a LoRA it created, its reference is the PEFT model under
        # disable_adapter() -- the base model, expert LoRA off too. (A model wrapped beforehand would make TRL
        # copy the adapter into a "ref" adapter and use that as the reference instead.)
        from ktcore.model.peft_expert_lora import peft_wrapping

        with peft_wrapping(base):  # TRL calls get_peft_model
            trainer = make_dpo_trainer(base, tokenizer, dataset, cfg, callbacks, peft_config=lora_config(base, cfg))
    elif cfg.stage == "dpo":  # keep training an adapter: TRL's reference is a frozen copy of it ("ref")
        trainer = make_dpo_trainer(attach_lora(base, cfg), tokenizer, dataset, cfg, callbacks)
    else:
        trainer = make_sft_trainer(attach_lora(base, cfg), tokenizer, dataset, cfg, callbacks)
    hide_from_ddp(trainer.model)  # with several ranks: DDP must not broadcast the zero-storage expert placeholders
    return trainer, count_parameters(trainer.model)


def run(cfg: TrainConfig, callbacks=()) -> dict:
    """Train the LoRA adapter the YAML describes; returns the summary printed by ``ktcore train``."""
    import sys

    from .report import plot_training

    tokenizer, dataset, resume = prepare(cfg)
    done = finish_without_training(cfg, resume)
    if done is not None:
        return done
    trainer, params = build_trainer(cfg, tokenizer, dataset, callbacks)
    if is_main_rank():
        print(describe_parameters(params) + (f"; resuming from {resume}" if resume else ""), file=sys.stderr)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    runtime = time.perf_counter() - start
    trainer.recorder.reduce_across_ranks()  # with several ranks: the whole job's losses and tokens, on every rank
    if trainer.is_world_process_zero():  # the ranks hold the same adapter (DDP): one writes it
        save_adapter(trainer.model, tokenizer, cfg.output_dir)
    extra = {"examples": len(dataset), "resumed_from": resume}
    if cfg.stage == "dpo":
        records = trainer.recorder.records()
        for key in ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"):
            extra[key.replace("/", "_")] = [r.get(key, math.nan) for r in records.values()]
        extra.update(pref_loss=cfg.pref_loss, pref_beta=cfg.pref_beta,
                     precompute_ref_log_probs=cfg.precompute_ref_log_probs)
    if cfg.plot_loss and trainer.is_world_process_zero():
        extra.update(plot_training(trainer.recorder.records(), cfg.output_dir, cfg.stage))
    return run_summary("trl", cfg, trainer.recorder, trainer.state.global_step, runtime, trainer.model, **extra)
