"""Recycled memory for the activations a backend's forward saves for its backward.

Fresh memory is paid for on first touch: a page fault per 4 KiB page, or the zeroing of each 2 MiB huge page.
A backend that allocated its saved activations anew on every forward paid that on every training step (the
amx_bf16 memory-bound layer: up to 7,700 faults per forward+backward for its 32 MB of saved rows, as the C
library happened to reuse freed memory or not). A pool keeps the buffers instead: a context's buffers go back
to the pool when the context is garbage collected (after its backward), so each step's forwards reuse, already
touched, what the previous step's backwards gave back.
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import hugepages

_HEADROOM = 1.25  # a new buffer is this much larger: the next batch may route a few more rows


class SavedBufferPool:
    """Idle buffers (uint8 tensors, huge-page backed when large), handed out through leases."""

    def __init__(self):
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def lease(self) -> "Lease":
        """Buffers for one saved context: keep the lease with the context."""
        return Lease(self)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._idle)

    def _take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._idle if b.numel() >= nbytes]
            if fits:
                best = min(fits, key=torch.Tensor.numel)
                self._idle = [b for b in self._idle if b is not best]
                return best
            # a miss: the idle buffers are all too small, and would only ever be for smaller batches than this
            self._idle.clear()
        return hugepages.empty(int(nbytes * _HEADROOM), torch.uint8)

    def _give_back(self, buffers: list) -> None:
        with self._lock:
            self._idle.extend(buffers)


class Lease:
    """Buffers taken from a pool for one saved context; they go back to the pool when the lease is garbage
    collected. Whoever holds the lease must not let views of its buffers outlive it."""

    def __init__(self, pool: SavedBufferPool):
        self._pool = pool
        self._buffers: list[torch.Tensor] = []
        weakref.finalize(self, pool._give_back, self._buffers)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of this shape and dtype, aligned like ``torch.empty``'s."""
        shape = tuple(shape)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = self._pool._take(nbytes)
        self._buffers.append(buf)
        return buf[:nbytes].view(dtype).view(shape)
