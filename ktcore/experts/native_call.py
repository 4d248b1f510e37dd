"""What the native backends' Python sides share when they call their kernels: tensor addresses, token rows in a
layout the kernels read, and per-thread scratch buffers kept between calls."""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch


def address(t: Optional[torch.Tensor]) -> int:
    """A tensor's data address for a kernel argument; 0 (the kernels' "none") for None."""
    return 0 if t is None else t.data_ptr()


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
