"""Where a training step's device memory goes, on a GPU and, for the same code path, without one.

``CudaMemory`` reads the CUDA caching allocator's own counters (what ``max_memory_allocated`` reports).
``LiveTensors`` counts the same thing for CPU tensors: every tensor storage an op of this thread creates or reads
is counted from then until it is garbage collected, so its peak is the peak of ``memory_allocated`` that the
same step would show on a GPU (up to the allocator's rounding to 512-byte blocks). The routed experts' backend
runs on other threads and is not counted: on a GPU that is host memory.

``StepMemory`` marks a step's phases on either: resident before the step (weights, LoRA, optimizer state), the
peak through the decoder layers, the saved activations when the layers are done, the peak of the loss, of the
backward and of the optimizer step (``ktcore bench train`` reports them).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2**30


class CudaMemory:
    """Bytes allocated on one CUDA device now, and the peak since ``reset_peak``."""

    def __init__(self, device: torch.device):
        self.device = device

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def tracking(self):
        yield self


class LiveTensors(TorchDispatchMode):
    """Bytes of the CPU tensor storages alive now that this thread's ops have created or read, and their peak.

    ``count(tensors)`` adds storages that exist already (a model's weights) before the step starts.
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}  # storage address -> bytes
        self._lock = threading.Lock()  # storages are freed on whichever thread drops the last reference
        self._current = 0
        self._peak = 0

    def current(self) -> int:
        return self._current

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._current

    @contextmanager
    def tracking(self):
        with self:
            yield self

    def count(self, tensors) -> None:
        for t in tensors:
            self._add(t)

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
            return
        storage = _storage(t)
        if storage is None:
            return
        key, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self._current += nbytes
            self._peak = max(self._peak, self._current)
        weakref.finalize(storage, self._drop, key, nbytes)

    def _drop(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._live.get(key) == nbytes:
                del self._live[key]
                self._current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((out, args, kwargs))[0]:
            self._add(t)
        return out


def memory_meter(device: torch.device):
    """The meter for a model on ``device``: the allocator's counters on CUDA, ``LiveTensors`` on the CPU."""
    return CudaMemory(device) if device.type == "cuda" else LiveTensors()


class StepMemory:
    """The peaks of one training step's phases, in bytes (the largest over the steps it sees).

    ``layers_done`` is called by a forward hook on the decoder stack (``watch``): what the forward holds then,
    less what was resident before the step, is the activations the layers saved for backward; the forward's
    peak after it is the loss's.
    """

    PHASES = ("resident", "layers_peak", "activations", "loss_peak", "backward_peak", "optimizer_peak")

    def __init__(self, meter):
        self.meter = meter
        self.values = dict.fromkeys(self.PHASES, 0)
        self._resident = 0

    def watch(self, model):
        """Hook the decoder stack of ``model`` (a PEFT model or a transformers causal LM); returns the handle."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return base.get_decoder().register_forward_hook(lambda module, args, output: self.layers_done())

    def _keep(self, phase: str, value: int) -> None:
        self.values[phase] = max(self.values[phase], value)

    def step_starts(self) -> None:
        self._resident = self.meter.current()
        self._keep("resident", self._resident)
        self.meter.reset_peak()

    def layers_done(self) -> None:
        self._keep("layers_peak", self.meter.peak())
        self._keep("activations", self.meter.current() - self._resident)
        self.meter.reset_peak()

    def forward_done(self) -> None:
        self._keep("loss_peak", self.meter.peak())
        self.meter.reset_peak()

    def backward_done(self) -> None:
        self._keep("backward_peak", self.meter.peak())
        self.meter.reset_peak()

    def optimizer_done(self) -> None:
        self._keep("optimizer_peak", self.meter.peak())

    def report(self) -> dict:
        """GiB per phase and the step's peak (``peak_phase``: the phase it is in)."""
        peaks = {p: self.values[p] for p in ("layers_peak", "loss_peak", "backward_peak", "optimizer_peak")}
        phase = max(peaks, key=peaks.get)
        return {**{f"{p}_gib": v / GIB for p, v in self.values.items()}, "step_peak_gib": peaks[phase] / GIB,
                "peak_phase": phase.removesuffix("_peak")}


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (None and zero-storage placeholders count nothing)."""
    seen = {}
    for t in tensors:
        storage = _storage(t) if isinstance(t, torch.Tensor) and not t.is_meta else None
        if storage is not None:
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def _storage(t: torch.Tensor):
    """t's storage, or None where it holds no memory (empty, or a zero-storage expert placeholder)."""
    try:
        storage = t.untyped_storage()
        return storage if storage.nbytes() and storage.data_ptr() else None
    except RuntimeError:  # "invalid python storage": nothing allocated
        return None


def resident_parts(model, optimizer: Optional[torch.optim.Optimizer] = None, device=None) -> dict:
    """GiB on ``device`` of the frozen weights, the trainable parameters and the optimizer state."""
    def on(ts):
        return [t for t in ts if isinstance(t, torch.Tensor) and (device is None or t.device == device)]

    frozen = on(p for p in model.parameters() if not p.requires_grad)
    frozen += on(model.buffers())
    trainable = on(p for p in model.parameters() if p.requires_grad)
    state = on(v for s in (optimizer.state.values() if optimizer else ()) for v in s.values())
    return {"weights_gib": tensor_bytes(frozen) / GIB, "trainable_gib": tensor_bytes(trainable) / GIB,
            "optimizer_state_gib": tensor_bytes(state) / GIB}
