"""``gpu_stream`` placement: routed experts live in host memory and are copied to the model's device for each use.

A streamed layer keeps its experts in HF's own layout (gate_up [E, 2I, H], down [E, H, I]) in pinned host memory
and computes on the device with ``device_experts``: transformers' own grouped experts kernel, and expert LoRA from
PEFT's factors beside the GEMMs (the placeholders still carry PEFT's factors, so adapters are unchanged). With int8
experts (``streams_int8``) the host keeps, the copy moves and the ring holds each projection's int8 codes and
per-channel scales (``ktcore.experts.int8``: the weights the int8 CPU backend computes with, half the bytes); a
layer dequantises them as it computes, so the GPU holds one bf16 copy of the computing layer beside the ring's
codes.

``ExpertStream`` is one model's ring: the device copies of the last ``ring`` layers used. While a layer computes,
the next one's copy runs on a side stream (the layer after in forward, the layer before in backward). Autograd
does not keep a layer's weights for backward: saved-tensor hooks replace every tensor that is (a view of) the
layer's device weights with a note, and backward fetches the layer again (from the ring if it is still there).

With the model on the CPU the same code runs without streams or copies, which is what the CPU tests compare
against the ``cpu`` placement and unmodified transformers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..experts.int8 import Int8Experts
from .device_experts import device_experts
from .pinned import pinned


def host_layout(weights, dtype) -> tuple[tuple, tuple]:
    """One layer's experts as the stream (and resident experts) keep them in host memory: (gate_up, down) in HF's
    layout, each projection ``(weight,)`` in ``dtype``, or for ``Int8Experts`` ``(codes [E, N, K], scales [E, N])``
    with gate and up concatenated along N (their scales are per output channel, so that is the fused matrix's)."""
    if isinstance(weights, Int8Experts):
        return (tuple(torch.cat([g, u], dim=1).contiguous() for g, u in zip(weights.gate, weights.up)),
                tuple(t.contiguous() for t in weights.down))
    return ((torch.cat([weights.gate, weights.up], dim=1).to(dtype).contiguous(),),
            (weights.down.to(dtype).contiguous(),))


def weight_of(part: tuple, dtype) -> torch.Tensor:
    """One projection's weights from what the host keeps of it (``host_layout``), where ``part`` lies: the weight
    itself, or int8 codes times their scales, computed in float32 and rounded once to ``dtype``
    (``ktcore.experts.int8.dequantize``'s bits, without its float32 copy of the layer on a GPU)."""
    if len(part) == 1:
        return part[0].to(dtype)
    codes, scales = part
    return torch.mul(codes, scales.unsqueeze(-1), out=torch.empty(codes.shape, dtype=dtype, device=codes.device))


@dataclass
class _Slot:
    """One layer's experts ``first..`` on the device, and the side-stream events around their copy."""

    first: int
    parts: tuple  # (gate_up, down) as the host keeps them (``host_layout``), on the device
    started: Optional[torch.cuda.Event] = None
    done: Optional[torch.cuda.Event] = None
    timed: bool = False  # the copy's time was handed to a caller (take_copy)


class ExpertStream:
    """Host copies of every streamed layer, and the ring of device copies."""

    def __init__(self, device, ring: int, recompute: bool = False):
        if ring < 1:
            raise ValueError(f"kt_config.kt_stream_ring must be >= 1, got {ring}")
        self.device = torch.device(device)
        self.ring = ring
        self.recompute = recompute  # kt_stream_activation: recompute
        self.host: list[tuple[tuple, tuple]] = []  # per streamed layer, in model order: (gate_up, down), see add
        self.base: list[int] = []  # per streamed layer: the layer's expert that host[index] starts with
        self.slots: OrderedDict = OrderedDict()  # layer index -> _Slot
        # the first expert a layer will fetch (an auto layer's planned split), what a prefetch copies; its base
        # when None; a layer's whole count or more: it streams nothing
        self.planner: Optional[Callable[[int], int]] = None
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.copied_bytes = 0  # host-to-device bytes so far (the bench reads it)
        self.dtype: Optional[torch.dtype] = None  # what int8 experts are dequantised to (the model's dtype)

    def add(self, gate_up: tuple, down: tuple, base: int = 0, dtype: Optional[torch.dtype] = None) -> int:
        """Keep one layer's experts ``base..`` (pinned when a GPU will read them); returns its index. Each projection
        is ``(weight,)`` or, int8, ``(codes, scales)`` to be dequantised to ``dtype`` on the device."""
        if self.side is not None:
            gate_up, down = (tuple(pinned(t, self) for t in part) for part in (gate_up, down))
        self.host.append((gate_up, down))
        self.base.append(base)
        self.dtype = dtype or self.dtype
        return len(self.host) - 1

    def experts(self, index: int) -> int:
        """How many experts the host keeps of layer ``index`` (its experts ``base[index]..``)."""
        return self.host[index][0][0].shape[0]

    def _copy(self, index: int, first: int) -> None:
        held = self.slots.get(index)
        if held is not None and held.first <= first:  # the copy held covers these experts: a view of it will do
            self.slots.move_to_end(index)
            return
        skip = first - self.base[index]
        host = tuple(tuple(t[skip:] for t in part) for part in self.host[index])  # contiguous: views, no copy
        if self.side is None:  # the model is on the CPU: the host copy is the device copy
            self.slots[index] = _Slot(first, host)
        else:
            with torch.cuda.stream(self.side):
                started = torch.cuda.Event(enable_timing=True)
                started.record(self.side)
                parts = tuple(tuple(t.to(self.device, non_blocking=True) for t in part) for part in host)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.side)
            self.slots[index] = _Slot(first, parts, started, done)
            self.copied_bytes += sum(t.numel() * t.element_size() for part in host for t in part)
        self.slots.move_to_end(index)
        while len(self.slots) > self.ring:
            self.slots.popitem(last=False)  # the oldest; a layer computing now still holds its own reference

    def fetch(self, index: int, direction: int, first: Optional[int] = None) -> tuple[tuple, tuple]:
        """Experts ``first..`` (default: all held) of layer ``index`` on the device as the host keeps them (the
        weights, or int8 codes and scales: ``weight_of`` makes them weights), ready for the compute stream; starts
        copying the layer ``direction`` (+1 forward, -1 backward) from it, to overlap this layer's compute (the
        experts ``planner`` says it will take)."""
        first = self.base[index] if first is None else first
        self._copy(index, first)
        slot = self.slots[index]
        if slot.done is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(slot.done)
            for part in slot.parts:
                for t in part:
                    t.record_stream(compute)  # allocated on the side stream, read on this one
        following = index + direction
        if 0 <= following < len(self.host) and self.ring > 1:
            planned = self.planner(following) if self.planner else None
            planned = self.base[following] if planned is None else planned
            if planned < self.base[following] + self.experts(following):
                self._copy(following, planned)
        return tuple(tuple(t[first - slot.first:] for t in part) for part in slot.parts)

    def take_copy(self, index: int):
        """(first expert, (start, end) events) of the copy layer ``index``'s device experts came from, once: None
        when it was handed out before or there was no copy (the model on the CPU)."""
        slot = self.slots.get(index)
        if slot is None or slot.started is None or slot.timed:
            return None
        slot.timed = True
        return slot.first, (slot.started, slot.done)


@dataclass(frozen=True)
class _Refetch:
    """A saved tensor that was (a view of) one of a layer's device weights: rebuilt in backward."""

    part: int  # 0: gate_up, 1: down
    size: tuple
    stride: tuple
    offset: int  # from the weight's own first element (a refetch may land in a larger copy, at another offset)


def streamed_forward(module, stream: ExpertStream, index: int, hidden_states, top_k_index, top_k_weights,
                     lora=None, first: int = 0, on_fetched=None):
    """One streamed layer's experts: fetch, then ``device_experts`` (transformers' grouped kernel, expert LoRA
    beside it); backward fetches again. ``first``: the GPU computes experts ``first..`` of the layer (a hybrid
    layer's GPU share), and ``top_k_index`` counts from there (an id past them: no expert); ``lora`` is the whole
    layer's. ``on_fetched`` is called once the weights are ready (where auto placement starts timing the GPU's
    work)."""
    part = slice(first, None)
    factors = (None, None) if lora is None else (
        None if lora.gate_up_a is None else (lora.gate_up_b[part], lora.gate_up_a[part], lora.gate_up_scale),
        None if lora.down_a is None else (lora.down_b[part], lora.down_a[part], lora.down_scale))
    dtype = hidden_states.dtype

    def weights(direction: int, timed: bool) -> tuple:
        base = stream.fetch(index, direction, first)
        if timed and on_fetched is not None:
            on_fetched()
        return tuple(weight_of(p, dtype) for p in base)

    def experts(fetched, hidden, ids, routing):
        return device_experts(module, fetched, factors, hidden, ids, routing)

    if stream.recompute and torch.is_grad_enabled():
        return _recomputed(experts, weights, hidden_states, top_k_index, top_k_weights)
    forward = weights(+1, timed=True)
    if stream.ring >= len(stream.host):  # every layer stays on the device: nothing to stream again
        return experts(forward, hidden_states, top_k_index, top_k_weights)

    def refetch(part):
        return weight_of(stream.fetch(index, -1, first)[part], dtype)

    with rebuilt_in_backward(forward, refetch):
        return experts(forward, hidden_states, top_k_index, top_k_weights)


def _recomputed(experts, weights, hidden_states, top_k_index, top_k_weights):
    """kt_stream_activation: recompute. The layer's fetch and experts (``experts(weights, hidden, ids, routing)``,
    with ``weights(direction, timed)``) under ``torch.utils.checkpoint``: autograd keeps only the call's inputs,
    and backward fetches the layer again (the one before it prefetched, as backward goes) and runs its forward once
    more to differentiate it."""
    from torch.utils.checkpoint import checkpoint

    calls = []

    def run(hidden, ids, routing):
        again = bool(calls)
        calls.append(again)
        return experts(weights(-1 if again else +1, timed=not again), hidden, ids, routing)

    return checkpoint(run, hidden_states, top_k_index, top_k_weights, use_reentrant=False)


def rebuilt_in_backward(weights: tuple, rebuild: Callable[[int], torch.Tensor]):
    """Saved-tensor hooks under which autograd keeps a note in place of every tensor that is (a view of) one of
    ``weights`` (gate_up, down), and backward gets it from ``rebuild(part)`` again, so a layer's device weights
    are not held from its forward to its backward. ``rebuild`` runs without grad."""
    # the hooks live as long as what they saved: they hold the weights' addresses, not the weights themselves
    device = weights[0].device
    storages = [w.untyped_storage().data_ptr() for w in weights]
    offsets = [w.storage_offset() for w in weights]
    del weights

    def pack(t):
        if t.device == device and t.untyped_storage().data_ptr() in storages:
            which = storages.index(t.untyped_storage().data_ptr())
            return _Refetch(which, tuple(t.size()), t.stride(), t.storage_offset() - offsets[which])
        return t

    def unpack(saved):
        if not isinstance(saved, _Refetch):
            return saved
        with torch.no_grad():
            full = rebuild(saved.part)
        return full.as_strided(saved.size, saved.stride, full.storage_offset() + saved.offset)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
