"""Reusable page-aligned buffers, kept per thread, for converting one layer after another.

Touching fresh memory costs a page fault per page (on a virtual machine a large share of a conversion), and a
fresh map per layer would pay it for every layer; a thread's buffers are kept, keyed by their use, and grown
when a larger one is asked for. They go when the thread ends (``threading.local``), or when a larger buffer
replaces one and no tensor views it any longer.
"""

from __future__ import annotations

import mmap
import threading

import torch

_local = threading.local()


def buffer(key, nbytes: int) -> mmap.mmap:
    """This thread's reusable page-aligned buffer ``key`` (any hashable), at least ``nbytes`` long."""
    maps = _local.__dict__.setdefault("maps", {})
    buf = maps.get(key)
    if buf is None or len(buf) < nbytes:
        buf = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer page faults on first touch
            buf.madvise(mmap.MADV_HUGEPAGE)
        maps[key] = buf
    return buf


def reused(key, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` in this thread's buffer ``key`` (contents undefined; the previous tensor
    made with this key is overwritten)."""
    numel = 1
    for d in shape:
        numel *= d
    if not numel:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer(key, numel * dtype.itemsize), dtype=dtype, count=numel).reshape(shape)
