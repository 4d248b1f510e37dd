"""``ktcore train CFG.yaml --frontend llamafactory``: LLaMA-Factory's own ``run_exp`` trains the model.

The YAML is LLaMA-Factory's format plus ``use_kt``/``kt_*``. ``run(cfg)`` hands LLaMA-Factory its own keys
(the kt ones stay with ktcore) and runs ``llamafactory.train.tuner.run_exp``: LLaMA-Factory's data pipeline,
templates, collators, ``CustomSeq2SeqTrainer`` / ``CustomDPOTrainer``, checkpointing, logging and plots.

LLaMA-Factory 0.9.5 has no extension point for the model loader (its own ``use_kt`` path requires the
KTransformers packages ``kt-kernel``/``transformers-kt``/``accelerate-kt``), so for the duration of ``run`` —
and only then — ``patched_llamafactory`` rebinds two names:

* ``load_model`` in the LLaMA-Factory modules that imported it (``llamafactory.model``, the sft and dpo
  workflows, ``trainer_utils`` for an explicit ``ref_model``) -> ``integration.loader_for(cfg)``, which keeps
  LLaMA-Factory's config/model patching and lets ktcore build the model and the LoRA (expert LoRA included);
* the trainer classes the workflows instantiate -> subclasses that record every optimizer step's exact
  loss (the logged loss is rounded to 4 decimals) and the tokens seen, and publish the final adapter (the
  workflows' ``trainer.save_model()`` into ``output_dir``) as one unit with the integrity sidecar and ktcore's
  marker (``ktcore.frontends.final``); checkpoints are LLaMA-Factory's own.

A ``resume_from_checkpoint`` that is the last step of the run trains nothing (one line; the final adapter is
written from that checkpoint if its save was cut short), and every dataset's ``file_name`` must stay inside
``dataset_dir``: both checked before LLaMA-Factory is imported.

Everything is restored when ``run`` returns or raises. The DPO reference is LLaMA-Factory's own: with
``ref_model`` unset it runs the policy under ``disable_adapter()``, which turns expert LoRA off too
(tests/test_llamafactory_train.py proves it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from ktcore.config import ConfigError, TrainConfig
from ktcore.files import inside_root, usual_modes
from ktcore.frontends.final import finish_without_training, publish_adapter
from ktcore.frontends.skeleton import StepRecorder, check_model_and_adapter, run_summary, training_arguments

from . import integration

TRUE = ("1", "true", "yes", "y", "on")


def apply_env(cfg: TrainConfig) -> TrainConfig:
    """``USE_KT=1`` in the environment means ``use_kt: true`` (as in LLaMA-Factory's KT releases)."""
    if os.environ.get("USE_KT", "").strip().lower() in TRUE and not cfg.use_kt:
        cfg = replace(cfg, use_kt=True)
    return cfg


def check_config(cfg: TrainConfig) -> None:
    """What LLaMA-Factory training needs beyond the schema's checks (stage, values) and ``ktcore train``'s."""
    where = cfg.where
    if cfg.precompute_ref_log_probs:
        raise ConfigError(f"{where}: precompute_ref_log_probs: LLaMA-Factory computes the DPO reference on the fly "
                          "(policy with adapters disabled); drop the key or use --frontend trl")
    check_model_and_adapter(cfg)
    info = Path(cfg.dataset_dir) / "dataset_info.json"
    if not info.is_file():
        raise ConfigError(f"{where}: dataset_dir {cfg.dataset_dir!r} has no dataset_info.json; point dataset_dir at "
                          "the folder holding it")
    if not cfg.dataset:
        raise ConfigError(f"{where}: dataset is required: a comma list of names from {info}")
    check_dataset_files(cfg, info)


def check_dataset_files(cfg: TrainConfig, info: Path) -> None:
    """Every ``file_name`` of a dataset the YAML names (LLaMA-Factory reads the files itself) is inside
    ``dataset_dir``, and so is every file of one that names a folder (symlinks resolved): refused otherwise."""
    try:
        entries = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{info}: not readable JSON ({exc}); fix dataset_info.json") from None
    if not isinstance(entries, dict):
        raise ConfigError(f"{info}: must be a JSON object of dataset name -> entry")
    root = Path(cfg.dataset_dir)
    for name in (n.strip() for key in (cfg.dataset, cfg.eval_dataset) for n in (key or "").split(",")):
        entry = entries.get(name)
        if not isinstance(entry, dict) or "file_name" not in entry:
            continue  # an unknown name or a hub dataset: LLaMA-Factory's own one-line error or download
        what = f"{info}: dataset {name!r}: file_name"
        path = inside_root(root, entry["file_name"], what)
        if path.is_dir():
            for child in path.rglob("*"):
                inside_root(root, str(child.relative_to(root)), what)


def llamafactory_args(cfg: TrainConfig, model_dir=None) -> dict:
    """The YAML as LLaMA-Factory's ``run_exp`` arguments (its own keys; ktcore keeps the kt ones). ``model_dir``:
    the directory LLaMA-Factory opens for config and tokenizer (a GGUF's metadata directory) if not the model's."""
    model_dir = str(model_dir or cfg.model_name_or_path)
    args = {
        **training_arguments(cfg),
        "model_name_or_path": model_dir,
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
        "plot_loss": cfg.plot_loss,
        "warmup_ratio": cfg.warmup_ratio,
        "warmup_steps": cfg.warmup_steps,
        # gradient checkpointing as the YAML says (LLaMA-Factory's default is on, reentrant, which would run
        # the CPU experts' forward twice)
        "disable_gradient_checkpointing": not cfg.gradient_checkpointing,
        "use_reentrant_gc": False,
        # ktcore computes the experts; LLaMA-Factory's own use_kt path needs the KTransformers packages
        "use_kt": False,
    }
    if cfg.stage == "dpo":
        args.update(pref_beta=cfg.pref_beta, pref_loss=cfg.pref_loss)
    aux = _router_aux_loss_coef(model_dir)
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
        args["resume_from_checkpoint"] = resume_checkpoint(cfg)
    if cfg.overwrite_output_dir:
        args["overwrite_output_dir"] = True
    # the YAML's LLaMA-Factory keys ktcore has none of its own for go to LLaMA-Factory as they are
    if clash := sorted(set(cfg.llamafactory_keys) & set(args)):
        raise ConfigError(f"{cfg.where}: {', '.join(clash)}: ktcore sets these for the LLaMA-Factory run itself "
                          f"({', '.join(f'{k}={args[k]!r}' for k in clash)}); drop them from the YAML")
    return {**args, **cfg.llamafactory_keys}


def resume_checkpoint(cfg: TrainConfig):
    """The checkpoint the run resumes from (``true``: the last one in ``output_dir``), or None."""
    if cfg.resume_from_checkpoint is not True:
        return cfg.resume_from_checkpoint or None
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(cfg.output_dir) if Path(cfg.output_dir).is_dir() else None
    if last is None:
        raise ConfigError(f"{cfg.where}: resume_from_checkpoint: true, but {cfg.output_dir} has no checkpoint-*")
    return last


def _router_aux_loss_coef(model_dir):
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    value = config.get("router_aux_loss_coef")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


# ---- the scoped patch ----------------------------------------------------------------------------------------


def _recording(base, recorder: StepRecorder, trainers: list):
    """``base`` recording every optimizer step's exact loss into ``recorder`` and publishing the final adapter as
    one unit; each instance joins ``trainers``."""

    class Recording(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            if model.training:
                loss = result[0] if isinstance(result, tuple) else result
                recorder.record(self.state.global_step, loss, inputs, kwargs.get("num_items_in_batch"))
            return result

        def save_model(self, output_dir=None, _internal_call=False):
            # output_dir itself is the final save (checkpoints go to checkpoint-N): staged, sealed, published
            target = Path(output_dir or self.args.output_dir)
            if not self.args.should_save or target.resolve() != Path(self.args.output_dir).resolve():
                return super().save_model(output_dir, _internal_call)
            publish_adapter(target, lambda tmp: super(Recording, self).save_model(str(tmp), _internal_call))

    Recording.__name__ = Recording.__qualname__ = f"Kt{base.__name__}"
    return Recording


@contextlib.contextmanager
def patched_llamafactory(load_model, recorder: StepRecorder, trainers: list):
    """Rebind LLaMA-Factory's ``load_model`` (to ``load_model``) and trainer classes (to ones recording into
    ``recorder`` and ``trainers``) for one run; restored on exit."""
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
                rebind(module, "load_model", load_model)
        rebind(sft_workflow, "CustomSeq2SeqTrainer", _recording(sft_workflow.CustomSeq2SeqTrainer, recorder, trainers))
        # run_dpo imports CustomDPOTrainer from .trainer inside the function: rebinding the module attribute
        rebind(dpo_trainer, "CustomDPOTrainer", _recording(dpo_trainer.CustomDPOTrainer, recorder, trainers))
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


# ---- entry ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def metadata_dir(cfg: TrainConfig):
    """The directory LLaMA-Factory reads config and tokenizer from: the model directory itself, or for a
    ``.gguf`` a temporary one written from its metadata (``integration.loader_for`` loads the weights from the
    file)."""
    import tempfile

    from ktcore.config import resolve_model_path
    from ktcore.weights.model_path import is_gguf, write_metadata_dir

    path = resolve_model_path(cfg, hub_ok=True)
    if not is_gguf(path):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="ktcore-gguf-metadata-") as tmp:
        yield write_metadata_dir(path, tmp)


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
    cfg = apply_env(cfg)
    check_config(cfg)
    done = finish_without_training(cfg, resume_checkpoint(cfg), "llamafactory")
    if done is not None:
        return done, None
    os.environ["DISABLE_VERSION_CHECK"] = "1"  # llamafactory 0.9.5 asks peft<=0.20; expert LoRA needs peft>=0.21
    # LLaMA-Factory turns transformers' logging up to INFO unless told otherwise, and at INFO every config load
    # dumps the whole model config (4 times while loading, once per save); ktcore prints its own progress and
    # summary. LLAMAFACTORY_VERBOSITY=INFO brings LLaMA-Factory's logging back.
    os.environ.setdefault("LLAMAFACTORY_VERBOSITY", "WARN")
    from llamafactory.train.tuner import run_exp

    recorder, trainers = StepRecorder(pairwise=cfg.stage == "dpo"), []
    start = time.perf_counter()
    try:
        with metadata_dir(cfg) as model_dir, patched_llamafactory(integration.loader_for(cfg), recorder, trainers):
            run_exp(llamafactory_args(cfg, model_dir))
    except ValueError as exc:  # LLaMA-Factory's argument and data errors are ValueErrors with one message
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{cfg.where}: llamafactory: {msg}") from exc
    runtime = time.perf_counter() - start
    if Path(cfg.output_dir).is_dir():
        usual_modes(cfg.output_dir)  # safetensors writes the adapter weights 0600
    trainer = trainers[-1] if trainers else None
    extra = {}
    if cfg.stage == "dpo" and trainer is not None:
        extra.update(_dpo_metrics(trainer))
    if cfg.plot_loss and (Path(cfg.output_dir) / "training_loss.png").is_file():
        extra["loss_plot"] = str(Path(cfg.output_dir) / "training_loss.png")
    sys.stdout.flush()
    steps = trainer.state.global_step if trainer is not None else 0
    model = trainer.model if trainer is not None else None
    return run_summary("llamafactory", cfg, recorder, steps, runtime, model, **extra), trainer
