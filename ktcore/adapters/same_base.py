"""Whether a base model is the one an adapter was made for: the recorded fingerprint, or else the same tensors.

An adapter records its base's path and fingerprint (``locate.base_fingerprint``). A GGUF file and a model
directory converted from it (transformers' ``from_pretrained(gguf_file=...)`` + ``save_pretrained``) have different
fingerprints but are the same model: the directory holds the GGUF's tensors dequantised. So when the fingerprint
differs and one side is a ``.gguf`` and the other a model directory, both still here, every tensor is compared under
the model's names (the readers ``load_model`` uses): the GGUF's dequantised values cast to the directory's stored
dtype must equal the directory's exactly. Anything else is refused with the first tensor that differs.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from .canonical import AdapterError
from .locate import base_fingerprint


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def tensor_difference(model_dir, gguf_file) -> Optional[str]:
    """None when ``model_dir`` holds exactly ``gguf_file``'s tensors (in its own dtype), else the first difference.
    (Remembered per file sizes and times: reading an adapter checks its base more than once.)"""
    stamps = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in [Path(gguf_file), *Path(model_dir).iterdir()])
    return _tensor_difference(str(Path(model_dir).resolve()), str(Path(gguf_file).resolve()), stamps)


@functools.lru_cache(maxsize=8)
def _tensor_difference(model_dir: str, gguf_file: str, stamps) -> Optional[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from ..model.wrap import expert_modules, find_arch
    from ..weights.gguf_reader import GGUFFile, GGUFWeights, gguf_config
    from ..weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint, SafetensorsWeights

    try:
        with GGUFFile(gguf_file) as file, SafetensorsCheckpoint(model_dir) as ckpt:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(gguf_config(file))
            arch = find_arch(model.config)
            gguf, hf = GGUFWeights(file, model, arch), SafetensorsWeights(ckpt, arch)
            modules = expert_modules(model, arch)
            prefixes = tuple(name + "." for _, name, _ in modules)
            dtype = None
            for name, _ in model.named_parameters():
                if name.startswith(prefixes) or (name not in gguf and name not in hf):
                    continue  # routed experts below; a tied head is in neither
                if name not in gguf or name not in hf:
                    return f"tensor {name} is in {'the GGUF' if name in gguf else 'the directory'} only"
                ours = hf.get(name)
                dtype = dtype or ours.dtype
                theirs = gguf.get(name)
                if theirs.numel() != ours.numel() or not torch.equal(theirs.reshape(ours.shape).to(ours.dtype), ours):
                    return f"tensor {name} differs"
            for layer, name, module in modules:
                a = gguf.experts(layer, module).read(dtype or torch.float32)
                b = hf.experts(layer, module).read(dtype or torch.float32)
                for part in ("gate", "up", "down"):
                    if not torch.equal(getattr(a, part), getattr(b, part)):
                        return f"the {part} weights of {name} differ"
    except (CheckpointError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"cannot compare their tensors ({first})"
    return None


def check_base(adapter, recorded_path: Optional[str], fingerprint: Optional[str], base_path: Path) -> str:
    """The check that passed for ``base_path`` against the adapter's recorded base; raises AdapterError naming
    why the base is another model."""
    got = base_fingerprint(base_path)
    if got == fingerprint:
        return f"base model {base_path}: fingerprint matches"
    recorded = Path(recorded_path) if recorded_path else None
    refuse = (f"{adapter}: made for base model {recorded_path!r} (fingerprint {str(fingerprint)[:23]}...), but "
              f"{base_path} has fingerprint {got[:23]}...")
    pair = None if recorded is None else (
        (recorded, base_path) if _is_gguf(base_path) and recorded.is_dir() else
        (base_path, recorded) if _is_gguf(recorded) and base_path.is_dir() else None)
    if pair is None:
        gone = recorded is not None and not recorded.exists() and (_is_gguf(base_path) or base_path.is_dir())
        hint = f"; {recorded_path} is not here to compare tensors with" if gone else ""
        raise AdapterError(f"{refuse}: other base model{hint}; refusing")
    if base_fingerprint(recorded) != fingerprint:
        raise AdapterError(f"{refuse}, and {recorded} has changed since (its fingerprint differs too): other base model; refusing")
    reason = tensor_difference(*pair)
    if reason is not None:
        raise AdapterError(f"{refuse}, and it is not a conversion of {recorded} ({reason}): other base model; "
                           "refusing")
    return f"base model {base_path}: not the recorded {recorded}, but the same tensors (one converted from the other)"
