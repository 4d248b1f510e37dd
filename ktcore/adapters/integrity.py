"""What every adapter passes before use, whatever its format: its files against the SHA-256 record ktcore wrote
with them, and its tensors' names, dtypes, values, rank/alpha and shapes against the base model.

A format plugin keeps its record where its format has room for one (fused_expert: ``kt_adapter_manifest.json``;
peft: the ``kt_integrity.json`` sidecar, which plain PEFT ignores; gguf: ``ktcore.adapter.integrity`` metadata);
``file_record``/``check_file`` are the one place file sizes and hashes are written and compared.
``check_contents`` is called by the dispatch (``ktcore.adapters``) on every adapter any format loads, so an
adapter without a record (made by another tool) is used only after these checks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

from ..files import atomic_write_bytes, sha256_file
from .canonical import EXPERT_PARAMS, Adapter, AdapterError

PEFT_CONFIG = "adapter_config.json"        # PEFT's own file names; the sidecar covers both
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_FILES = (PEFT_CONFIG, PEFT_WEIGHTS)
SIDECAR = "kt_integrity.json"
SIDECAR_FORMAT = "ktcore-adapter-integrity"
SIDECAR_VERSION = 1
# a module path as PyTorch names submodules: identifiers or indices joined by dots (no "..", "/", spaces)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
DTYPES = ("float32", "float16", "bfloat16")


class Note(str):
    """A line of ``verify``'s report that is a warning, not a passed check (``ktcore adapter verify`` marks it)."""


def no_record_note(where) -> Note:
    return Note(f"{where}: no integrity record: not written by ktcore (or the record was removed), so a change to "
                "its files cannot be detected; only its shapes, dtypes, rank/alpha and finiteness were checked")


# ---- file records (sizes and SHA-256) ------------------------------------------------------------------------


def file_record(path) -> dict:
    path = Path(path)
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def check_file(f: Path, meta, record) -> None:
    """``f`` is a regular file whose size and SHA-256 are the ones ``meta`` (from ``record``) lists."""
    if not isinstance(meta, dict):
        raise AdapterError(f"{record}: the entry for {f.name} must be an object with size and sha256; refusing")
    if f.is_symlink():
        raise AdapterError(f"{f}: is a symlink; refusing (adapter files must be regular files)")
    if not f.is_file():
        raise AdapterError(f"{f}: missing (listed in {Path(record).name}); write the adapter again")
    size = f.stat().st_size
    if size != meta.get("size"):
        raise AdapterError(f"{f}: size {size} bytes, {Path(record).name} says {meta.get('size')}: the file was "
                           "changed or truncated; write the adapter again")
    digest = sha256_file(f)
    if digest != meta.get("sha256"):
        raise AdapterError(f"{f}: SHA-256 {digest[:16]}... differs from {Path(record).name}'s "
                           f"{str(meta.get('sha256'))[:16]}...: the file was tampered with or corrupted; write the "
                           "adapter again")


def write_sidecar(directory, names) -> None:
    """``kt_integrity.json`` in ``directory``: the size and SHA-256 of each of ``names`` (written last)."""
    directory = Path(directory)
    record = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION,
              "files": {n: file_record(directory / n) for n in sorted(names)}}
    atomic_write_bytes(directory / SIDECAR, json.dumps(record, indent=1, sort_keys=True).encode())


def write_peft_files(adapter: Adapter, directory) -> tuple[str, ...]:
    """The standard PEFT files of ``adapter`` and their ``kt_integrity.json`` in ``directory`` (the peft format's
    whole directory; the half of a fused_expert directory plain PEFT reads); the names written."""
    from safetensors.torch import save_file

    from .canonical import peft_config_for, peft_state

    directory = Path(directory)
    save_file(peft_state(adapter), str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})
    (directory / PEFT_CONFIG).write_text(json.dumps(peft_config_for(adapter), indent=2, sort_keys=True),
                                         encoding="utf-8")
    write_sidecar(directory, PEFT_FILES)
    return PEFT_FILES + (SIDECAR,)


def check_sidecar(directory, required) -> str:
    """Check ``directory``'s ``kt_integrity.json`` (every file of ``required`` must be listed); the passed check,
    or a ``Note`` when there is no record."""
    directory = Path(directory)
    path = directory / SIDECAR
    if not path.exists():
        return no_record_note(directory)
    if path.is_symlink() or not path.is_file():
        raise AdapterError(f"{path}: not a regular file; refusing")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: not valid JSON ({exc}); write the adapter again") from exc
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or record.get("format") != SIDECAR_FORMAT:
        raise AdapterError(f"{path}: not a ktcore integrity record (format {SIDECAR_FORMAT!r} with a files object)")
    if record.get("version") != SIDECAR_VERSION:
        raise AdapterError(f"{path}: version {record.get('version')!r}; this ktcore reads version {SIDECAR_VERSION}")
    missing = sorted(set(required) - set(files))
    if missing:
        raise AdapterError(f"{path}: does not list {', '.join(missing)}; refusing")
    for name, meta in sorted(files.items()):
        if name not in required:
            raise AdapterError(f"{path}: lists {name!r}, which is no file of this format; refusing")
        check_file(directory / name, meta, path)
    return f"{SIDECAR}: {', '.join(sorted(files))} sizes and SHA-256 match"


# ---- contents (any format) -----------------------------------------------------------------------------------


def check_module_name(name, where) -> None:
    if not isinstance(name, str) or not _MODULE.fullmatch(name):
        raise AdapterError(f"{where}: {name!r} is not a module path (dotted names like "
                           "model.layers.0.self_attn.q_proj); refusing")


def check_contents(adapter: Adapter, where, base: Optional[Path] = None) -> list[str]:
    """Names, dtypes, finiteness, rank/alpha of every pair, and with ``base`` its shapes against the base."""
    import torch

    if not isinstance(adapter.r, int) or adapter.r <= 0:
        raise AdapterError(f"{where}: rank r={adapter.r!r} must be a positive integer")
    if not math.isfinite(adapter.alpha) or adapter.alpha <= 0:
        raise AdapterError(f"{where}: lora alpha={adapter.alpha!r} must be a finite number > 0")
    adapter.check()
    count = 0
    for key, a, b in adapter.tensors():
        module = key[0] if isinstance(key, tuple) else key
        check_module_name(module, where)
        for what, t in (("A", a), ("B", b)):
            if str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise AdapterError(f"{where}: LoRA {what} of {module} is {t.dtype}; only {', '.join(DTYPES)} are read")
            if not bool(torch.isfinite(t).all()):
                raise AdapterError(f"{where}: LoRA {what} of {module} holds NaN or Inf values; refusing")
        count += 1
    checks = [f"contents: {count} LoRA pairs with plain module names, dtypes {', '.join(DTYPES)}, finite values, "
              f"rank {adapter.r}, alpha {adapter.alpha:g}"]
    checks.append(check_against_base(adapter, base) if base is not None else Note(
        f"base model {adapter.base_model!r} is not here: modules and shapes not checked against it (--base DIR)"))
    return checks


def check_against_base(adapter: Adapter, base) -> str:
    """Every LoRA pair fits a tensor of the base model (shapes from its config, built on the meta device): a
    module or layer the base model does not have is refused."""
    from ..weights.loading import meta_model_of

    base = Path(base)
    _, model = meta_model_of(base)
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied lm_head keeps its own name
    for name, a, b in adapter.tensors():
        if isinstance(name, tuple):
            module, part = name
            weight = params.get(f"{module}.{EXPERT_PARAMS[part]}")
            got = (a.shape[0], b.shape[1], a.shape[2])
        else:
            module, weight = name, params.get(f"{name}.weight")
            got = (b.shape[0], a.shape[1])
        if weight is None:
            raise AdapterError(f"LoRA on {module}: the base model {base} has no such module (other base model, or "
                               "a layer it does not have); refusing")
        if tuple(got) != tuple(weight.shape):
            raise AdapterError(f"LoRA on {module}: delta shape {list(got)} does not match the base weight "
                               f"{list(weight.shape)} of {base} (other base model?)")
    return f"base {base}: every LoRA pair matches a module and weight shape of the base model"
