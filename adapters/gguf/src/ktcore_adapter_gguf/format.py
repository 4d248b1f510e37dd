"""llama.cpp's LoRA adapter GGUF, read and written with the ``gguf`` package.

What llama.cpp checks when it loads an adapter (``llama_adapter_lora_init``) and what this module writes:

* ``general.type = "adapter"``, ``general.architecture`` = the base GGUF's architecture (``qwen3moe``,
  ``llama``, ...), ``adapter.type = "lora"``, ``adapter.lora.alpha`` (f32; llama.cpp scales each pair by
  ``alpha / rank``, rank = the A tensor's ``ne[1]``).
* One pair per base tensor, named after it: ``blk.L.attn_q.weight.lora_a`` / ``.lora_b``. In ggml's ``ne`` order
  (innermost first) a base weight is ``[in, out]``, ``lora_a`` is ``[in, r]`` and ``lora_b`` is ``[r, out]``;
  ``gguf`` reverses numpy shapes, so the arrays are PEFT's own ``A [r, in]`` and ``B [out, r]``.
* Routed experts: the base GGUF stores them stacked per projection, ``blk.L.ffn_{gate,up,down}_exps.weight``
  with ``ne = [in, out, E]``; llama.cpp applies the expert LoRA with ``ggml_mul_mat_id`` per selected expert, so
  ``lora_a`` is ``ne [in, r, E]`` (numpy ``[E, r, in]``) and ``lora_b`` is ``ne [r, out, E]`` (numpy
  ``[E, out, r]``). PEFT's fused ``gate_up_proj`` LoRA is split exactly into gate and up pairs of rank r that
  share A (see ``ktcore.adapters.canonical.split_gate_up``); reading back fuses them again (rank r when the two A are
  equal, else rank 2r, exact).
* Families whose q/k rows llama.cpp permutes for its rope (``gguf_rope_permuted`` in their architecture plugin:
  Llama, Mixtral): the q/k ``lora_b`` rows get the same permutation (inverted on import).

Tensors are written F32 (F16 adapters stay F16; BF16 ones are widened to F32, exactly). Extra keys under
``ktcore.adapter.*`` (ignored by llama.cpp) keep the PEFT config, the HF module of each tensor and the
base-model fingerprint, so PEFT -> GGUF -> PEFT is bit-exact. A GGUF LoRA from another tool (no
``ktcore.adapter.tensor_map``) is mapped back through the base model's config (``--base``).

The GGUF names of the base model's tensors (its GGUF architecture, gguf's name map plus the family's extra
names, the experts' names, the rope permutation) come from its architecture plugin, as for the GGUF loader.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ktcore.adapters.canonical import (Adapter, AdapterError, fuse_gate_up, layer_of, peft_config_for, split_expert_parts,
                                       uniform_rank)
from ktcore.adapters.integrity import check_module_name, no_record_note
from ktcore.adapters.locate import base_fingerprint, local_adapter_path, resolve_base
from ktcore.adapters.same_base import check_base
from ktcore.files import atomic_file
from ktcore.plugins import get_registry
from ktcore.weights.gguf_reader import (GGUFFile, GGUFNames, gguf_config, is_rope_permuted, rope_permute,
                                       rope_unpermute)

META = "ktcore.adapter."
INTEGRITY = META + "integrity"  # SHA-256 of every other metadata key and of every tensor's bytes


def integrity_record(reader) -> dict:
    """What ``ktcore.adapter.integrity`` records of a GGUF: a SHA-256 over every metadata key but itself (name,
    type, value: alpha, tensor_map, peft_config, base ...), and each tensor's type, shape and SHA-256."""
    meta = hashlib.sha256()
    for field in sorted(reader.fields.values(), key=lambda f: f.name):
        if field.name.startswith("GGUF.") or field.name == INTEGRITY:
            continue  # the file's own counts and version; the record itself
        value = field.contents()
        meta.update(json.dumps([field.name, [int(t) for t in field.types], value], sort_keys=True,
                               default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)).encode() + b"\n")
    tensors = {t.name: {"type": t.tensor_type.name, "shape": [int(d) for d in t.shape],
                        "sha256": hashlib.sha256(t.data.tobytes()).hexdigest()} for t in reader.tensors}
    return {"version": 1, "metadata_sha256": meta.hexdigest(), "tensors": tensors}


def check_integrity(reader, path) -> str:
    """The passed check of the file's integrity record, or a Note when it has none (made by another tool)."""
    text = _field(reader, INTEGRITY)
    if text is None:
        return no_record_note(path)
    try:
        recorded = json.loads(text)
    except ValueError as exc:
        raise AdapterError(f"{path}: {INTEGRITY} is not valid JSON ({exc}); convert the adapter again") from exc
    got = integrity_record(reader)
    if not isinstance(recorded, dict) or recorded.get("version") != got["version"]:
        raise AdapterError(f"{path}: {INTEGRITY} is not a version-{got['version']} integrity record; refusing")
    if recorded.get("metadata_sha256") != got["metadata_sha256"]:
        raise AdapterError(f"{path}: its metadata (alpha, tensor_map, peft_config, base model ...) differs from "
                           f"what {INTEGRITY} records: tampered with or corrupted; convert the adapter again")
    want = recorded.get("tensors") if isinstance(recorded.get("tensors"), dict) else {}
    for name in sorted(set(want) | set(got["tensors"])):
        if want.get(name) != got["tensors"].get(name):
            what = "is not in the file" if name not in got["tensors"] else "is not recorded" if name not in want \
                else "differs from the record (type, shape or SHA-256)"
            raise AdapterError(f"{path}: tensor {name!r} {what}: tampered with or corrupted; convert the adapter "
                               "again")
    return f"{path.name}: {INTEGRITY} matches (SHA-256 of the metadata and of {len(want)} tensors)"


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover
        raise AdapterError("the gguf adapter format needs the gguf package: pip install gguf") from exc
    return gguf


def _field(reader, key, default=None):
    f = reader.get_field(key)
    if f is None:
        return default
    value = f.parts[f.data[0]]
    if f.types and f.types[0] == _gguf().GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def _json_object(text, path, key) -> dict:
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise AdapterError(f"{path}: {META}{key} is not valid JSON ({exc}); convert the adapter again") from exc
    if not isinstance(value, dict):
        raise AdapterError(f"{path}: {META}{key} must be a JSON object, got a {type(value).__name__}")
    return value


def _tensor_map(text, path) -> dict:
    """``ktcore.adapter.tensor_map``: GGUF tensor -> HF module, or [experts module, gate|up|down]; every module a
    plain module path."""
    tmap = _json_object(text, path, "tensor_map")
    for target, source in tmap.items():
        module = source[0] if isinstance(source, list) and len(source) == 2 and source[1] in ("gate", "up", "down") \
            else source
        check_module_name(module, f"{path}: {META}tensor_map entry {target!r}")
    return tmap


class BaseInfo:
    """What naming the adapter's tensors needs from the base model (a model directory or a .gguf)."""

    def __init__(self, base: Path):
        from transformers import AutoConfig

        from ktcore.model.wrap import find_arch

        self.path = base
        if base.is_file() and base.suffix.lower() == ".gguf":
            with GGUFFile(base) as file:
                self.config = gguf_config(file)
        else:
            self.config = AutoConfig.from_pretrained(base)
        self.spec = find_arch(self.config)
        if not self.spec.gguf_architecture:
            raise AdapterError(f"{base}: the {self.spec.name} architecture plugin declares no GGUF architecture")
        self.arch = self.spec.gguf_architecture
        text = self.config.get_text_config()
        self.heads = int(text.num_attention_heads)
        self.kv_heads = int(getattr(text, "num_key_value_heads", None) or self.heads)
        self.names = GGUFNames(self.spec, int(text.num_hidden_layers), base)

    def gguf_name(self, module: str):
        return self.names(module + ".weight")

    def expert_name(self, part: str, module: str) -> str:
        return self.spec.gguf_expert_keys[part].format(layer=layer_of(module))

    def permuted_heads(self, target: str):
        """The head count of a q/k tensor whose rows llama.cpp permutes, else None."""
        if not is_rope_permuted(self.spec, target):
            return None
        return self.heads if ".attn_q." in target else self.kv_heads

    def inverse_map(self) -> dict:
        """GGUF tensor name -> HF module (or [experts module, part]) from the base config (foreign adapters)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        out = {}
        for name, _ in model.named_parameters():
            module, _, leaf = name.rpartition(".")
            if leaf in ("gate_up_proj", "down_proj") and module.endswith("experts"):
                for part in (("gate", "up") if leaf == "gate_up_proj" else ("down",)):
                    out[self.expert_name(part, module)] = [module, part]
            elif leaf == "weight" and (target := self.gguf_name(module)) is not None:
                out[target] = module
        return out


class Format:
    name = "gguf"

    # ---- writing -----------------------------------------------------------------------------------------
    def save(self, adapter: Adapter, dst, base=None) -> Path:
        import torch

        gguf = _gguf()
        adapter.check()
        base_path = resolve_base(adapter.base_model, base)
        if base_path is None:
            raise AdapterError(f"naming GGUF adapter tensors needs the base model; {adapter.base_model!r} is not a "
                               "local path: pass --base DIR (or the base .gguf)")
        info = BaseInfo(base_path)
        tensors, tmap = [], {}

        def add(target, a, b, source):
            tensors.append((target + ".lora_a", a))
            tensors.append((target + ".lora_b", b))
            tmap[target] = source

        for module, (a, b) in sorted(adapter.linear.items()):
            target = info.gguf_name(module)
            if target is None:
                raise AdapterError(f"LoRA on {module}: no GGUF tensor name for it in architecture {info.arch!r}")
            if target.startswith("token_embd"):
                raise AdapterError(f"LoRA on {module}: embedding LoRA is not supported in GGUF adapters")
            heads = info.permuted_heads(target)
            add(target, a, b if heads is None else rope_permute(b, heads), module)
        for module, parts in sorted(adapter.experts.items()):
            for part, (a, b) in split_expert_parts(parts).items():
                add(info.expert_name(part, module), a, b, [module, part])

        def write(target, extra: dict):
            writer = gguf.GGUFWriter(target, info.arch)
            writer.add_type(gguf.GGUFType.ADAPTER)
            writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
            writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(adapter.alpha))
            writer.add_string(META + "peft_config", json.dumps(peft_config_for(adapter), sort_keys=True))
            writer.add_string(META + "tensor_map", json.dumps(tmap, sort_keys=True))
            writer.add_string(META + "base_model", str(Path(base_path).resolve()))
            writer.add_string(META + "base_fingerprint", base_fingerprint(base_path))
            for key, value in extra.items():
                writer.add_string(key, value)
            for name, t in tensors:
                t = t.detach().cpu()
                t = t if t.dtype == torch.float16 else t.float()
                writer.add_tensor(name, t.contiguous().numpy())
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()

        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # The integrity record is computed from the file as the reader sees it (one code path for writing and
        # checking it): written once without it, read back, hashed, then written again with it.
        with atomic_file(dst) as tmp:
            draft = tmp.with_name(tmp.name + ".draft")
            try:
                write(draft, {})
                record = integrity_record(gguf.GGUFReader(str(draft)))
            finally:
                draft.unlink(missing_ok=True)
            write(tmp, {INTEGRITY: json.dumps(record, sort_keys=True)})
        return dst

    def written_by_ktcore(self, path) -> bool:
        """Whether ``path`` is a GGUF LoRA this format wrote (it has ktcore's tensor_map metadata): the one kind of
        file ``ktcore adapter convert --to gguf --overwrite`` may replace."""
        try:
            return _field(_gguf().GGUFReader(str(path)), META + "tensor_map") is not None
        except Exception:  # noqa: BLE001 - not a readable GGUF: not ours
            return False

    # ---- reading -------------------------------------------------------------------------------------------
    def _read(self, path, base=None):
        import torch

        gguf = _gguf()
        path = local_adapter_path(path)
        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
            raise AdapterError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        checks = [check_integrity(reader, path)]
        kind = _field(reader, "general.type")
        if kind != "adapter":
            raise AdapterError(f"{path}: general.type is {kind!r}, not 'adapter' (a base model GGUF, not a LoRA?)")
        if _field(reader, gguf.Keys.Adapter.TYPE) != "lora":
            raise AdapterError(f"{path}: adapter.type is {_field(reader, gguf.Keys.Adapter.TYPE)!r}, not 'lora'")
        alpha = _field(reader, gguf.Keys.Adapter.LORA_ALPHA)
        if not isinstance(alpha, (int, float)):
            raise AdapterError(f"{path}: adapter.lora.alpha is {alpha!r}, not a number")
        arch = _field(reader, "general.architecture")
        checks.append(f"{path.name}: general.type=adapter, adapter.type=lora, adapter.lora.alpha={alpha:g}, "
                      f"architecture {arch}")
        pairs: dict[str, dict] = {}
        for t in reader.tensors:
            m = re.fullmatch(r"(.+)\.lora_(a|b)", t.name)
            if not m:
                raise AdapterError(f"{path}: tensor {t.name!r} does not end in .lora_a/.lora_b")
            if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                raise AdapterError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}; only F32/F16 adapters can "
                                   "be read back")
            shape = [int(d) for d in reversed(list(t.shape))]
            value = torch.from_numpy(t.data.copy()).reshape(shape)
            pairs.setdefault(m.group(1), {})[m.group(2)] = value
        ranks = set()
        for target, ab in pairs.items():
            if set(ab) != {"a", "b"}:
                raise AdapterError(f"{path}: LoRA pair for {target!r} is missing one component")
            a, b = ab["a"], ab["b"]
            if a.dim() != b.dim() or a.shape[-2] != b.shape[-1] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
                raise AdapterError(f"{path}: {target}: lora_a {list(a.shape)} / lora_b {list(b.shape)} do not "
                                   "form a LoRA pair (lora_a not transposed?)")
            ranks.add(a.shape[-2])
        if len(ranks) > 1:
            raise AdapterError(f"{path}: pairs of different ranks {sorted(ranks)}; one rank per adapter is supported")
        r = ranks.pop() if ranks else 1
        checks.append(f"tensors: {len(pairs)} lora_a/lora_b pairs, every pair rank {r} with matching shapes")

        tmap_text = _field(reader, META + "tensor_map")
        tmap = _tensor_map(tmap_text, path) if tmap_text is not None else None  # before the base is read
        peft_config = _json_object(_field(reader, META + "peft_config") or "{}", path, "peft_config")
        recorded_base = _field(reader, META + "base_model")
        base_path = resolve_base(recorded_base, base)
        fingerprint = _field(reader, META + "base_fingerprint")
        if base_path is not None and fingerprint is not None:
            checks.append(check_base(path, recorded_base, fingerprint, base_path))
        info = BaseInfo(base_path) if base_path is not None else None
        if tmap is None and info is not None:
            tmap = info.inverse_map()
        elif tmap is None:
            raise AdapterError(f"{path}: a GGUF LoRA from another tool; mapping it back needs the base model "
                               "(--base DIR)")
        unknown = sorted(set(pairs) - set(tmap))
        if unknown:
            raise AdapterError(f"{path}: tensors {unknown[:3]} match no module of the base model (other base model?)")
        return reader, pairs, tmap, float(alpha), r, arch, info, peft_config, recorded_base, checks

    def load(self, path, base=None) -> Adapter:
        _, pairs, tmap, alpha, r, arch, info, peft_config, recorded_base, _ = self._read(path, base)
        linear, split = {}, {}
        for target, ab in pairs.items():
            source = tmap[target]
            a, b = ab["a"], ab["b"]
            if isinstance(source, list):
                split.setdefault(source[0], {})[source[1]] = (a, b)
                continue
            if info is not None:
                heads = info.permuted_heads(target)
                b = b if heads is None else rope_unpermute(b, heads)
            elif any(is_rope_permuted(s, target) for s in get_registry().specs("arch").values()
                     if s.gguf_architecture == arch):
                raise AdapterError(f"{target}: undoing llama.cpp's q/k row order needs the base model (--base)")
            linear[source] = (a, b)
        experts = {}
        for module, parts in split.items():
            out = {}
            if "gate" in parts or "up" in parts:
                if not ("gate" in parts and "up" in parts):
                    raise AdapterError(f"{module}: GGUF adapter has gate LoRA without up LoRA or the reverse")
                a, b, _ = fuse_gate_up(parts["gate"], parts["up"])
                out["gate_up"] = (a, b)
            if "down" in parts:
                out["down"] = parts["down"]
            experts[module] = out
        return uniform_rank(r, alpha, linear, experts, peft_config, recorded_base)

    def verify(self, path, base=None) -> list[str]:
        checks = self._read(path, base)[-1]
        self.load(path, base)
        checks.append("mapped back onto HF modules (attention/MLP names, expert gate/up fused)")
        return checks
