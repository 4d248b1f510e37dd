"""Where a training step's time went, as the routed experts saw it (``ktcore bench train`` reads it).

Collected only while a ``Timeline`` is attached to the layers (``attach``); the hot path pays nothing
otherwise. Host spans are wall seconds measured by the threads that spend them; GPU spans are CUDA events,
read by ``resolve`` after the caller has synchronised at the end of the step.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

import torch


class Timeline:
    CPU_KINDS = ("experts", "pin")  # backend calls on the worker; memcpy of results into pinned buffers
    GPU_KINDS = ("copy", "lora_copy")  # side-stream copies of activations; of expert-LoRA factors and grads

    def __init__(self):
        self._lock = threading.Lock()
        self.routing = {}  # ExpertLayer -> (topk ids, topk weights) on the host, of its last call
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.cpu = {k: 0.0 for k in self.CPU_KINDS}
            self.host_wait = 0.0  # the thread driving the model, blocked on expert results
            self._spans = []  # (kind, start event, end event)
            self._waits = []  # (event where the compute stream reached its wait, event the wait is for)

    def cpu_span(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.cpu[kind] += seconds

    def host_waited(self, seconds: float) -> None:
        with self._lock:
            self.host_wait += seconds

    def routed(self, layer, ids: torch.Tensor, weights: torch.Tensor) -> None:
        with self._lock:
            self.routing[layer] = (ids, weights)

    @staticmethod
    def gpu_mark(stream) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def gpu_span(self, kind: str, start, end) -> None:
        with self._lock:
            self._spans.append((kind, start, end))

    def gpu_wait(self, stream, done, since=None) -> None:
        """The compute stream is about to wait for ``done``: the time between the two is the GPU idling. ``since``
        (an event of that stream) marks where it ran out of work instead, when the host blocked on the CPU result
        before it could queue the wait: from there the stream idled, empty, and the time since counts too."""
        reached = since or self.gpu_mark(stream)
        with self._lock:
            self._waits.append((reached, done))

    def resolve(self) -> dict:
        """Seconds per kind since ``reset`` (call after the step's work has completed on the device)."""
        with self._lock:
            out = {f"cpu_{k}_s": v for k, v in self.cpu.items()}
            out["host_wait_s"] = self.host_wait
            for kind in self.GPU_KINDS:
                out[f"gpu_{kind}_s"] = sum(s.elapsed_time(e) for k, s, e in self._spans if k == kind) / 1e3
            out["gpu_wait_s"] = sum(max(0.0, r.elapsed_time(d)) for r, d in self._waits) / 1e3
            return out


class LayerClock:
    """The CPU expert seconds of one layer's own calls (what ``auto`` placement learns from), passed on to the
    step's ``Timeline`` while one is attached (``step``)."""

    def __init__(self):
        self.step: Optional[Timeline] = None
        self._lock = threading.Lock()
        self._experts = 0.0

    def __bool__(self):
        return True

    def take(self) -> float:
        """The backend's seconds for this layer since the last ``take``."""
        with self._lock:
            seconds, self._experts = self._experts, 0.0
            return seconds

    def cpu_span(self, kind: str, seconds: float) -> None:
        if kind == "experts":
            with self._lock:
                self._experts += seconds
        if self.step:
            self.step.cpu_span(kind, seconds)

    def host_waited(self, seconds: float) -> None:
        if self.step:
            self.step.host_waited(seconds)

    def routed(self, layer, ids, weights) -> None:
        if self.step:
            self.step.routed(layer, ids, weights)

    def gpu_mark(self, stream):
        return self.step.gpu_mark(stream) if self.step else None

    def gpu_span(self, kind: str, start, end) -> None:
        if self.step and start is not None:
            self.step.gpu_span(kind, start, end)

    def gpu_wait(self, stream, done, since=None) -> None:
        if self.step:
            self.step.gpu_wait(stream, done, since)


@contextmanager
def attach(model, timeline: Optional[Timeline] = None):
    """Record into ``timeline`` (a new one by default) what every CPU-backend expert layer of ``model`` does."""
    timeline = timeline or Timeline()
    layers = list(model.ktcore.layers.values())
    for layer in layers:
        if isinstance(layer.timeline, LayerClock):
            layer.timeline.step = timeline
        else:
            layer.timeline = timeline
    try:
        yield timeline
    finally:
        for layer in layers:
            if isinstance(layer.timeline, LayerClock):
                layer.timeline.step = None
            else:
                layer.timeline = None
