"""What a GGUF block type does to dense weights, computed without ktcore_llamafile: gguf-py's quantisers and
dequantisers, and for Q4_K (gguf-py has no Q4_K quantiser) ggml's own reference quantiser,
``quantize_row_q4_K_ref`` from the compiled libggml-base that the pywhispercpp wheel ships (setup.sh installs it
with --no-deps; only that library is loaded, with ctypes)."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

FORMAT_NAMES = {"fp32": "f32"}  # kt_expert_weight_format spelling -> block type


@functools.cache
def _ggml_q4_k():
    """ggml's quantize_row_q4_K_ref(const float *x, block_q4_K *y, int64_t k), or the reason it is not here."""
    try:
        dist = importlib.metadata.distribution("pywhispercpp")
    except importlib.metadata.PackageNotFoundError:
        return "pywhispercpp (which ships ggml's libggml-base) is not installed: pip install --no-deps pywhispercpp"
    libs = [f for f in dist.files or () if f.name == "libggml-base.so"]
    if not libs:
        return "the installed pywhispercpp ships no libggml-base.so"
    fn = ctypes.CDLL(str(libs[0].locate())).quantize_row_q4_K_ref
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


def ggml_quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [rows, k] (k a multiple of 256) -> uint8 [rows, k / 256 * 144] Q4_K blocks, by ggml's own code."""
    fn = _ggml_q4_k()
    if isinstance(fn, str):
        pytest.skip(fn)
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], x.shape[1] // 256 * 144), dtype=np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def quantize_blocks(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [rows, k] (k a multiple of the block size) -> uint8 blocks [rows, row_bytes]."""
    fmt = FORMAT_NAMES.get(fmt, fmt)
    if fmt == "q4_k":
        return ggml_quantize_q4_k(x)
    return np.ascontiguousarray(quantize(x, Q[fmt.upper()])).view(np.uint8).reshape(x.shape[0], -1)


def round_trip(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` [..., k] as the block type ``fmt`` stores it: rows zero-padded to whole blocks, quantised, dequantised
    by gguf, cut back to k. Float32."""
    qtype = Q[FORMAT_NAMES.get(fmt, fmt).upper()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    k = w.shape[-1]
    rows = w.detach().to(torch.float32).reshape(-1, k).numpy()
    rows = np.pad(rows, ((0, 0), (0, -k % block)))
    back = dequantize(quantize_blocks(rows, fmt), qtype).reshape(rows.shape)[:, :k]
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(w.shape)
