"""Writing a safetensors model directory as a GGUF file, one tensor at a time.

The layout is llama.cpp's converter's: the family's metadata (its architecture plugin's ``gguf_metadata``), tensor
names from gguf's own name map (``GGUFNames``, what the reader uses), each layer's routed experts stacked into
``blk.L.ffn_{gate,up,down}_exps`` ``[E, rows, cols]``, 1-D tensors (norms) in F32 and the rest in the float type
they are stored in (BF16 stays BF16, so nothing is rounded). All tensor headers are written first and then the
data tensor by tensor, so host memory holds one layer's experts at most, never the model. The file is written
atomically. Quantising the experts is the backends' job (their ``converter``, e.g. ``ktcore convert``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # BF16 travels as its bits


def _shards(model_dir: Path) -> dict:
    """tensor name -> shard file of a save_pretrained directory."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    single = model_dir / "model.safetensors"
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


class _Tensors:
    """Lazy reads from the shards, each kept open (memory-mapped) once opened."""

    def __init__(self, shards: dict):
        self.shards, self.open = shards, {}

    def _file(self, name: str):
        from safetensors import safe_open

        path = self.shards[name]
        if path not in self.open:
            self.open[path] = safe_open(str(path), "pt")
        return self.open[path]

    def shape_dtype(self, name: str) -> tuple:
        view = self._file(name).get_slice(name)
        return tuple(view.get_shape()), view.get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


def _as_array(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


def _qtype(gguf, stored: str, ndim: int):
    if ndim == 1 or stored not in _NUMPY:
        return gguf.GGMLQuantizationType.F32, np.float32
    return gguf.GGMLQuantizationType[stored], _NUMPY[stored]


def writable_arch(config, where):
    """The architecture plugin of ``config`` if ktcore can write it as GGUF, else one line naming ``where``."""
    from ..model.wrap import find_arch

    arch = find_arch(config)
    if not arch.gguf_metadata:
        raise CheckpointError(f"{where}: ktcore writes no GGUF of the {arch.name} family (its architecture plugin "
                              "has no gguf_metadata); use a DeepSeek-V2 model (--shape deepseek-v2-lite)")
    return arch


def write_gguf(model_dir, dst) -> Path:
    """``model_dir`` (a save_pretrained directory of a family whose plugin has ``gguf_metadata``) as ``dst``."""
    import gguf
    from transformers import AutoConfig

    from ..files import atomic_file
    from ..specs import import_object
    from .gguf_reader import GGUFNames

    model_dir, dst = Path(model_dir), Path(dst)
    config = AutoConfig.from_pretrained(model_dir)
    arch = writable_arch(config, model_dir)
    tensors = _Tensors(_shards(model_dir))
    names = GGUFNames(arch, config.num_hidden_layers, model_dir)
    expert_keys = [re.compile(re.escape(k).replace(r"\{layer\}", r"(\d+)").replace(r"\{expert\}", r"\d+"))
                   for k in arch.expert_keys.values()]

    plan, expert_layers = [], set()  # (GGUF name, shape, qtype, numpy dtype, tensor name or one layer's experts)
    for name in tensors.shards:
        match = next((m for m in (k.fullmatch(name) for k in expert_keys) if m), None)
        if match:
            expert_layers.add(int(match.group(1)))
            continue
        hf_name = name
        for pattern, replacement in arch.checkpoint_renames:
            hf_name = re.sub(pattern, replacement, hf_name)
        target = names(hf_name)
        if target is None:
            raise CheckpointError(f"{model_dir}: tensor {name!r} has no GGUF name for the {arch.name} family")
        shape, stored = tensors.shape_dtype(name)
        plan.append((target, shape, *_qtype(gguf, stored, len(shape)), name))
    for layer in sorted(expert_layers):
        for part, template in arch.expert_keys.items():
            keys = []
            while template.format(layer=layer, expert=len(keys)) in tensors.shards:
                keys.append(template.format(layer=layer, expert=len(keys)))
            shape, stored = tensors.shape_dtype(keys[0])
            plan.append((arch.gguf_expert_keys[part].format(layer=layer), (len(keys), *shape),
                         *_qtype(gguf, stored, 2), keys))

    with atomic_file(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch.gguf_architecture)
        import_object(arch.gguf_metadata)(writer, config)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
        for target, shape, qtype, dtype, _ in plan:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            writer.add_tensor_info(target, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, _, _, dtype, source in plan:
            value = tensors.get(source) if isinstance(source, str) else torch.stack([tensors.get(k) for k in source])
            writer.write_tensor_data(_as_array(value.float() if dtype is np.float32 else value))
        writer.close()
    return dst
