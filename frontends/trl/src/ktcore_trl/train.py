"""``ktcore train CFG.yaml --frontend trl``: LoRA SFT with TRL's own ``SFTTrainer``.

ktcore supplies the model (routed experts in the CPU backend when ``use_kt: true``) and the LoRA config
(expert LoRA in PEFT's ``target_parameters`` layout); TRL and transformers run the training loop unchanged.

Order of work, so that bad input fails fast: validate the config and read every dataset file -> load the
tokenizer and tokenize (template and cutoff_len checks) -> only then load the model.

The pieces (``load_base_model``, ``attach_lora``, ``trainer_kwargs``, ``save_adapter``, ``summary``) are shared with the DPO
stage that comes next.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from ktcore.config import ConfigError, TrainConfig

from . import data

STAGES = ("sft",)


def _where(cfg) -> str:
    return cfg.source or "<config>"


# ---- checks that need no model -------------------------------------------------------------------------------


def check_config(cfg: TrainConfig) -> None:
    where = _where(cfg)
    if cfg.stage not in STAGES:
        raise ConfigError(f"{where}: stage {cfg.stage!r} is not supported by the trl frontend yet "
                          f"(it runs: {', '.join(STAGES)})")
    if cfg.finetuning_type != "lora":
        raise ConfigError(f"{where}: finetuning_type {cfg.finetuning_type!r}: the trl frontend trains LoRA only")
    if not cfg.model_name_or_path:
        raise ConfigError(f"{where}: model_name_or_path is required")
    if not cfg.output_dir:
        raise ConfigError(f"{where}: output_dir is required")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError(f"{where}: bf16 and fp16 are both true; choose one")
    model_dir = Path(cfg.model_name_or_path)
    name = str(cfg.model_name_or_path)
    looks_local = model_dir.is_absolute() or name.startswith(".") or name.count("/") != 1
    if not model_dir.exists() and looks_local:
        raise ConfigError(f"{where}: model_name_or_path {name!r} does not exist; fix the path (for "
                          "examples/demo.yaml run `ktcore demo` first: it builds runs/demo/)")
    if model_dir.exists() and not (model_dir / "config.json").is_file():
        raise ConfigError(f"{where}: model_name_or_path {str(model_dir)!r} has no config.json; point it at a "
                          "model saved with save_pretrained")
    if cfg.adapter_name_or_path and not (Path(cfg.adapter_name_or_path) / "adapter_config.json").is_file():
        raise ConfigError(f"{where}: adapter_name_or_path {cfg.adapter_name_or_path!r} has no adapter_config.json; "
                          "point it at a directory written by save_pretrained")
    out = Path(cfg.output_dir)
    if (out.is_dir() and any(p.name != "runs" for p in out.iterdir()) and not cfg.overwrite_output_dir
            and not cfg.resume_from_checkpoint):
        raise ConfigError(f"{where}: output_dir {str(out)!r} is not empty; set overwrite_output_dir: true, "
                          "resume_from_checkpoint, or choose another output_dir")


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{_where(cfg)}: model_name_or_path {cfg.model_name_or_path!r}: cannot load its "
                          f"tokenizer ({first}); point it at a model directory with tokenizer files") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---- model ---------------------------------------------------------------------------------------------------


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

        return ktcore.load_model(cfg.model_name_or_path, cfg, dtype=dtype)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path, dtype=dtype,
                                                trust_remote_code=cfg.trust_remote_code)


def attach_lora(model, cfg):
    """PEFT-wrap ``model``: a new LoRA from the YAML, or ``adapter_name_or_path`` to keep training."""
    from peft import PeftModel, get_peft_model

    from ktcore.lora import lora_config_for
    from ktcore.wrap import find_arch

    if cfg.adapter_name_or_path:
        return PeftModel.from_pretrained(model, cfg.adapter_name_or_path, is_trainable=True)
    info = getattr(model, "ktcore", None)
    arch = info.arch if info is not None else find_arch(model.config)
    try:
        lora_config = lora_config_for(model, arch, cfg)
    except ValueError as exc:
        raise ConfigError(f"{_where(cfg)}: {exc}") from exc
    return get_peft_model(model, lora_config)


def count_parameters(model) -> dict:
    trainable = expert = total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
            if ".experts." in name:
                expert += p.numel()
    return {"trainable_params": trainable, "expert_lora_params": expert, "all_params": total}


# ---- trainer -------------------------------------------------------------------------------------------------


def _checkpointing_kwargs(cfg, args_cls) -> dict:
    """Gradient checkpointing under the name this transformers uses (``activation_checkpointing`` since 5.2x)."""
    from dataclasses import fields

    names = {f.name for f in fields(args_cls)}
    prefix = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    extra = {"use_reentrant": False} if cfg.gradient_checkpointing else None
    kwargs = {prefix: cfg.gradient_checkpointing, f"{prefix}_kwargs": extra}
    if prefix == "activation_checkpointing" and "gradient_checkpointing" in names:
        kwargs.update(gradient_checkpointing=None, gradient_checkpointing_kwargs=None)  # TRL's defaults would warn
    return kwargs


def trainer_kwargs(cfg, args_cls) -> dict:
    """TrainingArguments keys shared by every stage, mapped from the YAML (``args_cls``: SFTConfig, DPOConfig...)."""
    import torch

    warmup = cfg.warmup_steps if cfg.warmup_steps > 0 else cfg.warmup_ratio  # a float < 1 is a ratio
    cpu = not torch.cuda.is_available()
    return dict(
        output_dir=cfg.output_dir,
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        logging_steps=cfg.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=cfg.save_total_limit,
        save_only_model=cfg.save_only_model,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=warmup,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        optim=cfg.optim,
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        report_to=cfg.report_to,
        dataloader_num_workers=cfg.dataloader_num_workers,
        ddp_timeout=cfg.ddp_timeout,
        use_cpu=cpu,
        remove_unused_columns=False,
        **_checkpointing_kwargs(cfg, args_cls),
    )


def make_sft_trainer(model, tokenizer, dataset, cfg, callbacks=()):
    from trl import SFTConfig, SFTTrainer

    class KtSFTTrainer(SFTTrainer):
        """SFTTrainer that also records the exact loss and token count of every optimizer step."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.step_loss = defaultdict(lambda: [0.0, 0])  # step -> [loss sum, weight]
            self.tokens_seen = 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # (asking TRL for the outputs would cost an extra forward pass, so only the loss is read)
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            if model.training:
                loss = result[0] if return_outputs else result
                record = self.step_loss[self.state.global_step]
                if num_items_in_batch is not None:  # each micro-batch's loss is its share of the step's mean
                    record[0] += float(loss.detach())
                    record[1] = 1
                else:  # a per-micro-batch mean: weight it by its answer tokens
                    n = int((inputs["labels"][..., 1:] != data.IGNORE_INDEX).sum())
                    record[0] += float(loss.detach()) * n
                    record[1] += n
                mask = inputs.get("attention_mask")
                self.tokens_seen += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return result

        def losses(self) -> list[float]:
            return [s / max(n, 1) for _, (s, n) in sorted(self.step_loss.items())]

    args = SFTConfig(**trainer_kwargs(cfg, SFTConfig), max_length=cfg.cutoff_len, packing=False, dataset_num_proc=None,
                     completion_only_loss=None, assistant_only_loss=False, shuffle_dataset=False)
    return KtSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                        callbacks=list(callbacks))


# ---- outputs -------------------------------------------------------------------------------------------------


def save_adapter(model, tokenizer, output_dir) -> None:
    """PEFT's own save_pretrained, written to a temp dir first and renamed into place file by file."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=out))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot_loss(losses: list[float], output_dir, title: str = "training loss") -> str:
    """training_loss.png: the loss of every step and its moving average (like LLaMA-Factory's plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses) + 1))
    window = max(1, len(losses) // 20)
    smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, smooth, label=f"moving average ({window})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(output_dir) / "training_loss.png"
    tmp = path.with_suffix(".png.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return str(path)


def summary(trainer, cfg, runtime: float, params: dict, extra: dict | None = None) -> dict:
    import torch

    losses = trainer.losses()
    tokens = trainer.tokens_seen
    out = {
        "frontend": "trl",
        "stage": cfg.stage,
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else math.nan,
        "last_loss": losses[-1] if losses else math.nan,
        "losses": losses,
        "tokens": tokens,
        "train_seconds": round(runtime, 3),
        "tokens_per_s": round(tokens / runtime, 1) if runtime > 0 else None,
        **params,
        "output_dir": str(cfg.output_dir),
        "use_kt": cfg.use_kt,
    }
    if cfg.use_kt:
        info = getattr(trainer.model.get_base_model(), "ktcore", None)
        if info is not None:
            out["kt_backend"] = type(info.backend).__name__
    if torch.cuda.is_available():
        out["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    try:
        import resource

        out["peak_host_mem_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    except (ImportError, OSError):
        pass
    return {**out, **(extra or {})}


# ---- entry ---------------------------------------------------------------------------------------------------


def prepare_sft(cfg: TrainConfig):
    """(tokenizer, dataset) for SFT: every check that needs no model."""
    check_config(cfg)
    data.resolve_template(cfg)  # an unknown template name fails before anything is read
    examples = data.load_examples(cfg, ranking=False)
    tokenizer = load_tokenizer(cfg)
    template = data.resolve_template(cfg, tokenizer)
    dataset = data.tokenize_sft(examples, tokenizer, cfg, template)
    if template is not None:
        tokenizer.chat_template = template  # saved with the adapter, so inference formats prompts the same way
    return tokenizer, dataset


def run(cfg: TrainConfig) -> dict:
    """Train the LoRA adapter the YAML describes; returns the summary printed by ``ktcore train``."""
    from transformers import set_seed

    tokenizer, dataset = prepare_sft(cfg)
    set_seed(cfg.seed)
    model = attach_lora(load_base_model(cfg), cfg)
    params = count_parameters(model)
    trainer = make_sft_trainer(model, tokenizer, dataset, cfg)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=cfg.resume_from_checkpoint or None)
    runtime = time.perf_counter() - start
    save_adapter(trainer.model, tokenizer, cfg.output_dir)
    extra = {"examples": len(dataset)}
    if cfg.plot_loss and trainer.losses():
        extra["loss_plot"] = plot_loss(trainer.losses(), cfg.output_dir)
    return summary(trainer, cfg, runtime, params, extra)
