"""The KT-compatible fused-expert LoRA artifact, validated fail-closed.

A directory::

    fused_expert_lora.safetensors   layers.L.experts.{gate,up,down}_lora_{a,b}   per MoE layer L
                                    gate/up/down_lora_a [E, r, in], gate/up/down_lora_b [E, out, r]
    non_expert_lora.safetensors     every other LoRA pair (attention, dense MLPs, shared experts) under PEFT's
                                    key names (base_model.model.<module>.lora_A.weight ...)
    kt_adapter_manifest.json        written last, atomically: version, status, expert weight format, base-model
                                    path and fingerprint, rank and alpha, each file's size and SHA-256, every
                                    tensor's shape and dtype, the PEFT config
    adapter_config.json,            the same adapter as a standard PEFT directory (``peft_files``: their sizes and
    adapter_model.safetensors,      SHA-256 in the manifest too), so plain ``PeftModel.from_pretrained`` reads
    kt_integrity.json               the directory (ignoring the fused files) and LLaMA-Factory's
                                    ``adapter_name_or_path`` takes it; ktcore reads the fused files (the
                                    directory sniffs as fused_expert: the format is declared ``beside`` peft)
                                    and refuses any PEFT file the manifest does not list with its hash

Rank when splitting PEFT's fused gate_up LoRA: PEFT trains one rank-r LoRA on ``gate_up_proj [E, 2I, H]`` whose A
is shared by the gate and up rows, so ``gate = (A, B[:, :I])`` and ``up = (A, B[:, I:])`` are exact LoRAs of
rank r each (A is stored twice). Going back, equal gate and up A give the rank-r fused LoRA again (bit-exact
round trip); separate gate/up LoRAs of rank r with different A need rank 2r fused
(``A = [A_g; A_u]``, ``B = [[B_g, 0], [0, B_u]]``): the whole PEFT adapter is then zero-padded to rank 2r
with alpha doubled, so every delta is unchanged.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ktcore.adapters import get_format, known_files
from ktcore.adapters.canonical import (PEFT_PREFIX, Adapter, AdapterError, fuse_gate_up, layer_of, peft_config_for,
                                       peft_state, split_expert_parts, uniform_rank)
from ktcore.adapters.locate import base_fingerprint, local_adapter_path, resolve_base, safetensors_header
from ktcore.adapters.integrity import PEFT_FILES, SIDECAR, check_file, file_record, write_peft_files
from ktcore.adapters.same_base import check_base
from ktcore.files import atomic_dir, atomic_write_bytes
from ktcore.outputs import MARKER as OUTPUT_MARKER

MANIFEST = "kt_adapter_manifest.json"
EXPERTS_FILE = "fused_expert_lora.safetensors"
NON_EXPERT_FILE = "non_expert_lora.safetensors"
FORMAT_ID = "ktcore-fused-expert-lora"
VERSION = 1
DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
PEFT_SIDE = PEFT_FILES + (SIDECAR,)  # what integrity.write_peft_files writes
_KEY = re.compile(r"layers\.(\d+)\.experts\.(gate|up|down)_lora_(a|b)")


def _dtype_name(dtype) -> str:
    import torch

    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]


def _template(modules) -> str:
    """One experts-module template with {layer} for every expert module name."""
    templates = {re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.{layer}.", m, count=1) for m in modules}
    if len(templates) != 1:
        raise AdapterError(f"expert LoRA on modules of different shapes of name ({sorted(templates)}); the "
                           "fused-expert format needs one experts module per layer")
    return templates.pop()


class Format:
    name = "fused_expert"

    # ---- writing -----------------------------------------------------------------------------------------
    def save(self, adapter: Adapter, dst, base=None) -> Path:
        from safetensors.torch import save_file

        adapter.check()
        base_path = resolve_base(adapter.base_model, base)
        if base_path is None:
            raise AdapterError(f"the fused-expert format records the base model's fingerprint: the adapter's base "
                               f"{adapter.base_model!r} is not a local path; pass the base model (--base DIR)")
        experts = {}
        for module, parts in adapter.experts.items():
            layer = layer_of(module)
            for part, (a, b) in split_expert_parts(parts).items():
                experts[f"layers.{layer}.experts.{part}_lora_a"] = a.contiguous()
                experts[f"layers.{layer}.experts.{part}_lora_b"] = b.contiguous()
        non_expert = peft_state(Adapter(adapter.r, adapter.alpha, linear=adapter.linear))
        dtypes = {_dtype_name(t.dtype) for t in experts.values()} or {_dtype_name(adapter.dtype)}
        if len(dtypes) != 1:
            raise AdapterError(f"expert LoRA tensors have mixed dtypes {sorted(dtypes)}")
        manifest = {
            "format": FORMAT_ID, "version": VERSION, "status": "complete",
            "expert_weight_format": DTYPES[dtypes.pop()],
            "experts_module": _template(adapter.experts) if adapter.experts else None,
            "gate_up": "split: gate and up share PEFT's fused A (rank r each, exact)",
            "base_model": {"path": str(Path(base_path).resolve()), "fingerprint": base_fingerprint(base_path)},
            "lora": {"r": adapter.r, "alpha": adapter.alpha, "scaling": adapter.scaling},
            "adapter_folder": ".",
            "peft_config": peft_config_for(adapter),
        }
        with atomic_dir(dst, known_files()) as tmp:
            save_file(experts, str(tmp / EXPERTS_FILE), metadata={"format": "pt"})
            save_file(non_expert, str(tmp / NON_EXPERT_FILE), metadata={"format": "pt"})
            manifest["files"] = {n: file_record(tmp / n) for n in (EXPERTS_FILE, NON_EXPERT_FILE)}
            manifest["tensors"] = {n: safetensors_header(tmp / n) for n in (EXPERTS_FILE, NON_EXPERT_FILE)}
            manifest["peft_files"] = {n: file_record(tmp / n) for n in write_peft_files(adapter, tmp)}
            atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        return Path(dst)

    # ---- validation (fail closed) -------------------------------------------------------------------------
    def check(self, path, base=None, expect_r=None, expect_alpha=None):
        """(manifest, folder, checks): every check passed, or AdapterError naming the file and the fix."""
        path = local_adapter_path(path)
        checks = []
        if path.is_symlink():
            raise AdapterError(f"{path}: the adapter directory is a symlink; refusing (copy the real directory)")
        if not path.is_dir():
            raise AdapterError(f"{path}: not a directory; a fused-expert adapter is a directory with {MANIFEST}")
        mfile = path / MANIFEST
        if mfile.is_symlink():
            raise AdapterError(f"{mfile}: is a symlink; refusing")
        if not mfile.is_file():
            raise AdapterError(f"{path}: missing {MANIFEST} (it is written last, so the write did not finish); "
                               "convert the adapter again")
        try:
            manifest = json.loads(mfile.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{mfile}: not valid JSON ({exc}); convert the adapter again") from exc
        if not isinstance(manifest, dict):
            raise AdapterError(f"{mfile}: must be a JSON object, got a {type(manifest).__name__}; convert the adapter "
                               "again")
        for key in ("files", "tensors", "lora", "base_model", "peft_config", "peft_files"):
            if not isinstance(manifest.get(key) or {}, dict):
                raise AdapterError(f"{mfile}: {key} must be an object, got a {type(manifest[key]).__name__}; "
                                   "convert the adapter again")
        if manifest.get("format") != FORMAT_ID:
            raise AdapterError(f"{mfile}: format {manifest.get('format')!r}, expected {FORMAT_ID!r}")
        if manifest.get("version") != VERSION:
            raise AdapterError(f"{mfile}: version {manifest.get('version')!r}; this ktcore reads version {VERSION} "
                               "(upgrade ktcore-adapter-fused-expert)")
        if manifest.get("status") != "complete":
            raise AdapterError(f"{mfile}: status {manifest.get('status')!r}, not 'complete'; convert again")
        checks.append(f"{MANIFEST}: format {FORMAT_ID} v{VERSION}, status complete")

        folder_name = manifest.get("adapter_folder", ".")
        if not isinstance(folder_name, str) or os.path.isabs(folder_name):
            raise AdapterError(f"{mfile}: adapter_folder {folder_name!r} must be a relative path inside the "
                               "adapter directory")
        root = path.resolve()
        folder = (path / folder_name)
        if not folder.resolve().is_relative_to(root):
            raise AdapterError(f"{mfile}: adapter_folder {folder_name!r} leaves the adapter root {path}; refusing")
        probe = folder
        while probe != path and probe != probe.parent:
            if probe.is_symlink():
                raise AdapterError(f"{mfile}: adapter_folder {folder_name!r} goes through a symlink ({probe}); "
                                   "refusing")
            probe = probe.parent
        if not folder.is_dir():
            raise AdapterError(f"{mfile}: adapter_folder {folder_name!r} does not exist")

        files = manifest.get("files") or {}
        if set(files) != {EXPERTS_FILE, NON_EXPERT_FILE}:
            raise AdapterError(f"{mfile}: lists files {sorted(files)}, expected {EXPERTS_FILE} and {NON_EXPERT_FILE}")
        for name, meta in files.items():
            check_file(folder / name, meta, mfile)
        peft_files = manifest.get("peft_files") or {}
        if peft_files and set(peft_files) != set(PEFT_SIDE):
            raise AdapterError(f"{mfile}: peft_files lists {sorted(peft_files)}, expected {', '.join(PEFT_SIDE)}")
        for name, meta in peft_files.items():  # the PEFT half, beside the fused files in the adapter root
            check_file(path / name, meta, mfile)
        allowed = {MANIFEST} | set(files) if folder.resolve() == root else {MANIFEST}
        allowed |= set(peft_files)  # a PEFT file the manifest does not list is an extra file, refused below
        allowed.add(OUTPUT_MARKER)  # `ktcore adapter convert`'s marker (ktcore.outputs): whose output this is
        for place in {root, folder.resolve()}:
            for entry in sorted(place.iterdir()):
                if entry.name in allowed or (place != root and entry.name in files):
                    continue
                if place == root and folder.resolve() != root and entry.resolve() == folder.resolve():
                    continue
                raise AdapterError(f"{entry}: extra file not listed in {MANIFEST}; refusing (remove it or convert "
                                   "again)")
        listed = ", ".join(sorted(files.keys() | peft_files.keys()))
        checks.append(f"files: {listed} present, regular, sizes and SHA-256 match; no extra files")

        tensors = manifest.get("tensors") or {}
        lora = manifest.get("lora") or {}
        r, alpha = lora.get("r"), lora.get("alpha")
        if not isinstance(r, int) or r <= 0 or not isinstance(alpha, (int, float)):
            raise AdapterError(f"{mfile}: lora.r / lora.alpha missing or invalid ({lora})")
        for name in files:
            header = safetensors_header(folder / name)
            declared = tensors.get(name) if isinstance(tensors.get(name), dict) else {}
            if set(header) != set(declared):
                diff = sorted(set(header) ^ set(declared))
                raise AdapterError(f"{folder / name}: tensors {diff[:4]} differ from the manifest's list")
            for key, info in header.items():
                want = declared[key] if isinstance(declared[key], dict) else {}
                if info["shape"] != want.get("shape"):
                    raise AdapterError(f"{folder / name}: tensor {key!r} has shape {info['shape']}, the manifest "
                                       f"says {want.get('shape')}; refusing")
                if info["dtype"] != want.get("dtype"):
                    raise AdapterError(f"{folder / name}: tensor {key!r} has dtype {info['dtype']}, the manifest "
                                       f"says {want.get('dtype')}; refusing")
        self._check_structure(folder, tensors, manifest, r)
        checks.append(f"tensors: shapes and dtypes match the manifest; every pair rank {r}; expert LoRA "
                      f"{manifest.get('expert_weight_format')}")

        peft_config = manifest.get("peft_config") or {}
        if peft_config.get("r") != r or peft_config.get("lora_alpha") != alpha:
            raise AdapterError(f"{mfile}: peft_config r={peft_config.get('r')}, lora_alpha="
                               f"{peft_config.get('lora_alpha')} disagree with lora r={r}, alpha={alpha}")
        if expect_r is not None and expect_r != r:
            raise AdapterError(f"{path}: rank r={r}, but r={expect_r} was asked for; refusing (other adapter?)")
        if expect_alpha is not None and float(expect_alpha) != float(alpha):
            raise AdapterError(f"{path}: lora alpha={alpha:g}, but alpha={expect_alpha:g} was asked for; refusing")
        checks.append(f"lora: r={r}, alpha={alpha:g} (scaling {alpha / r:g}) consistent")

        recorded = manifest.get("base_model") or {}
        base_path = resolve_base(recorded.get("path"), base)
        if base_path is not None:
            checks.append(check_base(path, recorded.get("path"), recorded.get("fingerprint"), base_path))
        else:
            checks.append(f"base model {recorded.get('path')!r}: not available here, fingerprint not checked")
        return manifest, folder, checks

    @staticmethod
    def _check_structure(folder, tensors, manifest, r: int) -> None:
        expert_dtype = {v: k for k, v in DTYPES.items()}.get(manifest.get("expert_weight_format"))
        layers: dict[int, dict] = {}
        for key, info in tensors[EXPERTS_FILE].items():
            m = _KEY.fullmatch(key)
            if not m:
                raise AdapterError(f"{folder / EXPERTS_FILE}: unexpected tensor {key!r} (expected "
                                   "layers.L.experts.{gate,up,down}_lora_{a,b})")
            if info["dtype"] != expert_dtype:
                raise AdapterError(f"{folder / EXPERTS_FILE}: tensor {key!r} is {info['dtype']}, the manifest's "
                                   f"expert_weight_format is {manifest.get('expert_weight_format')!r}")
            layers.setdefault(int(m.group(1)), {})[(m.group(2), m.group(3))] = info["shape"]
        for layer, parts in layers.items():
            for part in ("gate", "up", "down"):
                a, b = parts.get((part, "a")), parts.get((part, "b"))
                if a is None and b is None:
                    continue
                if a is None or b is None or len(a) != 3 or len(b) != 3 or a[1] != r or b[2] != r or a[0] != b[0]:
                    raise AdapterError(f"{folder / EXPERTS_FILE}: layers.{layer}.experts.{part}_lora_a {a} / _b {b} "
                                       f"are not a rank-{r} expert LoRA")
            if ("gate", "a") in parts and ("up", "a") not in parts or ("up", "a") in parts and ("gate", "a") not in parts:
                raise AdapterError(f"{folder / EXPERTS_FILE}: layer {layer} has gate LoRA without up LoRA or "
                                   "the reverse")
        for key, info in tensors[NON_EXPERT_FILE].items():
            if key.endswith(".lora_A.weight") and info["shape"][0] != r or \
                    key.endswith(".lora_B.weight") and info["shape"][-1] != r:
                raise AdapterError(f"{folder / NON_EXPERT_FILE}: tensor {key!r} {info['shape']} is not rank {r}")

    def verify(self, path, base=None, expect_r=None, expect_alpha=None) -> list[str]:
        manifest, _, checks = self.check(path, base, expect_r, expect_alpha)
        if manifest.get("peft_files"):
            checks.append(self._same_halves(path, base))
        return checks

    def _same_halves(self, path, base) -> str:
        """The PEFT half (what plain PEFT reads) holds exactly the LoRA of the fused files (what ktcore reads)."""
        ours = {k: (a, b) for k, a, b in self.load(path, base).tensors()}
        theirs = {k: (a, b) for k, a, b in get_format("peft").load(path, base).tensors()}
        same = ours.keys() == theirs.keys() and all(
            ours[k][0].equal(theirs[k][0]) and ours[k][1].equal(theirs[k][1]) for k in ours)
        if not same:
            raise AdapterError(f"{local_adapter_path(path)}: its PEFT files and its fused files hold different "
                               "LoRA tensors; refusing (convert the adapter again)")
        return f"{PEFT_SIDE[0]} + {PEFT_SIDE[1]}: the same LoRA tensors as the fused files (plain PEFT reads them)"

    # ---- reading -------------------------------------------------------------------------------------------
    def load(self, path, base=None, expect_r=None, expect_alpha=None) -> Adapter:
        from safetensors.torch import load_file

        manifest, folder, _ = self.check(path, base, expect_r, expect_alpha)
        r, alpha = manifest["lora"]["r"], float(manifest["lora"]["alpha"])
        experts_state = load_file(str(folder / EXPERTS_FILE))
        linear = {}
        for key, value in load_file(str(folder / NON_EXPERT_FILE)).items():
            m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.lora_([AB])\.weight", key)
            if not m:
                raise AdapterError(f"{folder / NON_EXPERT_FILE}: unexpected tensor {key!r}")
            linear.setdefault(m.group(1), {})[m.group(2)] = value
        for module, ab in linear.items():
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{folder / NON_EXPERT_FILE}: {module} lacks lora_A or lora_B")
        linear = {m: (ab["A"], ab["B"]) for m, ab in linear.items()}
        experts = {}
        template = manifest.get("experts_module")
        by_layer: dict[int, dict] = {}
        for key, value in experts_state.items():
            m = _KEY.fullmatch(key)
            by_layer.setdefault(int(m.group(1)), {})[(m.group(2), m.group(3))] = value
        for layer, t in sorted(by_layer.items()):
            if not template or "{layer}" not in template:
                raise AdapterError(f"{folder / MANIFEST}: experts_module {template!r} must contain {{layer}}")
            parts = {}
            if ("gate", "a") in t:
                a, b, _ = fuse_gate_up((t["gate", "a"], t["gate", "b"]), (t["up", "a"], t["up", "b"]))
                parts["gate_up"] = (a, b)
            if ("down", "a") in t:
                parts["down"] = (t["down", "a"], t["down", "b"])
            experts[template.format(layer=layer)] = parts
        base_model = (manifest.get("base_model") or {}).get("path")
        return uniform_rank(r, alpha, linear, experts, manifest.get("peft_config") or {}, base_model)
