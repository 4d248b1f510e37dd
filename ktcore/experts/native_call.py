"""What the native backends' Python sides share when they call their kernels: tensor addresses, token rows in a
layout the kernels read, per-thread scratch buffers kept between calls, the routing their engines sort, and the
base class of a backend whose engine runs on thread pools."""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from . import ExpertBackendBase, ExpertLoRA


def address(t: Optional[torch.Tensor]) -> int:
    """A tensor's data address for a kernel argument; 0 (the kernels' "none") for None."""
    return 0 if t is None else t.data_ptr()


def engine_threads(config) -> tuple[int, int]:
    """(threads, pools) of a native backend's engine from a KTConfig: kt_num_threads (default: every core this process
    may run on) split over kt_threadpool_count pools when kt_tp_enabled, else one pool."""
    threads = config.kt_num_threads or len(os.sched_getaffinity(0))
    pools = config.kt_threadpool_count if config.kt_tp_enabled else 1
    return int(threads), int(pools)


def token_rows(t: torch.Tensor) -> torch.Tensor:
    """t [T, H] as the kernels read token rows: fp32 or bf16, contiguous."""
    return (t if t.dtype in (torch.float32, torch.bfloat16) else t.float()).contiguous()


class Workspace(threading.local):
    """Per-thread scratch buffers that live only within one forward or backward call, kept between calls.

    A fresh large tensor is mmapped and page-faulted in on every call, which costs as much as whole kernel phases
    (benchmarks/RESULTS.md). Buffers grow to the largest call seen and are never handed out of the call that asked
    for them."""

    def __init__(self):
        self.buffers: dict = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = torch.empty(n + n // 4, dtype=dtype)  # some headroom: the next batch may be a little larger
            self.buffers[name] = buf
        return buf[:n].view(shape)


@dataclass
class Route:
    """One call's routing as the native engines sort it: the (token, slot) pairs grouped by expert into rows."""

    T: int
    K: int
    R: int
    offsets: torch.Tensor  # int64 [E+1]
    padded: torch.Tensor  # int64 [E+1]: expert e's rows start at padded[e] in the engine's padded row buffers
    row_tok: torch.Tensor  # int32 [R]
    row_of: torch.Tensor  # int32 [T*K], -1 for no expert
    order: torch.Tensor  # int64 [R]: flat slot index of each row
    w_flat: torch.Tensor  # fp32 [T*K]
    w_row: torch.Tensor  # fp32 [R]

    @property
    def padded_rows(self) -> int:
        return int(self.padded[-1])


def route_rows(engine, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Route:
    """``engine.route``'s counting sort in C++ (no torch kernels, so torch's own CPU threads stay asleep)."""
    T, K = topk_ids.shape
    n = T * K
    ids = topk_ids.to(torch.int64).contiguous()
    w_flat = topk_weights.to(torch.float32).contiguous().view(-1)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64)
    padded = torch.empty(num_experts + 1, dtype=torch.int64)
    row_tok = torch.empty(n, dtype=torch.int32)
    row_of = torch.empty(n, dtype=torch.int32)
    order = torch.empty(n, dtype=torch.int64)
    w_row = torch.empty(n, dtype=torch.float32)
    R = engine.route(ids.data_ptr(), T, K, num_experts, w_flat.data_ptr(), offsets.data_ptr(), padded.data_ptr(),
                     row_tok.data_ptr(), row_of.data_ptr(), order.data_ptr(), w_row.data_ptr())
    return Route(T, K, R, offsets, padded, row_tok[:R], row_of, order[:R], w_flat, w_row[:R])


def combine_parts(engine, parts: torch.Tensor, route: Route, weighted: bool, dtype: torch.dtype,
                  pinned: bool) -> torch.Tensor:
    """``engine.combine``: each token's rows of ``parts`` [pools, R, H] summed into one [T, H] row, times the
    routing weights when ``weighted`` (the forward's y; backward's grad_x takes them earlier), as ``dtype``. The
    engine writes fp32 or bf16 (into pinned memory when asked); another dtype is cast from fp32."""
    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty(route.T, parts.shape[2], dtype=out_dtype, pin_memory=pinned)
    engine.combine(parts.data_ptr(), parts.shape[0], route.R, parts.shape[2], route.row_of.data_ptr(),
                   route.w_flat.data_ptr() if weighted else 0, route.T, route.K, out.data_ptr(),
                   out_dtype == torch.bfloat16)
    return out if out_dtype == dtype else out.to(dtype)


def check_lora_as_saved(ctx, lora_gu, lora_dn) -> None:
    """A backward gets the expert LoRA (or none) that its forward ran with and saved ``A x`` / ``A h`` of."""
    if (lora_gu is None) != (ctx.ax is None) or (lora_dn is None) != (ctx.ah is None):
        raise ValueError("backward's expert LoRA must be the one its forward ran with")


def unpack_tiles(blocks: torch.Tensor, ids: torch.Tensor, rows: int, cols: int, dtype: torch.dtype,
                 row_multiple: int) -> torch.Tensor:
    """Experts ``ids`` of one projection packed in tile blocks back to ``[len(ids), rows, cols]`` of ``dtype`` (a view
    of the padded result). The layout of amx_bf16 and amx_int8: blocks of 16 output rows x 64 bytes of inputs (32
    bf16 or 64 int8), block-major per expert, rows zero-padded to ``row_multiple`` and inputs to whole blocks; inside
    a block the 4 bytes of inputs 4j..4j+3 (bytes, whatever the dtype) of row r sit at word ``j * 16 + r``: a 16 x 16
    transpose of 32-bit words, done as one strided copy of words per expert."""
    group = 4 // dtype.itemsize  # inputs per 32-bit word
    row_blocks, col_blocks = -(-rows // row_multiple) * row_multiple // 16, -(-cols // (16 * group))
    words = blocks.view(torch.int32).view(-1, row_blocks, col_blocks, 16, 16)
    out = torch.empty(len(ids), row_blocks * 16, col_blocks * 16, dtype=torch.int32)
    grid = out.view(len(ids), row_blocks, 16, col_blocks, 16)
    for i, e in enumerate(ids.tolist()):
        grid[i].copy_(words[e].permute(0, 3, 1, 2))
    return out.view(dtype)[:, :rows, :cols]


class EngineBackend(ExpertBackendBase):
    """A backend whose compiled engine (``self._engine``: thread pools, a kernel table) computes the layer, and whose
    ``backward_parts`` leaves the expert-LoRA gradients for later: ``backward`` takes them at once."""

    @property
    def num_threads(self) -> int:
        return self._engine.num_threads

    @property
    def num_pools(self) -> int:
        return self._engine.num_pools

    @property
    def kernels(self) -> str:
        return self._engine.kernels

    def backward(self, packed, ctx, grad_y, lora: Optional[ExpertLoRA] = None):
        grad_x, grad_w, lora_grads = self.backward_parts(packed, ctx, grad_y, lora)
        return grad_x, grad_w, lora_grads()
