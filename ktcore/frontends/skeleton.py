"""What every training frontend does the same way: the checks before any model loads, the exact loss of every
optimizer step, the parameter counts and the run summary ``ktcore train`` prints.

A frontend plugin (``ktcore-trl``, ``ktcore-llamafactory``) brings its trainer; the YAML's values were
checked by the schema already (``ktcore.config``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..config import ConfigError, TrainConfig, resolve_model_path

IGNORE_INDEX = -100  # labels of the tokens the loss leaves out (prompt, padding)


def check_paths_and_backend(cfg: TrainConfig, *, hub_ok: bool = False):
    """The checks that need neither torch nor transformers (``ktcore train`` runs them before it imports a
    frontend): the model path (returned, from ``resolve_model_path``), output_dir not a file, and with use_kt a
    backend that can train here."""
    model = resolve_model_path(cfg, hub_ok=hub_ok)
    if cfg.output_dir and Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise ConfigError(f"{cfg.where}: output_dir {cfg.output_dir!r} is an existing file, not a directory; choose "
                          "another output_dir")
    if cfg.use_kt:
        check_backend(cfg)
    return model


def check_model_and_adapter(cfg: TrainConfig, *, hub_ok: bool = False) -> Path:
    """The model path (``check_paths_and_backend``), after checking that ``adapter_name_or_path``, if set, is a
    PEFT adapter directory to keep training that passes ``ktcore adapter verify`` against the model (its integrity
    record, no pickle, names, shapes, finiteness), and the lora_target names: all before any weight is read."""
    if cfg.adapter_name_or_path:  # a Hub ID is refused first (ktcore reads adapters offline)
        from ..adapters.locate import local_adapter_path

        local_adapter_path(cfg.adapter_name_or_path)
    model = check_paths_and_backend(cfg, hub_ok=hub_ok)
    if cfg.adapter_name_or_path:
        from ..adapters import verify

        if not (Path(cfg.adapter_name_or_path) / "adapter_config.json").is_file():
            raise ConfigError(f"{cfg.where}: adapter_name_or_path {cfg.adapter_name_or_path!r} has no "
                              "adapter_config.json; point it at a directory written by save_pretrained")
        verify(cfg.adapter_name_or_path, base=model if isinstance(model, Path) else None)
    if isinstance(model, Path):
        check_lora_target(cfg, model)
    return model


def check_backend(cfg: TrainConfig, training: bool = True) -> None:
    """``kt_backend`` names an installed backend that can run here, with backward and LoRA when ``training``
    (``auto``: one can), before the model loads."""
    from ..errors import PluginError
    from ..plugins.select import resolve_backend

    kt = cfg.kt
    where = cfg.where_of("kt_config.kt_backend")
    try:
        choice = resolve_backend(kt.kt_backend, weight_format=kt.kt_expert_weight_format, need_backward=training,
                                 need_lora=training)
    except PluginError as exc:
        raise ConfigError(f"{where}: kt_config.kt_backend: " + " ".join(str(exc).split())) from exc  # one line
    if choice.spec is None:
        raise ConfigError(f"{where}: kt_config.kt_backend: auto: no installed expert backend can run here "
                          "(`ktcore list-backends --explain` says why)")


def check_lora_target(cfg: TrainConfig, model_path: Path) -> None:
    """Every ``lora_target`` name is a module of the model, and with use_kt every layer's kt_num_gpu_experts below
    its expert count, checked on the model built from its config on the meta device (config.json or the GGUF
    header: no weight is read)."""
    from ..model.peft_expert_lora import lora_targets
    from ..model.wrap import find_arch
    from ..weights.loading import meta_model_of

    try:
        hf_config, meta = meta_model_of(model_path, cfg.trust_remote_code)
    except (OSError, ValueError) as exc:  # transformers' own config errors, as one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{cfg.where_of('model_name_or_path')}: model_name_or_path {str(model_path)!r}: cannot "
                          f"build the model from its config ({first})") from exc
    try:
        lora_targets(meta, find_arch(hf_config), cfg.lora_target)
    except ValueError as exc:
        raise ConfigError(f"{cfg.where_of('lora_target')}: {exc}") from exc
    if cfg.use_kt:  # on the same meta model: each layer keeps fewer experts resident than it has
        from ..model.arch import expert_modules
        from ..model.wrap import check_resident

        try:
            check_resident(expert_modules(meta, find_arch(hf_config)), cfg.kt)
        except ValueError as exc:
            raise ConfigError(f"{cfg.where_of('kt_config.kt_num_gpu_experts')}: {exc}") from exc


class StepRecorder:
    """The exact loss of every optimizer step, the tokens seen and per-step metrics (DPO rewards).

    SFT: with ``num_items_in_batch`` each micro-batch's loss is already its share of the step's token mean, so
    the shares add up; without it, micro-batch means are weighted by their answer tokens. DPO (``pairwise``):
    the loss is a mean over pairs and micro-batches hold equally many pairs, so their losses are averaged.
    """

    def __init__(self, pairwise: bool):
        self.pairwise = pairwise
        self.step_loss = defaultdict(lambda: [0.0, 0])  # step -> [loss sum, weight]
        self.step_metrics = defaultdict(lambda: defaultdict(list))  # step -> metric -> micro-batch values
        self.tokens = 0

    def record(self, step: int, loss, inputs, num_items_in_batch=None) -> None:
        """One training micro-batch of optimizer step ``step`` (0-based)."""
        entry = self.step_loss[step]
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

    def record_metrics(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            self.step_metrics[step][key].append(value)

    def reduce_across_ranks(self) -> None:
        """With several ranks (torch.distributed initialised), make every rank's records the whole job's: each step's
        loss sum and weight and the tokens are summed over the ranks, so ``losses()`` is what one process with all
        the ranks' micro-batches records (SFT with ``num_items_in_batch``: each rank's loss is its token sum over
        the global count times the world size, and the mean over ranks is the global token mean)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        steps = sorted(self.step_loss)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flat = [v for s in steps for v in self.step_loss[s]] + [self.tokens]
        total = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(total)
        values = total.tolist()
        for i, step in enumerate(steps):
            self.step_loss[step] = [values[2 * i], values[2 * i + 1]]
        self.tokens = int(values[-1])

    def losses(self) -> list[float]:
        return [s / max(n, 1) for _, (s, n) in sorted(self.step_loss.items())]

    def records(self) -> dict:
        """step (0-based) -> {"loss": ..., metric: mean over the step's micro-batches}."""
        out = {}
        for step, (total, n) in sorted(self.step_loss.items()):
            metrics = {k: sum(v) / len(v) for k, v in self.step_metrics.get(step, {}).items() if v}
            out[step] = {"loss": total / max(n, 1), **metrics}
        return out


# TrainingArguments the YAML sets one to one, in every frontend (their trainers are transformers')
TRAINING_ARGUMENTS = ("output_dir", "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                      "gradient_accumulation_steps", "logging_steps", "save_steps", "save_only_model", "report_to",
                      "lr_scheduler_type", "weight_decay", "max_grad_norm", "optim", "seed", "bf16", "fp16",
                      "dataloader_num_workers", "ddp_timeout")


def training_arguments(cfg: TrainConfig) -> dict:
    """The transformers ``TrainingArguments`` every frontend takes from the YAML as they are."""
    import torch

    return {**{key: getattr(cfg, key) for key in TRAINING_ARGUMENTS}, "data_seed": cfg.seed,
            "logging_first_step": True, "use_cpu": not torch.cuda.is_available()}


def count_parameters(model) -> dict:
    """All parameters, the trainable ones and the trainable ones of the routed experts (expert LoRA)."""
    trainable = expert = total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
            if ".experts." in name:
                expert += p.numel()
    return {"trainable_params": trainable, "expert_lora_params": expert, "all_params": total}


def describe_parameters(params: dict) -> str:
    return (f"ktcore: trainable parameters {params['trainable_params']:,} (expert LoRA "
            f"{params['expert_lora_params']:,}) of {params['all_params']:,}")


def peak_memory() -> dict:
    """Peak GPU memory (torch's allocator, when CUDA is there) and peak host RSS of this process, GiB."""
    import torch

    out = {}
    if torch.cuda.is_available():
        out["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    try:
        import resource

        out["peak_host_mem_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    except (ImportError, OSError):
        pass
    return out


def run_summary(frontend: str, cfg: TrainConfig, recorder: StepRecorder, steps: int, runtime: float, model,
                **extra) -> dict:
    """The JSON summary of a training run: steps, per-step losses, tokens and tokens/s, parameter counts, the
    expert backend's plugin name, peak memory, and what the frontend adds (``extra``)."""
    losses = recorder.losses()
    out = {
        "frontend": frontend,
        "stage": cfg.stage,
        "steps": steps,
        "first_loss": losses[0] if losses else math.nan,
        "last_loss": losses[-1] if losses else math.nan,
        "losses": losses,
        "first_logged_step": min(recorder.step_loss) + 1 if recorder.step_loss else None,  # > 1 after a resume
        "tokens": recorder.tokens,
        "train_seconds": round(runtime, 3),
        "tokens_per_s": round(recorder.tokens / runtime, 1) if runtime > 0 else None,
        **(count_parameters(model) if model is not None else {}),
        "output_dir": str(cfg.output_dir),
        "use_kt": cfg.use_kt,
    }
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    info = getattr(base, "ktcore", None)
    if info is not None:
        out["kt_backend"] = info.backend.name
        out["kt_backend_threads"] = getattr(info.backend, "num_threads", None)  # its pool; None: it runs none
    return {**out, **extra, **peak_memory()}
