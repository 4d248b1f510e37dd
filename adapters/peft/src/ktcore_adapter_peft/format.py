"""The standard PEFT LoRA directory: adapter_config.json + adapter_model.safetensors.

Expert LoRA is in PEFT's own ``target_parameters`` layout, so the directory loads in plain
``PeftModel.from_pretrained`` on plain transformers. PEFT nests one ``ParamWrapper`` per targeted expert
parameter (gate_up_proj innermost, under ``.base_layer``); reading tells the two apart by their shapes and
turns them into the canonical per-expert form (``ktcore.adapters.canonical``), writing does the reverse.
Adapter settings the canonical form does not carry (DoRA, rsLoRA, rank or alpha patterns, extra saved modules)
are refused rather than converted wrong.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ktcore.adapters import known_files
from ktcore.adapters.canonical import EXPERT_PARAMS, PEFT_PREFIX, Adapter, AdapterError, uniform_rank
from ktcore.adapters.integrity import PEFT_CONFIG, PEFT_FILES, PEFT_WEIGHTS, check_sidecar, write_peft_files
from ktcore.adapters.locate import local_adapter_path, safetensors_header
from ktcore.files import atomic_dir

# adapter_config.json fields that change the math in ways the canonical form does not carry
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "trainable_token_indices": None, "layer_replication": None,
                "fan_in_fan_out": False, "lora_bias": False}


class Format:
    name = "peft"

    def save(self, adapter: Adapter, dst, base=None) -> Path:
        return write_peft_dir(adapter, dst)

    def load(self, path, base=None) -> Adapter:
        return self._read(path)[1]

    def verify(self, path, base=None) -> list[str]:
        record, adapter = self._read(path)
        return [record,
                f"{PEFT_CONFIG}: LoRA, r={adapter.r}, lora_alpha={adapter.alpha:g}, no DoRA/rsLoRA/"
                "rank or alpha patterns",
                f"{PEFT_WEIGHTS}: {len(adapter.linear)} linear LoRA pairs, {len(adapter.experts)} expert "
                f"modules, every pair rank {adapter.r} with consistent shapes"]

    @staticmethod
    def _read(path):
        """(the integrity record's check or Note, the Adapter): no pickle, then the record, then the files."""
        cfg_file, _ = peft_files(path)
        record = check_sidecar(cfg_file.parent, PEFT_FILES)
        adapter = read_peft_dir(path)
        adapter.check()
        return record, adapter


def _strip_base_layers(module: str) -> tuple[str, int]:
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[: -len(".base_layer")], depth + 1
    return module, depth


def _expert_modules(config: dict) -> dict:
    """experts-module suffix ('mlp.experts') -> the parts PEFT targets there, from target_parameters."""
    found: dict[str, list[str]] = {}
    for target in config.get("target_parameters") or []:
        module, _, param = target.rpartition(".")
        if param == "weight":
            # a Linear's weight (ktcore's lora_targets gives PEFT a dense or shared-expert gate_proj/up_proj/
            # down_proj this way, where a target_modules name would be moved onto the routed experts): a plain
            # LoRA saved under the Linear's own lora_A/lora_B keys, read as one
            continue
        part = {v: k for k, v in EXPERT_PARAMS.items()}.get(param)
        if part is None:
            raise AdapterError(f"{PEFT_CONFIG}: target_parameters entry {target!r}: ktcore knows expert LoRA on "
                               f"{', '.join(EXPERT_PARAMS.values())} only")
        found.setdefault(module, []).append(part)
    return found


def check_peft_config(config: dict, where) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r}; only LoRA adapters are supported")
    for key, neutral in _UNSUPPORTED.items():
        value = config.get(key, neutral)
        if value not in (neutral, None, {}, [], False):
            raise AdapterError(f"{where}: {key}={value!r} is not supported by ktcore's adapter formats "
                               f"(retrain without it)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={config['bias']!r}; only bias='none' is supported")


def peft_files(path) -> tuple[Path, Path]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT directory; a pickled adapter_model.bin is
    never read (it can run code when unpickled), whatever else the directory holds."""
    path = local_adapter_path(path)
    cfg_file, weights = path / PEFT_CONFIG, path / PEFT_WEIGHTS
    if not cfg_file.is_file():
        raise AdapterError(f"{path}: no {PEFT_CONFIG}; not a PEFT adapter directory")
    if not weights.is_file():
        extra = " (adapter_model.bin is a pickle, which ktcore never loads; re-save with safe_serialization=True)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path}: no {PEFT_WEIGHTS}{extra}")
    return cfg_file, weights


def read_peft_config(cfg_file: Path) -> dict:
    """adapter_config.json, checked: a JSON object, LoRA with nothing the canonical form does not carry, an
    integer rank r > 0 and a number lora_alpha > 0."""
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{cfg_file}: not valid JSON ({exc}); save the adapter again") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{cfg_file}: must be a JSON object, got a {type(config).__name__}")
    check_peft_config(config, cfg_file)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"{cfg_file}: r must be an integer > 0, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{cfg_file}: lora_alpha must be a number > 0, got {alpha!r}")
    return config


def read_peft_dir(path) -> Adapter:
    """A standard PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) -> Adapter."""
    from safetensors.torch import load_file

    cfg_file, weights = peft_files(path)
    config = read_peft_config(cfg_file)
    r, alpha = config["r"], float(config["lora_alpha"])
    safetensors_header(weights)  # every entry checked against the file before a tensor is read
    state = load_file(str(weights))
    expert_suffixes = _expert_modules(config)
    pairs: dict[tuple[str, int], dict] = {}
    for key, value in state.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if not m or not key.startswith(PEFT_PREFIX):
            raise AdapterError(f"{weights}: unexpected tensor {key!r} (expected "
                               f"{PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        module, depth = _strip_base_layers(m.group(1)[len(PEFT_PREFIX):])
        pairs.setdefault((module, depth), {})[m.group(2)] = value
    linear, experts = {}, {}
    grouped: dict[str, list] = {}
    for (module, depth), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights}: module {module!r} has lora_{''.join(ab)} but not its partner")
        suffix = next((s for s in expert_suffixes if module == s or module.endswith("." + s)), None)
        if suffix is None:
            if depth:
                raise AdapterError(f"{weights}: nested LoRA on {module!r} is not a known expert parameter")
            linear[module] = (ab["A"], ab["B"])
        else:
            grouped.setdefault(module, []).append((depth, ab["A"], ab["B"], expert_suffixes[suffix]))
    for module, entries in grouped.items():
        experts[module] = _expert_pairs(module, entries, r, weights)
    return uniform_rank(r, alpha, linear, experts, config, config.get("base_model_name_or_path"))


def _expert_pairs(module: str, entries, r: int, where) -> dict:
    """Assign PEFT's nested ParamWrapper pairs to gate_up/down by shape and reshape them per expert."""
    def per_expert(a, b):
        if a.shape[0] % r or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{where}: {module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} are not a "
                               f"rank-{r} expert LoRA")
        e = a.shape[0] // r
        return (a.reshape(e, r, a.shape[1]).contiguous(),
                b.reshape(b.shape[0], r, e).permute(2, 0, 1).contiguous())

    targeted = entries[0][3]
    if len(entries) == 1:
        if len(targeted) != 1:
            raise AdapterError(f"{where}: {module}: one expert LoRA saved but target_parameters lists "
                               f"{targeted}; cannot tell which it is")
        return {targeted[0]: per_expert(*entries[0][1:3])}
    if len(entries) != 2:
        raise AdapterError(f"{where}: {module}: {len(entries)} nested expert LoRAs; expected gate_up and down")
    (_, a0, b0, _), (_, a1, b1, _) = sorted(entries, key=lambda x: -x[0])  # innermost (deepest) first
    # gate_up: in = H, out = 2I; down: in = I, out = H -> exactly one assignment fits
    if a0.shape[1] == b1.shape[0] and b0.shape[0] == 2 * a1.shape[1]:
        return {"gate_up": per_expert(a0, b0), "down": per_expert(a1, b1)}
    if a1.shape[1] == b0.shape[0] and b1.shape[0] == 2 * a0.shape[1]:
        return {"gate_up": per_expert(a1, b1), "down": per_expert(a0, b0)}
    raise AdapterError(f"{where}: {module}: expert LoRA shapes do not match gate_up_proj/down_proj")


def write_peft_dir(adapter: Adapter, dst) -> Path:
    """Write a standard PEFT adapter directory atomically (a temp dir renamed into place)."""
    adapter.check()
    with atomic_dir(dst, known_files()) as tmp:
        write_peft_files(adapter, tmp)
    return Path(dst)
