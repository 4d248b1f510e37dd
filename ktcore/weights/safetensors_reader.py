"""Reading HF safetensors checkpoints (one file or shards with an index), validated before use.

Only headers are read up front: every tensor a model needs is checked for presence, shape and dtype before
a byte of weights is loaded, so a broken checkpoint fails with the tensor name and file, leaving nothing
half-built. Tensor bytes are then read with plain positional reads straight into their destination (no
memory map), so pages of a file already streamed into the backend do not stay resident in this process.

``SafetensorsWeights`` gives a checkpoint's tensors under the model's names (after the architecture's
renames) and each layer's experts, per-expert keys or transformers 5's fused ones, as ``load_model`` asks.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import torch

from ..errors import CheckpointError
from ..files import inside_root
from ..experts import ExpertWeights
from ..model.wrap import canonical_weights

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.update({"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2})
FP8_DTYPES = tuple(DTYPES[n] for n in ("F8_E4M3", "F8_E5M2") if n in DTYPES)


class _Entry:
    __slots__ = ("file", "dtype", "shape", "start", "end")

    def __init__(self, file: Path, dtype, shape, start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def read_header(file: Path) -> tuple[dict, int]:
    """(tensor name -> metadata, offset of the data section) of one safetensors file, every entry checked (a
    known dtype, a shape of non-negative ints, data_offsets that fit the shape and the file) before use."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} does not fit a file of {size} bytes")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: unreadable safetensors file ({exc}); the file is truncated or corrupt, "
                              "write or download it again") from exc
    header.pop("__metadata__", None)
    base = 8 + header_len
    for name, meta in header.items():
        _check_entry(file, name, meta)
    end = max((meta["data_offsets"][1] for meta in header.values()), default=0)
    if base + end > size:
        raise CheckpointError(f"{file}: truncated ({size} bytes, header promises {base + end}); "
                              "write or download the file again")
    return header, base


def _check_entry(file: Path, name: str, meta) -> None:
    """One header entry: {"dtype": known, "shape": [ints >= 0], "data_offsets": [start, end]} whose byte range
    holds exactly the shape's elements."""
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
                                                 for x in v)
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or not ints(meta.get("shape")) or \
            not ints(meta.get("data_offsets")) or len(meta["data_offsets"]) != 2:
        raise CheckpointError(f"{file}: header entry {name!r} is not {{dtype, shape, data_offsets}} of a known "
                              f"dtype ({str(meta)[:80]}); the file is corrupt, write or download it again")
    start, end = meta["data_offsets"]
    numel = 1
    for d in meta["shape"]:
        numel *= d
    if end - start != numel * DTYPES[meta["dtype"]].itemsize:
        raise CheckpointError(f"{file}: tensor {name!r} spans bytes {start}..{end}, its shape {meta['shape']} "
                              f"({meta['dtype']}) needs {numel * DTYPES[meta['dtype']].itemsize}; the file is corrupt")


class SafetensorsCheckpoint:
    def __init__(self, path, fp8_block: tuple[int, int] = (128, 128)):
        self.root = Path(path)
        self.fp8_block = tuple(fp8_block)
        self._entries: dict[str, _Entry] = {}
        index = self.root / INDEX_NAME
        listed: Optional[dict] = None
        if index.is_file():
            try:
                listed = json.loads(index.read_text())["weight_map"]
                if not isinstance(listed, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: bad index JSON ({exc}); re-download or re-save the checkpoint") from exc
            files = sorted({inside_root(self.root, name, f"{index}: weight_map entry {key!r}")
                            for key, name in listed.items()})
        elif (self.root / SINGLE_NAME).is_file():
            files = [self.root / SINGLE_NAME]
        else:
            raise CheckpointError(f"{self.root}: no {SINGLE_NAME} or {INDEX_NAME}; is this a model directory?")
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard named in {INDEX_NAME} is missing")
            header, base = read_header(file)
            for name, meta in header.items():
                if listed is not None and self.root / listed.get(name, "") != file:
                    continue
                if meta["dtype"] not in DTYPES:
                    raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {meta['dtype']}")
                start, end = meta["data_offsets"]
                self._entries[name] = _Entry(file, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + start, base + end)
        for name, fname in (listed or {}).items():
            if name not in self._entries:
                raise CheckpointError(f"{self.root / fname}: tensor {name!r} is listed in {INDEX_NAME} but not in "
                                      "that shard")

    def close(self) -> None:
        pass  # files are opened per read

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self):
        return self._entries.keys()

    def file_of(self, name: str) -> Path:
        return self._entries[name].file

    def location(self, name: str) -> tuple[str, int]:
        """(file, offset) of the tensor's bytes."""
        return str(self._entries[name].file), self._entries[name].start

    def shape(self, name: str) -> tuple:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def expect(self, name: str, shape: tuple, what: str = "") -> None:
        if name not in self._entries:
            raise CheckpointError(f"{self.root}: tensor {name!r}{what} is missing from the checkpoint")
        got = self._entries[name].shape
        if got != tuple(shape):
            raise CheckpointError(f"{self._entries[name].file}: tensor {name!r} has shape {list(got)}, the model "
                                  f"needs {list(shape)}; the checkpoint does not match config.json")

    def _read_raw(self, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        entry = self._entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype) if out is None else out
        nbytes = entry.end - entry.start
        if out.numel() * out.element_size() != nbytes:
            raise CheckpointError(f"{entry.file}: tensor {name!r} holds {nbytes} bytes, its shape needs "
                                  f"{out.numel() * out.element_size()}")
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        with open(entry.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view], entry.start) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"{entry.file}: short read of tensor {name!r} ({got} of {nbytes} bytes)")
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy the tensor (as ``get`` gives it) into ``out``: read straight into it when it is contiguous and of
        the stored dtype (no intermediate copy), else through ``get``."""
        entry = self._entries[name]
        if out.dtype == entry.dtype and out.is_contiguous() and tuple(out.shape) == entry.shape and \
                entry.dtype not in FP8_DTYPES:
            self._read_raw(name, out)
        else:
            out.copy_(self.get(name))

    def read_many(self, reads: list[tuple[str, torch.Tensor]]) -> None:
        """``read_into`` for each ``(name, out)``, in the files' order (readahead then reads ahead of us)."""
        for name, out in sorted(reads, key=lambda read: self.location(read[0])):
            self.read_into(name, out)

    def get(self, name: str) -> torch.Tensor:
        """The tensor; FP8 weights with a ``<name>_scale_inv`` block scale come back dequantised (fp32)."""
        tensor = self._read_raw(name)
        scale_name = name + "_scale_inv"
        if tensor.dtype in FP8_DTYPES and scale_name in self._entries:
            tensor = dequantize_fp8_blocks(tensor, self._read_raw(scale_name), self.fp8_block)
        return tensor


# ---- under the model's names ------------------------------------------------------------------------

PARTS = ("gate", "up", "down")


def checkpoint_names(ckpt: SafetensorsCheckpoint, arch) -> dict:
    """model tensor name -> checkpoint tensor name, after the architecture's renames."""
    mapping = {}
    for key in ckpt.keys():
        name = key
        for pattern, replacement in arch.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        mapping[name] = key
    return mapping


def expert_dims(arch, module) -> tuple[int, int, int]:
    """(experts E, intermediate I, hidden H) of one experts module (a dense MLP is one expert)."""
    if arch.dense_mlp:
        inter, hidden = module.gate_proj.weight.shape
        return 1, inter, hidden
    num_experts, rows, cols = module.gate_up_proj.shape
    if getattr(module, "is_transposed", False):  # [E, H, 2I] instead of [E, 2I, H]
        return num_experts, cols // 2, rows
    return num_experts, rows // 2, cols


class SafetensorsExpertSource:
    """Where one layer's experts are in the checkpoint, validated against the model's shapes."""

    def __init__(self, ckpt: SafetensorsCheckpoint, arch, layer: int, module):
        self.ckpt, self.arch, self.layer = ckpt, arch, layer
        self.num_experts, inter, hidden = expert_dims(arch, module)
        self.shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # nn.Linear [out, in]
        self.module = module
        what = f" (routed experts of layer {layer})"
        if self._key("gate", 0) in ckpt:
            self.layout = "per_expert"
            for expert in range(self.num_experts):
                for part in PARTS:
                    ckpt.expect(self._key(part, expert), self.shapes[part], what)
        elif arch.fused_expert_keys and arch.fused_expert_keys["gate_up"].format(layer=layer) in ckpt:
            self.layout = "fused"
            ckpt.expect(self._fused("gate_up"), tuple(module.gate_up_proj.shape), what)
            ckpt.expect(self._fused("down"), tuple(module.down_proj.shape), what)
        else:
            looked = [self._key("gate", 0)] + ([self._fused("gate_up")] if arch.fused_expert_keys else [])
            raise CheckpointError(f"{ckpt.root}: no expert tensors for layer {layer} (looked for "
                                  f"{' and '.join(map(repr, looked))})")

    def _key(self, part: str, expert: int) -> str:
        return self.arch.expert_keys[part].format(layer=self.layer, expert=expert)

    def _fused(self, part: str) -> str:
        return self.arch.fused_expert_keys[part].format(layer=self.layer)

    def keys(self) -> list[str]:
        """The checkpoint tensors ``read`` reads."""
        if self.layout == "fused":
            return [self._fused("gate_up"), self._fused("down")]
        return [self._key(part, expert) for expert in range(self.num_experts) for part in PARTS]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype ``read`` gives these weights in without rounding: the stored one, or float32 for FP8 blocks
        (dequantised) and mixed dtypes."""
        dtypes = {self.ckpt.dtype(key) for key in self.keys()}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return torch.float32 if dtype in FP8_DTYPES else dtype

    def read(self, dtype, experts: Optional[range] = None) -> ExpertWeights:
        """The layer's experts as ``dtype`` (only ``experts``, a range of expert ids, when given)."""
        experts = experts if experts is not None else range(self.num_experts)
        if self.layout == "fused":
            weights = canonical_weights(self.module, self.ckpt.get(self._fused("gate_up")).to(dtype),
                                        self.ckpt.get(self._fused("down")).to(dtype))
            return ExpertWeights(*(t[experts.start:experts.stop] for t in (weights.gate, weights.up, weights.down)))
        out = ExpertWeights(*(torch.empty((len(experts), *self.shapes[p]), dtype=dtype) for p in PARTS))
        self.read_into(out, experts)
        return out

    def read_into(self, out: ExpertWeights, experts: Optional[range] = None) -> None:
        """``read`` into ``out``'s tensors ``[len(experts), ...]`` (views of a buffer, say), each tensor read
        straight into place where it is stored in ``out``'s dtype."""
        experts = experts if experts is not None else range(self.num_experts)
        if self.layout == "fused":
            weights = self.read(out.gate.dtype, experts)
            for part in PARTS:
                getattr(out, part).copy_(getattr(weights, part))
            return
        self.ckpt.read_many([(self._key(part, expert), getattr(out, part)[row])
                             for row, expert in enumerate(experts) for part in PARTS])


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint under the model's names (after the architecture's renames)."""

    def __init__(self, ckpt: SafetensorsCheckpoint, arch):
        self.ckpt, self.arch = ckpt, arch
        self.names = checkpoint_names(ckpt, arch)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def describe(self, name: str) -> str:
        return ""

    def expect(self, name: str, shape: tuple) -> None:
        self.ckpt.expect(self.names[name], shape)

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(self.names[name])

    def experts(self, layer: int, module) -> SafetensorsExpertSource:
        return SafetensorsExpertSource(self.ckpt, self.arch, layer, module)


def take_fp8_block(hf_config) -> tuple[int, int]:
    """The FP8 block size a checkpoint's ``quantization_config`` names (DeepSeek-V3: 128 x 128), removed from the
    transformers config: ktcore dequantises FP8 weights while reading, so the model is built unquantised."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return (128, 128)
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    del hf_config.quantization_config
    return tuple(quant.get("weight_block_size") or (128, 128))


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """DeepSeek-V3's FP8 layout: ``w = fp8 * scale_inv[i // rows, j // cols]`` over ``rows x cols`` blocks."""
    out_dim, in_dim = weight.shape
    rows, cols = block
    expected = (-(-out_dim // rows), -(-in_dim // cols))
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(f"FP8 weight {list(weight.shape)} needs {list(expected)} block scales of "
                              f"{rows}x{cols}, found {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(rows, 0)[:out_dim].repeat_interleave(cols, 1)[:, :in_dim]
    return weight.float() * scale
