"""The op boundary between ktcore and an expert backend (DESIGN section 3), and the torch glue around it.

For one MoE layer with E experts, hidden size H, expert intermediate size I, top-k K and T tokens::

    y[t] = sum_k w[t,k] * down_e( act(gate_e x[t]) * up_e x[t] ),   e = ids[t,k]

Ids outside ``[0, E)`` mean "no expert" and contribute nothing. Expert LoRA uses PEFT's
``target_parameters`` layout: ``gate_up`` has a shared ``A [E, r, H]`` and ``B [E, 2I, r]`` (gate rows first),
``down`` has ``A [E, r, I]`` and ``B [E, H, r]``; the delta of expert e is ``scale * B[e] @ A[e]``.

Backends receive CPU tensors and return CPU tensors. ``ExpertsFunction`` moves data between the model's
device and the CPU and plugs the backend into autograd.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Optional, Protocol, runtime_checkable

import torch

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
    """What a backend implements. ``ExpertBackendBase`` supplies ``pack_source`` (None) and the async variants."""

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

    def submit_forward(self, packed, x, topk_ids, topk_weights, lora=None, save=False) -> Future: ...

    def submit_backward(self, packed, ctx, grad_y, lora=None) -> Future: ...

    def wait(self, handle: Future): ...


class ExpertBackendBase:
    """Shared plumbing: one worker thread per backend for submit/wait, so the caller (and the GPU) go on."""

    name = "base"

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

    def submit_forward(self, packed, x, topk_ids, topk_weights, lora=None, save=False) -> Future:
        return self._pool().submit(self.forward, packed, x, topk_ids, topk_weights, lora, save)

    def submit_backward(self, packed, ctx, grad_y, lora=None) -> Future:
        return self._pool().submit(self.backward, packed, ctx, grad_y, lora)

    def wait(self, handle: Future):
        return handle.result()

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


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
    """One MoE layer's packed experts and the backend computing them. Packed weights are shared, never copied."""

    def __init__(self, backend, packed, budget: ActivationBudget, cpu_activation: str, name: str = ""):
        self.backend = backend
        self.packed = packed
        self.budget = budget
        self.recompute = cpu_activation == "recompute"
        self.name = name

    def __deepcopy__(self, memo):
        return self  # immutable weights: a deep-copied model shares them

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 lora: Optional[ExpertLoRA] = None) -> torch.Tensor:
        lora = lora if lora is not None and not lora.empty else None
        lora_tensors = lora.tensors() if lora else (None,) * 4
        scales = (lora.gate_up_scale, lora.down_scale) if lora else (1.0, 1.0)
        return ExpertsFunction.apply(self, scales, x, topk_ids, topk_weights, *lora_tensors)


def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().to("cpu")


class ExpertsFunction(torch.autograd.Function):
    """Autograd node for the routed experts of one layer, computed by a CPU backend."""

    @staticmethod
    def forward(ctx, layer: ExpertLayer, scales, x, topk_ids, topk_weights, gu_a, gu_b, d_a, d_b):
        lora_dev = (gu_a, gu_b, d_a, d_b)
        lora = None
        if any(t is not None for t in lora_dev):
            lora = ExpertLoRA(*(_cpu(t) for t in lora_dev), gate_up_scale=scales[0], down_scale=scales[1])
        x_cpu, ids_cpu, w_cpu = _cpu(x), _cpu(topk_ids), _cpu(topk_weights)
        needs_grad = any(ctx.needs_input_grad)
        save = needs_grad and not layer.recompute and layer.budget.acquire()
        backend = layer.backend
        try:
            y, saved = backend.wait(backend.submit_forward(layer.packed, x_cpu, ids_cpu, w_cpu, lora, save))
        except BaseException:
            if save:
                layer.budget.release()
            raise
        if needs_grad:
            ctx.layer, ctx.lora, ctx.devices = layer, lora, (x.device, topk_weights.device,
                                                              [None if t is None else t.device for t in lora_dev])
            ctx.dtypes = (x.dtype, topk_weights.dtype, [None if t is None else t.dtype for t in lora_dev])
            if save:
                ctx.slot = _Slot(saved, layer.budget)
                ctx.inputs = None
            else:
                ctx.slot = None
                ctx.inputs = (x_cpu, ids_cpu, w_cpu)
        return y.to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        layer = ctx.layer
        backend = layer.backend
        if ctx.slot is not None:
            saved = ctx.slot.take()
        else:  # recompute the activations from the saved inputs
            x_cpu, ids_cpu, w_cpu = ctx.inputs
            _, saved = backend.wait(backend.submit_forward(layer.packed, x_cpu, ids_cpu, w_cpu, ctx.lora, True))
        grad_x, grad_w, lora_grads = backend.wait(
            backend.submit_backward(layer.packed, saved, _cpu(grad_y.contiguous()), ctx.lora))
        del saved
        x_dev, w_dev, lora_devs = ctx.devices
        x_dt, w_dt, lora_dts = ctx.dtypes
        grads_lora = []
        for g, dev, dt in zip(lora_grads.tensors(), lora_devs, lora_dts):
            grads_lora.append(None if g is None or dev is None else g.to(device=dev, dtype=dt))
        return (None, None, grad_x.to(device=x_dev, dtype=x_dt), None, grad_w.to(device=w_dev, dtype=w_dt),
                *grads_lora)
