"""GGUF block types as ktcore_llamafile sees them: names, ggml type numbers, sizes, and numpy/torch helpers
around the compiled quantisers and dequantisers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from ktcore.plugins.threads import usable_cores

# name -> ggml type number (GGMLQuantizationType)
TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "bf16": 30}
NAMES = {v: k for k, v in TYPES.items()}
# formats pack() can quantise dense weights into (the rest are read from GGUF files as they are)
QUANTISERS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k")
PARALLEL_ELEMENTS = 1 << 22  # quantize_rows splits tensors of more elements than this over the cores
DEFAULT_FORMAT = "q8_0"  # kt_expert_weight_format "gguf" for dense weights (auto keeps their float type)


def _ext():
    from . import _ext as ext

    return ext


def type_number(fmt) -> int:
    if isinstance(fmt, int):
        if fmt not in NAMES:
            raise ValueError(f"GGUF type {fmt} is not supported by the llamafile backend "
                             f"(supported: {', '.join(t.upper() for t in TYPES)})")
        return fmt
    name = str(getattr(fmt, "name", fmt)).lower()
    if name not in TYPES:
        raise ValueError(f"block type {fmt!r} is not supported by the llamafile backend "
                         f"(supported: {', '.join(TYPES)})")
    return TYPES[name]


def block_info(fmt) -> tuple[int, int]:
    """(elements per block, bytes per block); float types use 32-element padding blocks."""
    elems, nbytes, _, _ = _ext().type_info(type_number(fmt))
    return elems, nbytes


def padded(k: int, fmt) -> int:
    elems, _ = block_info(fmt)
    return (k + elems - 1) // elems * elems


def row_bytes(k: int, fmt) -> int:
    elems, nbytes = block_info(fmt)
    return padded(k, fmt) // elems * nbytes


def quantize_rows(w: torch.Tensor, fmt) -> torch.Tensor:
    """[..., K] float -> uint8 [..., row_bytes] blocks (rows zero-padded to the block size)."""
    t = type_number(fmt)
    k = w.shape[-1]
    kp = padded(k, t)
    lead = w.shape[:-1]
    src = w.detach().to("cpu", torch.float32).reshape(-1, k)
    if kp != k:
        src = torch.nn.functional.pad(src, (0, kp - k))
    src = src.contiguous()
    out = torch.empty(src.shape[0], row_bytes(k, t), dtype=torch.uint8)
    # rows are quantised independently: large tensors (a layer's experts) in row ranges on every usable core (the
    # extension releases the GIL), so writing a Q4_K model is not one core's work
    rows = src.shape[0]
    parts = min(usable_cores(), max(1, src.numel() // PARALLEL_ELEMENTS))
    bounds = [rows * i // parts for i in range(parts + 1)]

    def part(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            _ext().quantize(t, src[a].data_ptr(), (b - a) * kp, out[a].data_ptr())

    if parts == 1:
        part(0)
    else:
        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(part, range(parts)))
    return out.reshape(*lead, out.shape[-1])


def dequantize_rows(blocks, fmt, k: int | None = None) -> torch.Tensor:
    """uint8 [..., row_bytes] (torch or numpy) -> float32 [..., K] (K = k or the padded row length)."""
    t = type_number(fmt)
    if isinstance(blocks, np.ndarray):
        blocks = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8))
    blocks = blocks.contiguous()
    elems, nbytes = block_info(t)
    nb = blocks.shape[-1] // nbytes
    lead = blocks.shape[:-1]
    out = torch.empty(*lead, nb * elems, dtype=torch.float32)
    _ext().dequantize(t, blocks.data_ptr(), blocks.numel() // nbytes, out.data_ptr())
    return out if k is None else out[..., :k]
