"""Moving one MoE layer's tensors between the model's device and the CPU expert backend.

With the model on the CPU there is nothing to move (``HostStaging``). With the model on a GPU
(``CudaStaging``) every copy runs on one side stream per device, ordered against the compute stream by
events only: device -> host copies land in pinned buffers that a worker thread reads once their event has
completed, and host -> device copies go into tensors that the compute stream waits for with
``wait_event``. Nothing here synchronises the device or a stream, so the compute stream keeps working while
the CPU computes.

Pinned buffers come from torch's caching host allocator: a buffer dropped after a step is handed out again in
a later step once the copies that used it have completed (torch records an event for every non-blocking copy
from or to pinned memory), so after the first step no pinned memory is allocated anew.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .timeline import Timeline


class HostStaging:
    """The model is not on a GPU: tensors go to the CPU and back with plain copies (none when already there)."""

    def __init__(self, device: torch.device):
        self.device = device

    def to_host(self, tensors: Sequence[Optional[torch.Tensor]], timeline=None, kind: str = "copy") -> "Staged":
        return Staged([None if t is None else t.detach().to("cpu") for t in tensors], None)

    def alloc_mark(self):
        return None

    def pin(self, t: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        return None if t is None else t.to(dtype or t.dtype)

    def to_device(self, host: Sequence[Optional[torch.Tensor]], targets: Sequence[Optional[torch.Tensor]],
                  after=None, timeline: Optional[Timeline] = None, kind: str = "copy", idle_since=None) -> list:
        """Each host tensor copied into its target, or moved to the model's device where the target is None."""
        out = []
        for h, t in zip(host, targets):
            if h is not None:
                h = t.copy_(h) if t is not None else h.to(self.device)
            out.append(h)
        return out


class Staged:
    """Host copies of some device tensors; readable once ``wait()`` returns."""

    def __init__(self, tensors: list, ready):
        self.tensors = tensors
        self.ready = ready  # a CUDA event, or None when the tensors are readable at once

    def wait(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()  # this event only: the device and its streams go on
        return self.tensors


class CudaStaging:
    """Copies between one GPU and pinned host memory on a side stream (see the module docstring)."""

    _streams: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = device
        with self._lock:
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream(device)
            self.side = self._streams[device]

    def to_host(self, tensors: Sequence[Optional[torch.Tensor]], timeline: Optional[Timeline] = None,
                kind: str = "copy") -> Staged:
        """Start device -> host copies of ``tensors`` once the current stream has computed them."""
        side = self.side
        side.wait_stream(torch.cuda.current_stream(self.device))
        out = []
        with torch.cuda.stream(side):
            start = timeline.gpu_mark(side) if timeline else None
            for t in tensors:
                if t is None:
                    out.append(None)
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t.detach(), non_blocking=True)
                t.record_stream(side)  # its memory must outlive the copy even if the caller frees it
                out.append(host)
            ready = torch.cuda.Event(enable_timing=timeline is not None)
            ready.record(side)
        if timeline:
            timeline.gpu_span(kind, start, ready)
        return Staged(out, ready)

    def alloc_mark(self):
        """An event on the current stream after allocating device targets: ``to_device`` writes them only once
        the current stream is past it (their memory may have been in use by earlier work of that stream)."""
        mark = torch.cuda.Event()
        mark.record(torch.cuda.current_stream(self.device))
        return mark

    def pin(self, t: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """t (a backend result) in a pinned buffer, converted to dtype: t itself when it is both already (a
        backend's ``pin_outputs``), else a host memcpy."""
        if t is None:
            return None
        if t.is_pinned() and t.dtype == (dtype or t.dtype):
            return t
        out = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=True)
        out.copy_(t)
        return out

    def to_device(self, host: Sequence[Optional[torch.Tensor]], targets: Sequence[Optional[torch.Tensor]],
                  after=None, timeline: Optional[Timeline] = None, kind: str = "copy", idle_since=None) -> list:
        """Copy pinned ``host`` tensors into device ``targets`` (allocated before ``after``, or fresh where None);
        the current stream waits for the copies, the host does not. ``idle_since``: see ``Timeline.gpu_wait``."""
        main = torch.cuda.current_stream(self.device)
        if any(t is None and h is not None for h, t in zip(host, targets)):
            after = None  # fresh targets are allocated now, so the side stream must follow the current one
            targets = [torch.empty(h.shape, dtype=h.dtype, device=self.device) if t is None and h is not None
                       else t for h, t in zip(host, targets)]
        side = self.side
        if after is None:
            side.wait_stream(main)
        else:
            side.wait_event(after)
        with torch.cuda.stream(side):
            start = timeline.gpu_mark(side) if timeline else None
            for h, t in zip(host, targets):
                if h is not None:
                    t.copy_(h, non_blocking=True)
            done = torch.cuda.Event(enable_timing=timeline is not None)
            done.record(side)
        if timeline:
            timeline.gpu_span(kind, start, done)
            timeline.gpu_wait(main, done, idle_since)
        main.wait_event(done)
        return [t if h is not None else None for h, t in zip(host, targets)]


def staging_for(device: torch.device):
    return CudaStaging(device) if device.type == "cuda" else HostStaging(device)


_stager: Optional[ThreadPoolExecutor] = None
_stager_lock = threading.Lock()


def stager() -> ThreadPoolExecutor:
    """The thread that waits for staged inputs, drives the backend and pins its results (one per process:
    MoE layers run one after another)."""
    global _stager
    with _stager_lock:
        if _stager is None:
            _stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ktcore-stage")
        return _stager
