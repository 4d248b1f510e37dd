"""Adapters in memory and on disk: the canonical LoRA form every adapter-format plugin converts to and from.

A trained adapter is one ``Adapter``: a uniform rank ``r`` and ``alpha`` (scaling ``alpha / r``), the LoRA of
ordinary linear layers (attention, dense MLPs, shared experts) by module name, and the routed-expert LoRA by
experts-module name in per-expert form::

    linear["model.layers.0.self_attn.q_proj"] = (A [r, in], B [out, r])          delta = scaling * B @ A
    experts["model.layers.0.mlp.experts"]["gate_up"] = (A [E, r, H], B [E, 2I, r])  delta_e = scaling * B[e] @ A[e]
    experts["model.layers.0.mlp.experts"]["down"]    = (A [E, r, I], B [E, H, r])

(gate rows first in ``gate_up``, transformers 5's fused layout). PEFT's own ``target_parameters`` files hold
``lora_A.weight [r*E, in]`` (reshaped ``(E, r, in)``, expert-major) and ``lora_B.weight [out, r*E]`` (reshaped
``(out, r, E)``, rank-major); ``read_peft_dir``/``write_peft_dir`` convert exactly (a reshape and a permute).

The format plugins (``ktcore-adapter-peft``, ``-fused-expert``, ``-gguf``) implement a class with
``sniff(path)``, ``save(adapter, dst, base=None)``, ``load(path, base=None)`` and ``verify(path, base=None)``;
``convert``, ``verify`` and ``load_adapter_into`` here dispatch to them by sniffing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import ConfigError

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
EXPERT_PARTS = ("gate_up", "down")
EXPERT_PARAMS = {"gate_up": "gate_up_proj", "down": "down_proj"}
# adapter_config.json fields that change the math in ways the canonical form does not carry
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "trainable_token_indices": None, "layer_replication": None,
                "fan_in_fan_out": False, "lora_bias": False}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class AdapterError(ConfigError):
    """An adapter that cannot be used; the message names the file/key and the fix (fail closed)."""


# ---- the canonical form -------------------------------------------------------------------------------------


@dataclass
class Adapter:
    r: int
    alpha: float
    linear: dict = field(default_factory=dict)   # module name -> (A [r, in], B [out, r])
    experts: dict = field(default_factory=dict)  # experts module name -> {"gate_up"|"down": (A, B)}
    peft_config: dict = field(default_factory=dict)
    base_model: Optional[str] = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def tensors(self):
        """(key, A, B) for every LoRA pair; key is a module name or (experts module, part)."""
        for name, (a, b) in self.linear.items():
            yield name, a, b
        for name, parts in self.experts.items():
            for part, (a, b) in parts.items():
                yield (name, part), a, b

    @property
    def dtype(self):
        for _, a, _ in self.tensors():
            return a.dtype
        import torch

        return torch.float32

    def check(self) -> None:
        """Every pair has rank r and consistent shapes."""
        for key, a, b in self.tensors():
            expert = isinstance(key, tuple)
            want = 3 if expert else 2
            if a.dim() != want or b.dim() != want or a.shape[-2] != self.r or b.shape[-1] != self.r or \
                    (expert and a.shape[0] != b.shape[0]):
                raise AdapterError(f"LoRA of {key}: A {list(a.shape)} and B {list(b.shape)} do not form a rank-"
                                   f"{self.r} {'expert ' if expert else ''}LoRA")

    def padded(self, r: int) -> "Adapter":
        """The same deltas at rank ``r`` >= self.r: zero rows of A / columns of B, alpha scaled (exact)."""
        return uniform_rank(self.r, self.alpha, dict(self.linear), dict(self.experts), self.peft_config,
                            self.base_model) if r == self.r else uniform_rank(
            self.r, self.alpha, {n: _pad_pair(a, b, r) for n, (a, b) in self.linear.items()},
            {n: {p: _pad_pair(a, b, r) for p, (a, b) in ps.items()} for n, ps in self.experts.items()},
            self.peft_config, self.base_model)


def split_gate_up(a, b):
    """PEFT's fused gate_up LoRA (A [E, r, H], B [E, 2I, r]) -> exact gate and up LoRAs of rank r each.

    gate and up share A; B's first I rows are gate's, the rest up's. No information is lost."""
    inter = b.shape[1] // 2
    return (a.contiguous(), b[:, :inter].contiguous()), (a.clone(), b[:, inter:].contiguous())


def split_expert_parts(parts: dict) -> dict:
    """One experts module's LoRA {"gate_up": (A, B), "down": (A, B)} -> {"gate", "up", "down"} pairs."""
    split = {}
    if "gate_up" in parts:
        split["gate"], split["up"] = split_gate_up(*parts["gate_up"])
    if "down" in parts:
        split["down"] = parts["down"]
    return split


def fuse_gate_up(gate, up):
    """Separate gate and up LoRAs -> one gate_up LoRA, and its rank.

    When both share A exactly (what ``split_gate_up`` writes) the result has rank r. Otherwise the exact fused
    LoRA needs rank 2r: A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]]."""
    import torch

    (ga, gb), (ua, ub) = gate, up
    if ga.shape == ua.shape and torch.equal(ga, ua):
        return ga, torch.cat([gb, ub], 1), ga.shape[-2]
    a = torch.cat([ga, ua], -2)
    b = torch.cat([torch.cat([gb, gb.new_zeros(*gb.shape[:-1], ua.shape[-2])], -1),
                   torch.cat([ub.new_zeros(*ub.shape[:-1], ga.shape[-2]), ub], -1)], 1)
    return a, b, ga.shape[-2] + ua.shape[-2]


def _pad_pair(a, b, r: int):
    import torch

    extra = r - a.shape[-2]
    if extra == 0:
        return a, b
    return (torch.cat([a, a.new_zeros(*a.shape[:-2], extra, a.shape[-1])], -2),
            torch.cat([b, b.new_zeros(*b.shape[:-1], extra)], -1))


def uniform_rank(adapter_r: int, alpha: float, linear: dict, experts: dict, peft_config: dict,
                 base_model=None) -> Adapter:
    """An Adapter from pairs of possibly different ranks (a rank-2r fused gate_up): every pair zero-padded to
    the largest rank, alpha scaled so the scaling stays alpha / adapter_r (exact)."""
    ranks = [a.shape[-2] for a, _ in linear.values()] + \
        [a.shape[-2] for parts in experts.values() for a, _ in parts.values()]
    top = max(ranks + [adapter_r])
    alpha_top = alpha * top / adapter_r
    out = Adapter(top, alpha_top, {n: _pad_pair(a, b, top) for n, (a, b) in linear.items()},
                  {n: {p: _pad_pair(a, b, top) for p, (a, b) in parts.items()} for n, parts in experts.items()},
                  {**peft_config, "r": top, "lora_alpha": alpha_top}, base_model)
    out.check()
    return out


def layer_of(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if not m:
        raise AdapterError(f"cannot tell the layer of module {name!r}")
    return int(m.group(1))


# ---- PEFT directories ---------------------------------------------------------------------------------------


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


def read_peft_dir(path) -> Adapter:
    """A standard PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) -> Adapter."""
    from safetensors.torch import load_file

    path = local_adapter_path(path)
    cfg_file, weights = path / PEFT_CONFIG, path / PEFT_WEIGHTS
    if not cfg_file.is_file():
        raise AdapterError(f"{path}: no {PEFT_CONFIG}; not a PEFT adapter directory")
    if not weights.is_file():
        extra = " (adapter_model.bin is a pickle; re-save with safe_serialization)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path}: no {PEFT_WEIGHTS}{extra}")
    config = json.loads(cfg_file.read_text(encoding="utf-8"))
    check_peft_config(config, cfg_file)
    r, alpha = int(config["r"]), float(config["lora_alpha"])
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


def peft_state(adapter: Adapter) -> dict:
    """The adapter_model.safetensors tensors of ``adapter`` (PEFT's key names and layouts)."""
    state = {}
    for name, (a, b) in adapter.linear.items():
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous()
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.contiguous()
    for name, parts in adapter.experts.items():
        for part, (a, b) in parts.items():
            # PEFT nests one ParamWrapper per targeted parameter in the module's parameter order (gate_up_proj
            # first, innermost): with both present gate_up sits under .base_layer
            inner = ".base_layer" if part == "gate_up" and "down" in parts else ""
            e, r = a.shape[0], a.shape[1]
            state[f"{PEFT_PREFIX}{name}{inner}.lora_A.weight"] = a.reshape(e * r, a.shape[2]).contiguous()
            state[f"{PEFT_PREFIX}{name}{inner}.lora_B.weight"] = \
                b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return state


def peft_config_for(adapter: Adapter) -> dict:
    config = dict(adapter.peft_config)
    config.setdefault("peft_type", "LORA")
    config.setdefault("task_type", "CAUSAL_LM")
    config.setdefault("bias", "none")
    config.setdefault("lora_dropout", 0.0)
    config.update(r=adapter.r, lora_alpha=adapter.alpha, rank_pattern={}, alpha_pattern={},
                  base_model_name_or_path=adapter.base_model)
    if not config.get("target_modules") and adapter.linear:
        config["target_modules"] = sorted({n.rsplit(".", 1)[-1] for n in adapter.linear})
    wanted = {re.sub(r"^.*?layers\.\d+\.", "", n) + "." + EXPERT_PARAMS[p]
              for n, parts in adapter.experts.items() for p in parts}
    if wanted and not set(config.get("target_parameters") or []) >= wanted:
        config["target_parameters"] = sorted(wanted)
    return config


def write_peft_dir(adapter: Adapter, dst) -> Path:
    """Write a standard PEFT adapter directory atomically (a temp dir renamed into place)."""
    from safetensors.torch import save_file

    adapter.check()
    with atomic_dir(dst) as tmp:
        save_file(peft_state(adapter), str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config_for(adapter), indent=2, sort_keys=True),
                                       encoding="utf-8")
    return Path(dst)


# ---- files: atomic writes, hashes, local paths ---------------------------------------------------------------


def fsync_path(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path, data: bytes) -> None:
    """temp file in the same directory + fsync + rename (+ fsync of the directory)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


@contextmanager
def atomic_dir(dst):
    """Yield a temp directory next to ``dst``; on success fsync its files and rename it to ``dst`` (an existing
    ``dst`` is replaced only then). On failure nothing at ``dst`` changes."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists() and not dst.is_dir():
        raise AdapterError(f"{dst} exists and is not a directory")
    ours = (PEFT_CONFIG, "kt_adapter_manifest.json", "fused_expert_lora.safetensors", "config.json")
    if dst.is_dir() and any(dst.iterdir()) and not any((dst / n).exists() for n in ours):
        raise AdapterError(f"{dst} exists and holds something other than an adapter or model; choose a new or empty "
                           "directory (it would be replaced)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_path(f)
        tmp.chmod(0o755)
        old = None
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.replace(dst, old)
        os.replace(tmp, dst)
        fsync_path(dst.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def safetensors_header(path) -> dict:
    """name -> {"dtype", "shape"} from a safetensors header (no tensor data read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise AdapterError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise AdapterError(f"{path}: implausible safetensors header size {n}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: {"dtype": v["dtype"], "shape": list(v["shape"])} for k, v in header.items()}


def local_adapter_path(value) -> Path:
    """The local path of an adapter; a Hugging Face Hub ID is refused (ktcore reads adapters offline)."""
    path = Path(value)
    if path.exists():
        return path
    text = str(value)
    if _HUB_ID.match(text) and not text.startswith((".", "/")):
        raise AdapterError(f"adapter {text!r} is not a local path and looks like a Hugging Face Hub ID; ktcore "
                           f"loads adapters offline only: download it first (huggingface-cli download {text} "
                           f"--local-dir DIR) and pass DIR")
    raise AdapterError(f"adapter path {text!r} does not exist")


def base_fingerprint(path) -> str:
    """sha256 over a base model's config.json (volatile keys dropped), its tensor names and shapes, and each
    weight file's size and first MiB of tensor data (cheap on a 600 GB checkpoint, yet different weights of the
    same architecture differ). A .gguf file: architecture, tensor names/shapes, file size and its first MiB."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture")
        h.update(b"gguf:" + (bytes(arch.parts[-1]) if arch else b"?"))
        for t in sorted(reader.tensors, key=lambda t: t.name):
            h.update(f"\n{t.name}:{list(map(int, t.shape))}".encode())
        with open(path, "rb") as fh:
            h.update(f"\n{path.stat().st_size}:".encode() + hashlib.sha256(fh.read(1 << 20)).digest())
        return "sha256:" + h.hexdigest()
    cfg = path / "config.json"
    if not cfg.is_file():
        raise AdapterError(f"base model {str(path)!r}: no config.json (need a local model directory or .gguf)")
    config = json.loads(cfg.read_text(encoding="utf-8"))
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(key, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    names = {}
    for f in sorted(path.glob("*.safetensors")):
        names.update({k: v["shape"] for k, v in safetensors_header(f).items()})
        with open(f, "rb") as fh:  # the first MiB of tensor data tells same-shaped models apart, cheaply
            (n,) = struct.unpack("<Q", fh.read(8))
            fh.seek(8 + n)
            h.update(f"\n{f.name}:{f.stat().st_size}:".encode() + hashlib.sha256(fh.read(1 << 20)).digest())
    if not names:
        raise AdapterError(f"base model {str(path)!r}: no *.safetensors files")
    for name in sorted(names):
        h.update(f"\n{name}:{names[name]}".encode())
    return "sha256:" + h.hexdigest()


def resolve_base(adapter_base: Optional[str], base=None) -> Optional[Path]:
    """The local base model: ``base`` if given, else the adapter's base_model_name_or_path if it exists."""
    if base is not None:
        path = Path(base)
        if not path.exists():
            raise AdapterError(f"base model {str(base)!r} does not exist")
        return path
    if adapter_base and Path(adapter_base).exists():
        return Path(adapter_base)
    return None


# ---- dispatch to the format plugins --------------------------------------------------------------------------


def format_names() -> list[str]:
    from ..plugins import get_registry

    return sorted(get_registry().specs("adapter_format"))


def get_format(name: str):
    """An instance of the adapter-format plugin ``name``."""
    from ..plugins import get_registry
    from ..specs import import_object

    spec = get_registry().get("adapter_format", name)
    return import_object(spec.factory)()


def sniff(path) -> str:
    """The name of the format of the adapter at ``path`` (exactly one plugin must claim it)."""
    path = local_adapter_path(path)
    claims = [n for n in format_names() if get_format(n).sniff(path)]
    if len(claims) == 1:
        return claims[0]
    if not claims:
        raise AdapterError(f"{path}: not an adapter in any installed format ({', '.join(format_names()) or 'none'}"
                           f" installed; `ktcore list-adapter-formats`)")
    raise AdapterError(f"{path}: claimed by several adapter formats ({', '.join(claims)})")


def load(path, base=None) -> Adapter:
    path = local_adapter_path(path)
    return get_format(sniff(path)).load(path, base=base)


def convert(src, dst, to: str = "peft", base=None) -> dict:
    """Read ``src`` (format sniffed), write ``dst`` in format ``to``; returns a summary."""
    src = local_adapter_path(src)
    source = sniff(src)
    target = get_format(to)
    adapter = get_format(source).load(src, base=base)
    target.save(adapter, dst, base=base)
    return {"from": source, "to": to, "src": str(src), "dst": str(dst), "r": adapter.r, "alpha": adapter.alpha,
            "linear": len(adapter.linear), "experts": len(adapter.experts)}


def verify(path, base=None) -> tuple[str, list[str]]:
    """(format, the checks that passed); raises AdapterError on the first failure."""
    path = local_adapter_path(path)
    name = sniff(path)
    return name, get_format(name).verify(path, base=base)


def load_adapter_into(model, path, base=None, is_trainable: bool = False):
    """A PeftModel of ``model`` with the adapter at ``path`` in any installed format (sniffed)."""
    from peft import PeftModel

    path = local_adapter_path(path)
    name = sniff(path)
    fmt = get_format(name)
    if name == "peft":
        fmt.verify(path, base=base)
        return PeftModel.from_pretrained(model, str(path), is_trainable=is_trainable)
    adapter = fmt.load(path, base=base)
    with tempfile.TemporaryDirectory(prefix="ktcore-adapter-") as tmp:
        write_peft_dir(adapter, Path(tmp) / "peft")
        return PeftModel.from_pretrained(model, str(Path(tmp) / "peft"), is_trainable=is_trainable)
