"""Reading HF safetensors checkpoints (one file or shards with an index), validated before use.

Only headers are read up front: every tensor a model needs is checked for presence, shape and dtype before
a byte of weights is loaded, so a broken checkpoint fails with the tensor name and file, leaving nothing
half-built. Tensors are then read one at a time from the memory-mapped files.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or does not fit the model; the message names the file and tensor."""


class SafetensorsCheckpoint:
    def __init__(self, path, fp8_block: tuple[int, int] = (128, 128)):
        from safetensors import safe_open

        self.root = Path(path)
        self.fp8_block = tuple(fp8_block)
        self._files: dict[str, Path] = {}  # tensor name -> file
        self._stack = ExitStack()
        self._handles = {}
        index = self.root / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: bad index JSON ({exc}); re-download or re-save the checkpoint") from exc
            for name, fname in weight_map.items():
                self._files[name] = self.root / fname
        elif (self.root / SINGLE_NAME).is_file():
            self._files = None  # filled from the header below
        else:
            raise CheckpointError(f"{self.root}: no {SINGLE_NAME} or {INDEX_NAME}; is this a model directory?")
        files = sorted(set(self._files.values())) if self._files is not None else [self.root / SINGLE_NAME]
        listed = {} if self._files is None else dict(self._files)
        self._files = {}
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard named in {INDEX_NAME} is missing")
            try:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a bad file
                raise CheckpointError(f"{file}: unreadable safetensors file ({exc}); the shard is truncated or "
                                      "corrupt, download it again") from exc
            self._handles[file] = handle
            size = file.stat().st_size
            for name in handle.keys():
                if name in listed and listed[name] != file:
                    continue
                self._files[name] = file
            _check_extent(file, size)
        for name, file in listed.items():
            if name not in self._files:
                raise CheckpointError(f"{file}: tensor {name!r} is listed in {INDEX_NAME} but not in that shard")

    def close(self) -> None:
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def keys(self):
        return self._files.keys()

    def file_of(self, name: str) -> Path:
        return self._files[name]

    def shape(self, name: str) -> tuple:
        return tuple(self._handles[self._files[name]].get_slice(name).get_shape())

    def expect(self, name: str, shape: tuple, what: str = "") -> None:
        if name not in self._files:
            raise CheckpointError(f"{self.root}: tensor {name!r}{what} is missing from the checkpoint")
        got = self.shape(name)
        if got != tuple(shape):
            raise CheckpointError(f"{self._files[name]}: tensor {name!r} has shape {list(got)}, the model needs "
                                  f"{list(shape)}; the checkpoint does not match config.json")

    def get(self, name: str) -> torch.Tensor:
        """The tensor; FP8 weights with a ``<name>_scale_inv`` block scale come back dequantised (fp32)."""
        try:
            tensor = self._handles[self._files[name]].get_tensor(name)
            scale_name = name + "_scale_inv"
            if tensor.dtype in FP8_DTYPES and scale_name in self._files:
                scale_inv = self._handles[self._files[scale_name]].get_tensor(scale_name)
                tensor = dequantize_fp8_blocks(tensor, scale_inv, self.fp8_block)
            return tensor
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{self._files[name]}: cannot read tensor {name!r} ({exc})") from exc


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


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


def _check_extent(file: Path, size: int) -> None:
    """A truncated shard still has a readable header; compare the data it promises with the file size."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    end = max((meta["data_offsets"][1] for key, meta in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{file}: truncated ({size} bytes, header promises {8 + header_len + end}); "
                              "download the shard again")
