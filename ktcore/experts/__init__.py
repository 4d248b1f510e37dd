"""The op boundary between ktcore and an expert backend (DESIGN section 3), and the torch glue around it.

For one MoE layer with E experts, hidden size H, expert intermediate size I, top-k K and T tokens::

    y[t] = sum_k w[t,k] * down_e( act(gate_e x[t]) * up_e x[t] ),   e = ids[t,k]

Ids outside ``[0, E)`` mean "no expert" and contribute nothing. Expert LoRA uses PEFT's
``target_parameters`` layout: ``gate_up`` has a shared ``A [E, r, H]`` and ``B [E, 2I, r]`` (gate rows first),
``down`` has ``A [E, r, I]`` and ``B [E, H, r]``; the delta of expert e is ``scale * B[e] @ A[e]``.

Backends receive CPU tensors and return CPU tensors. ``ExpertsFunction`` plugs the backend into autograd;
each call is an ``ExpertJob`` that stages tensors between the model's device and the CPU
(``ktcore.experts.staging``) and runs the backend on a worker thread, so the device can compute the shared
experts meanwhile (``ktcore.model.overlap``).
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from . import replay
from .staging import CudaStaging, stager, staging_for

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def activation_function(name: str):
    """The torch function for an activation name of ``ACTIVATIONS``."""
    import torch.nn.functional as F

    functions = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
                 "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
    if name not in functions:
        raise ValueError(f"activation {name!r} is not supported; choose one of {', '.join(ACTIVATIONS)}")
    return functions[name]


@dataclass
class ExpertWeights:
    """Dense expert weights: gate/up ``[E, I, H]``, down ``[E, H, I]``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def from_fused(cls, gate_up: torch.Tensor, down: torch.Tensor) -> "ExpertWeights":
        inter = gate_up.shape[1] // 2
        return cls(gate_up[:, :inter], gate_up[:, inter:], down)

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[1]

    def validate(self) -> None:
        e, i, h = self.gate.shape
        if self.up.shape != (e, i, h) or self.down.shape != (e, h, i):
            raise ValueError(f"expert weights disagree: gate {tuple(self.gate.shape)}, up {tuple(self.up.shape)}, "
                             f"down {tuple(self.down.shape)}; expected up [E, I, H] and down [E, H, I]")


@dataclass
class ExpertLoRA:
    """Expert LoRA factors (PEFT layout, see the module docstring); a None pair means no LoRA there."""

    gate_up_a: Optional[torch.Tensor] = None  # [E, r, H]
    gate_up_b: Optional[torch.Tensor] = None  # [E, 2I, r]
    down_a: Optional[torch.Tensor] = None  # [E, r, I]
    down_b: Optional[torch.Tensor] = None  # [E, H, r]
    gate_up_scale: float = 1.0
    down_scale: float = 1.0

    def tensors(self) -> tuple:
        return self.gate_up_a, self.gate_up_b, self.down_a, self.down_b

    def map(self, fn) -> "ExpertLoRA":
        a, b, c, d = (None if t is None else fn(t) for t in self.tensors())
        return ExpertLoRA(a, b, c, d, self.gate_up_scale, self.down_scale)

    @property
    def empty(self) -> bool:
        return all(t is None for t in self.tensors())


@dataclass
class ExpertLoRAGrads:
    gate_up_a: Optional[torch.Tensor] = None
    gate_up_b: Optional[torch.Tensor] = None
    down_a: Optional[torch.Tensor] = None
    down_b: Optional[torch.Tensor] = None

    def tensors(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


@runtime_checkable
class ExpertBackend(Protocol):
    """What a backend implements. ``ExpertBackendBase`` supplies ``pack_source`` (None), the async variants and
    ``backward_parts`` / ``submit_backward_parts`` (the expert-LoRA gradients after the input gradient; a backend
    without them is called through ``submit_backward``)."""

    name: str

    def pack(self, weights: ExpertWeights, activation: str = "silu") -> Any: ...

    def pack_source(self, source, activation: str = "silu") -> Any:
        """Packed weights straight from a checkpoint's expert ``source`` (zero-copy loading), or None to be
        given ``source.read(dtype)`` through ``pack`` instead."""

    def forward(self, packed, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                lora: Optional[ExpertLoRA] = None, save: bool = False) -> tuple[torch.Tensor, Any]:
        """y [T, H] in x's dtype, and a context for backward when ``save`` (else None)."""

    def backward(self, packed, ctx, grad_y: torch.Tensor, lora: Optional[ExpertLoRA] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, ExpertLoRAGrads]:
        """grad_x [T, H], grad_topk_weights [T, K] and the LoRA gradients."""

    def unpack(self, packed, ids: Optional[torch.Tensor] = None) -> Any:
        """The experts ``ids`` (long, any order; all without) of ``packed`` as this backend computes with them, in
        host memory in HF's layout: ``ExpertWeights`` (gate/up ``[n, I, H]``, down ``[n, H, I]``, any float
        dtype), or ``ktcore.experts.int8.Int8Experts`` for int8 codes. ``kt_num_gpu_experts`` copies the experts
        it keeps resident on the GPU from this, so host memory holds them once. Optional (``can_unpack``)."""

    def submit_forward(self, packed, x, topk_ids, topk_weights, lora=None, save=False) -> Future: ...

    def submit_backward(self, packed, ctx, grad_y, lora=None) -> Future: ...

    def wait(self, handle: Future): ...


class ExpertBackendBase:
    """Shared plumbing: one worker thread per backend for submit/wait, so the caller (and the GPU) go on."""

    name = "base"
    # Results in pinned host memory: set by ktcore once a layer of a model on a GPU calls the backend, so the
    # staging copies them to the device as they are, not after a host memcpy into a pinned buffer.
    pin_outputs = False

    def __init__(self, config):
        if not all(hasattr(config, key) for key in ("kt_num_threads", "kt_expert_weight_format")):
            raise TypeError(f"{type(self).__name__} takes a ktcore.config.KTConfig, got {type(config).__name__}; "
                            "ktcore.get_backend(name, config) parses dicts and YAML paths into one")
        self.config = config
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ktcore-{self.name}")
            return self._executor

    def pack_source(self, source, activation: str = "silu") -> Any:
        return None

    def unpack(self, packed, ids: Optional[torch.Tensor] = None) -> Any:
        raise NotImplementedError(f"the {self.name} backend does not unpack its experts")

    def submit_forward(self, packed, x, topk_ids, topk_weights, lora=None, save=False) -> Future:
        return self._pool().submit(self.forward, packed, x, topk_ids, topk_weights, lora, save)

    def submit_backward(self, packed, ctx, grad_y, lora=None) -> Future:
        return self._pool().submit(self.backward, packed, ctx, grad_y, lora)

    def backward_parts(self, packed, ctx, grad_y, lora=None):
        """``backward`` in two parts: ``(grad_x, grad_topk_weights, lora_grads)``, where ``lora_grads()`` returns the
        expert-LoRA gradients. The native backends compute them only then, so that the input gradient can go on
        first (``submit_backward_parts``); by default ``backward`` computes everything at once."""
        grad_x, grad_w, grads = self.backward(packed, ctx, grad_y, lora)
        return grad_x, grad_w, lambda: grads

    def submit_backward_parts(self, packed, ctx, grad_y, lora=None) -> tuple[Future, Future]:
        """``submit_backward`` with the results in two handles: ``(grad_x, grad_topk_weights)`` once the backend has
        them, then the expert-LoRA gradients, both from one task on the backend's worker (nothing else runs on the
        backend in between: ``lora_grads`` may read the call's workspace)."""
        first = Future()

        def run():
            try:
                grad_x, grad_w, lora_grads = self.backward_parts(packed, ctx, grad_y, lora)
            except BaseException as exc:
                first.set_exception(exc)
                raise
            first.set_result((grad_x, grad_w))
            return lora_grads()

        return first, self._pool().submit(run)

    def wait(self, handle: Future):
        return handle.result()

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


def can_unpack(backend) -> bool:
    """Whether ``backend`` (an instance or its class) implements ``ExpertBackend.unpack`` (the base class's
    raises)."""
    method = getattr(backend if isinstance(backend, type) else type(backend), "unpack", None)
    return method is not None and method is not ExpertBackendBase.unpack


class ActivationBudget:
    """Bounds how many MoE layers keep their expert activations for backward (``kt_max_cache_depth``).

    A layer that finds the budget spent saves only its inputs and recomputes in backward.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.in_use = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.in_use >= self.depth:
                return False
            self.in_use += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.in_use = max(0, self.in_use - 1)


class _Slot:
    """Holds a backend context; gives its budget slot back when consumed or garbage collected."""

    def __init__(self, ctx, budget: ActivationBudget):
        self.ctx = ctx
        self._finalizer = weakref.finalize(self, budget.release)

    def take(self):
        ctx, self.ctx = self.ctx, None
        self._finalizer()
        return ctx


class ExpertLayer:
    """One MoE layer's packed experts and the backend computing them. Packed weights are shared, never copied.

    ``overlap`` (set by ``ktcore.model.overlap``) lets the call return before the backend is done, so the device
    computes the block's shared experts meanwhile; ``timeline`` (set by ``ktcore.experts.timeline.attach``)
    records where the time goes.
    """

    def __init__(self, backend, packed, budget: ActivationBudget, cpu_activation: str, name: str = ""):
        self.backend = backend
        self.packed = packed
        self.budget = budget
        self.recompute = cpu_activation == "recompute"
        self.name = name
        self.overlap = None
        self.timeline = None

    def __deepcopy__(self, memo):
        return self  # immutable weights: a deep-copied model shares them

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 lora: Optional[ExpertLoRA] = None) -> torch.Tensor:
        y = replay.replayed()
        if y is not None:  # a checkpointed layer recomputed in backward: the backend's work is done already
            return y
        lora = lora if lora is not None and not lora.empty else None
        lora_tensors = lora.tensors() if lora else (None,) * 4
        scales = (lora.gate_up_scale, lora.down_scale) if lora else (1.0, 1.0)
        job = ExpertJob(self, scales, x, topk_weights, lora_tensors)
        deferred = self.overlap is not None and self.overlap.defers(x)
        link = ExpertLoRAGradients.apply(job, *lora_tensors) if lora else None
        y = ExpertsFunction.apply(job, deferred, x, topk_ids, topk_weights, link)
        if deferred:
            self.overlap.hold(job, y)  # made valid (ExpertsResult) once the shared experts are enqueued
        replay.record(y)
        return y


class ExpertJob:
    """One call of a layer's routed experts: inputs staged to the host, the backend's forward and backward run
    on the stager thread, results brought back to the model's device (``ktcore.experts.staging``).

    ``submit_*`` return at once; ``finish_*`` wait for the backend. Between the two the caller's device work
    (the shared experts) runs at the same time as the CPU.
    """

    def __init__(self, layer: ExpertLayer, scales, x, topk_weights, lora_dev):
        self.layer = layer
        self.scales = scales
        self.staging = staging_for(x.device)
        if isinstance(self.staging, CudaStaging) and hasattr(layer.backend, "pin_outputs"):
            layer.backend.pin_outputs = True
        self.timeline = layer.timeline
        # (shape, dtype) of what backward returns gradients for
        self.x_meta = (tuple(x.shape), x.dtype)
        self.w_meta = (tuple(topk_weights.shape), topk_weights.dtype)
        # (shape, dtype, in host memory) of each LoRA factor: the gradients of factors kept in host memory
        # (kt_expert_lora_device: host) stay there, neither pinned nor copied to the device
        self.lora_meta = [None if t is None else (tuple(t.shape), t.dtype, t.device.type == "cpu")
                          for t in lora_dev]
        self.lora_dev = lora_dev
        self.future = None
        self.mark = None  # see CudaStaging.alloc_mark
        self.needs_grad = False
        self.lora = None  # the expert LoRA as the backend got it (host tensors)
        self.slot = None  # the backend's saved activations, for backward
        self.inputs = None  # (x, ids, w) on the host, when backward recomputes the activations
        self.backward_submitted = False
        self.grad_targets = None
        self.input_grads = None  # Future: [grad_x, grad_w] pinned, before the expert-LoRA gradients (self.future)

    # -- forward -----------------------------------------------------------------------------------------------
    def submit_forward(self, x, topk_ids, topk_weights, needs_grad: bool, deferred: bool):
        """Start the forward; returns the device tensor the result will be written to (None: a new one)."""
        layer = self.layer
        inputs = self.staging.to_host([x, topk_ids, topk_weights], self.timeline)
        lora = None
        if any(t is not None for t in self.lora_dev):
            staged_lora = self.staging.to_host(self.lora_dev, self.timeline, "lora_copy")
            lora = (staged_lora, self.scales)
        self.needs_grad = needs_grad
        save = needs_grad and not layer.recompute and layer.budget.acquire()
        target = None
        if deferred or isinstance(self.staging, CudaStaging):
            target = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            self.mark = self.staging.alloc_mark()
        self.future = stager().submit(self._run_forward, inputs, lora, save)
        return target

    def _host_lora(self, lora) -> Optional[ExpertLoRA]:
        if lora is None:
            return None
        staged, (gu_scale, d_scale) = lora
        return ExpertLoRA(*staged.wait(), gate_up_scale=gu_scale, down_scale=d_scale)

    def _run_forward(self, inputs, lora, save: bool):
        layer, backend = self.layer, self.layer.backend
        try:
            x, ids, w = inputs.wait()
            if self.timeline:
                self.timeline.routed(layer, ids, w)
            self.lora = self._host_lora(lora)
            start = time.perf_counter()
            y, saved = backend.wait(backend.submit_forward(layer.packed, x, ids, w, self.lora, save))
            pinning = time.perf_counter()
            y = self.staging.pin(y, self.x_meta[1])
        except BaseException:
            if save:
                layer.budget.release()
            raise
        if self.timeline:
            self.timeline.cpu_span("experts", pinning - start)
            self.timeline.cpu_span("pin", time.perf_counter() - pinning)
        if save:
            self.slot = _Slot(saved, layer.budget)
        elif self.needs_grad:
            self.inputs = (x, ids, w)
        return y

    def finish_forward(self, target: Optional[torch.Tensor]) -> torch.Tensor:
        """Wait for the forward and put its result into target (or a new tensor on the model's device)."""
        idle_since = self._device_idle_mark()
        y = self._result()
        (out,) = self.staging.to_device([y], [target], self.mark, self.timeline, idle_since=idle_since)
        return out

    def _device_idle_mark(self):
        """With a timeline on CUDA: an event after the work queued so far, where the compute stream will run dry
        while this thread blocks on the backend's result."""
        if self.timeline is None or not isinstance(self.staging, CudaStaging):
            return None
        return self.timeline.gpu_mark(torch.cuda.current_stream(self.staging.device))

    def _result(self):
        start = time.perf_counter()
        try:
            return self.future.result()
        finally:
            if self.timeline:
                self.timeline.host_waited(time.perf_counter() - start)

    # -- backward ----------------------------------------------------------------------------------------------
    def submit_backward(self, grad_y: torch.Tensor) -> None:
        self.backward_submitted = True
        staged = self.staging.to_host([grad_y.contiguous()], self.timeline)
        if isinstance(self.staging, CudaStaging):
            device = grad_y.device
            metas = [self.x_meta, self.w_meta, *(None if m is None or m[2] else m for m in self.lora_meta)]
            self.grad_targets = [None if m is None else torch.empty(m[0], dtype=m[1], device=device)
                                 for m in metas]
            self.mark = self.staging.alloc_mark()
        self.input_grads = Future()
        self.future = stager().submit(self._run_backward, staged)

    def _run_backward(self, staged):
        """On the stager: [grad_x, grad_w] into ``input_grads`` as soon as the backend has them, then the expert-LoRA
        gradients as this task's result (the backend computes them meanwhile: ``submit_backward_parts``)."""
        layer, backend = self.layer, self.layer.backend
        pin = self.staging.pin
        try:
            (grad_y,) = staged.wait()
            start = time.perf_counter()
            if self.slot is not None:
                saved = self.slot.take()
            else:  # recompute the activations from the saved inputs
                x, ids, w = self.inputs
                _, saved = backend.wait(backend.submit_forward(layer.packed, x, ids, w, self.lora, True))
            if hasattr(backend, "submit_backward_parts"):  # ExpertBackendBase's
                first, rest = backend.submit_backward_parts(layer.packed, saved, grad_y, self.lora)
                grad_x, grad_w = backend.wait(first)
                lora_grads = lambda: backend.wait(rest)  # noqa: E731
            else:
                grad_x, grad_w, grads = backend.wait(backend.submit_backward(layer.packed, saved, grad_y, self.lora))
                lora_grads = lambda: grads  # noqa: E731
            del saved
            got = time.perf_counter()
            self.input_grads.set_result([pin(grad_x, self.x_meta[1]), pin(grad_w, self.w_meta[1])])
        except BaseException as exc:
            self.input_grads.set_exception(exc)
            raise
        pinned = time.perf_counter()
        grads = lora_grads().tensors()
        computed = time.perf_counter()
        grads = [None if g is None or m is None else g.to(m[1]) if m[2] else pin(g, m[1])
                 for g, m in zip(grads, self.lora_meta)]
        if self.timeline:
            self.timeline.cpu_span("experts", got - start + computed - pinned)
            self.timeline.cpu_span("pin", pinned - got + time.perf_counter() - computed)
        return grads

    def finish_backward(self) -> list:
        """Wait for the input gradients: [grad_x, grad_topk_weights] on the model's device."""
        idle_since = self._device_idle_mark()
        start = time.perf_counter()
        try:
            grads = self.input_grads.result()
        finally:
            if self.timeline:
                self.timeline.host_waited(time.perf_counter() - start)
        targets = self.grad_targets or [None] * 2
        return self.staging.to_device(grads, targets[:2], self.mark, self.timeline, idle_since=idle_since)

    def finish_lora_backward(self) -> list:
        """Wait for the expert-LoRA gradients (computed after the input gradients): four tensors or None, on the
        model's device, or in host memory for factors kept there."""
        grads = self.future.result()
        targets = self.grad_targets[2:] if self.grad_targets else [None] * len(grads)
        on_host = [m is not None and m[2] for m in self.lora_meta]
        to_copy = [None if host else g for g, host in zip(grads, on_host)]
        copied = [None] * len(to_copy)
        if any(g is not None for g in to_copy):
            copied = self.staging.to_device(to_copy, targets, self.mark, self.timeline, "lora_copy")
        return [g if host else c for g, c, host in zip(grads, copied, on_host)]


class ExpertsFunction(torch.autograd.Function):
    """Autograd node for the routed experts of one layer, computed by a CPU backend. Its gradients are the input's
    and the routing weights'; the expert-LoRA factors' come through ``lora_link`` (``ExpertLoRAGradients``).

    Deferred (``ExpertLayer.overlap``): forward returns a tensor the backend has not filled yet; ``ExpertsResult``
    fills it in place before anything reads it.
    """

    @staticmethod
    def forward(ctx, job: ExpertJob, deferred: bool, x, topk_ids, topk_weights, lora_link):
        needs_grad = any(ctx.needs_input_grad)
        y = job.submit_forward(x, topk_ids, topk_weights, needs_grad, deferred)
        if not deferred:
            y = job.finish_forward(y)
        if needs_grad:
            ctx.job = job
            ctx.linked = lora_link is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        job = ctx.job
        if not job.backward_submitted:
            job.submit_backward(grad_y)
        grad_x, grad_w = job.finish_backward()
        return None, None, grad_x, None, grad_w, torch.zeros(()) if ctx.linked else None


class ExpertLoRAGradients(torch.autograd.Function):
    """The expert-LoRA factors' own autograd node: its output, a CPU scalar, is ``ExpertsFunction``'s
    ``lora_link``. The backend computes the factors' gradients after the input gradient
    (``ExpertBackendBase.submit_backward_parts``), so ``ExpertsFunction.backward`` hands the input gradient on at
    once; this node's backward waits for the factors' gradients. Reached through a CPU tensor, it runs on the
    thread that called ``backward()`` (autograd runs a GPU's nodes on that GPU's own thread), so with the model on
    a GPU the wait does not hold up the device's backward: the CPU computes the LoRA gradients while the GPU runs
    the layer's attention backward."""

    @staticmethod
    def forward(ctx, job: ExpertJob, *factors):
        ctx.job = job
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _):
        return None, *ctx.job.finish_lora_backward()


class ExpertsResult(torch.autograd.Function):
    """Makes a deferred experts output valid, in place, at the point the model is about to read it.

    Its autograd node is created after the shared experts' nodes, so backward reaches it before them: it
    hands the output gradient to the backend there, and the CPU computes while the device runs the shared
    experts' backward; ``ExpertsFunction.backward`` then only waits.
    """

    @staticmethod
    def forward(ctx, job: ExpertJob, y):
        job.finish_forward(y)
        ctx.mark_dirty(y)
        ctx.job = job
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.job.submit_backward(grad)
        return None, grad
