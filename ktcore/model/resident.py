"""``kt_num_gpu_experts``: a ``cpu`` MoE layer keeps its N most used experts resident on the model's device.

Per MoE layer (KTransformers' ``--kt-num-gpu-experts`` counts experts kept on the GPU; here the count is per layer,
so a model keeps N x its MoE layers experts resident). The CPU backend still packs all E experts; N of them are
also in a buffer on the model's device, in HF's layout (gate_up [N, 2I, H], down [N, H, I]), computed there by
transformers' grouped experts kernel with expert LoRA beside it (``model/device_experts.py``, as streamed layers
compute); the LoRA factors of those N experts are gathered from PEFT's parameters with ``index_select``,
so their gradients reach PEFT's own tensors. Each token-slot goes to one side: a resident expert's slots carry the
backend's "no expert" id (E) for the CPU, every other slot the kernel's (N) on the device, and the outputs add up.
On a GPU the CPU share is submitted first and collected after the device's share is enqueued (``HybridPoint``),
so both run at once, forward and backward.

Which experts. Each call adds its token-slots per expert to a float counter on the model's device
(``index_add_``: no host synchronisation; ``bincount`` would read the largest id back). Every
``kt_gpu_experts_interval`` forward calls the layer copies the counts to pinned host memory without waiting, halves
them (so the last interval weighs as much as all before it), and at its next call, once that copy has landed
(it has: a whole step ran since), takes the N experts with the most slots, where an expert displaces a resident
one only with significantly more slots (``top_experts``), and, when they differ, builds a new device buffer:
experts that stay are copied from the old one on the device, only those that join cross from the host. A new
buffer, not the old one overwritten: the old set stays intact for a backward that still needs it. The interval
counts forward calls (micro-batches), not optimizer steps: a layer sees its calls, and neither the frontend's step
nor gradient accumulation change what is resident-worthy. At the default of 8 a refresh copies at most N experts
per layer every 8 calls, after the first choice usually a few (Qwen3-30B-A3B, N = 16: 150 MB at most, unpacked in
tens of ms and copied in ~3 ms at 55 GB/s, against a step of seconds), and 8 calls' routing of thousands of tokens
is a steady count. A checkpointed layer recomputed in backward takes the set its forward used (kept on the
recomputation's tape, ``experts.replay``); recomputed calls are not counted again.

Where the resident weights come from: the backend's own packed experts, through its ``unpack`` (the chosen
experts in HF's layout as the backend computes with them: amx_bf16's bf16 tiles, amx_int8's codes and scales,
llamafile's blocks dequantised, the torch backend's tensors), so host memory holds every expert once and an
expert's weights do not change when it moves between the CPU and the GPU. int8 codes cross as codes (half the
bytes) and are dequantised on the device. A refresh unpacks the joining experts into pinned memory (one strided
copy each: as fast as gathering them from a copy of their own was); a backend without ``unpack`` cannot
keep experts resident (``check_unpack``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..errors import ConfigError
from ..experts import can_unpack, replay
from .hybrid import HybridPoint
from .peft_expert_lora import expert_lora_of
from .device_experts import device_experts
from .stream import host_layout, weight_of

DECAY = 0.5  # counts are multiplied by this at each choice: the last interval weighs as much as all before it
# an expert displaces a resident one only with this many standard deviations more slots (``top_experts``); decayed
# counts vary less than Poisson counts of the same mean, so this errs on the side of keeping the set
SWAP_SIGMAS = 2.0


def check_count(n: int, experts: int, name: str) -> None:
    """One line, before any weight is read, when a layer cannot keep ``n`` of its ``experts`` resident."""
    if n >= experts:
        raise ConfigError(f"{name}: kt_num_gpu_experts {n} needs fewer than the layer's {experts} experts; set it "
                          f"to 1..{experts - 1} (all {experts} on the GPU: kt_placement device: gpu)")


def check_unpack(backend_class, backend: str, name: str) -> None:
    """One line, before any weight is read, when the class of ``backend`` cannot hand its packed experts to the
    device (None: no backend of that name runs here, which building it reports)."""
    if backend_class is not None and not can_unpack(backend_class):
        raise ConfigError(f"{name}: kt_num_gpu_experts needs a backend that unpacks its experts for the GPU "
                          f"(ExpertBackend.unpack), and {backend} does not; set kt_num_gpu_experts: 0, or "
                          "kt_backend: torch, amx_bf16, amx_int8 or llamafile")


def top_experts(counts: Sequence[float], n: int, current: Sequence[int] = ()) -> tuple[int, ...]:
    """The ``n`` experts to keep resident, ascending. Without a current set, the ``n`` with the most token-slots
    (ties: the lower id). With one, an expert displaces the resident one with the fewest slots only while its
    count is higher by more than ``SWAP_SIGMAS`` standard deviations of the difference of two counts (as Poisson
    counts: the square root of their sum): a tie or noise moves nothing, so the handful of slots of a chat's decode
    steps does not re-copy experts for nothing, while a real shift of the routing still wins."""
    if len(current) != n:
        return tuple(sorted(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:n]))
    held = set(current)
    for candidate in sorted(set(range(len(counts))) - held, key=lambda e: (-counts[e], e)):
        weakest = min(held, key=lambda e: (counts[e], -e))
        if counts[candidate] - counts[weakest] <= SWAP_SIGMAS * math.sqrt(counts[candidate] + counts[weakest]):
            break
        held.remove(weakest)
        held.add(candidate)
    return tuple(sorted(held))


@dataclass(frozen=True)
class ResidentSet:
    """One choice of resident experts and their weights on the model's device."""

    ids: tuple  # the resident experts, ascending
    ids_device: torch.Tensor  # the same, [N] long on the device
    slot_of: torch.Tensor  # [E] long on the device: an expert's row in the buffers, N for the CPU's experts
    weights: tuple  # gate_up [N, 2I, H], down [N, H, I] on the device, in the model's dtype


class ResidentExperts:
    """One layer's resident experts, its counts and its pending choice."""

    def __deepcopy__(self, memo):
        return self  # a deep-copied model shares its ExpertLayers, and so their resident experts

    def __init__(self, name: str, layer, experts: int, n: int, interval: int, device, dtype):
        self.name, self.n, self.interval = name, n, interval
        self.layer = layer  # the ExpertLayer whose backend packs all the experts: a refresh unpacks from it
        self.experts = experts
        self.device, self.dtype = torch.device(device), dtype
        self.counts = torch.zeros(self.experts, dtype=torch.float32, device=self.device)
        self.calls = 0  # counted calls since the last snapshot of the counts
        self.pending: Optional[tuple] = None  # (counts in host memory, the event their copy recorded)
        self.refreshes = 0  # choices that changed the set (the bench and the tests read it)
        self.copied_bytes = 0  # host-to-device bytes of resident experts so far (the bench reads it)
        self.refresh_s = 0.0  # host seconds the refreshes took: unpacking, pinning, queuing the copies (the bench)
        self.current = self._build(tuple(range(n)))  # until the first choice: the first N

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.current.weights)

    def _build(self, ids: tuple, previous: Optional[ResidentSet] = None) -> ResidentSet:
        """The experts ``ids`` in a new device buffer: those ``previous`` holds are copied from its rows on the
        device, only the others are unpacked from the backend and cross from the host."""
        index = torch.tensor(ids, dtype=torch.long)
        slot_of = torch.full((self.experts,), self.n, dtype=torch.long)
        slot_of[index] = torch.arange(self.n)
        held = {} if previous is None else {e: row for row, e in enumerate(previous.ids)}
        joining = [e for e in ids if e not in held]
        cuda = self.device.type == "cuda"
        weights = []
        unpacked = self.layer.backend.unpack(self.layer.packed, torch.tensor(joining, dtype=torch.long))
        for p, part in enumerate(host_layout(unpacked, self.dtype)):
            if cuda:  # pinned, so the copy to the device runs without holding up the host
                part = tuple(t.pin_memory() for t in part)
                self.copied_bytes += sum(t.numel() * t.element_size() for t in part)
            arrived = weight_of(tuple(t.to(self.device, non_blocking=cuda) for t in part), self.dtype)
            if not held:
                weights.append(arrived)
                continue
            # row by row with plain indices: an index tensor would have to cross to the device first
            out = torch.empty((len(ids), *arrived.shape[1:]), dtype=self.dtype, device=self.device)
            arriving = iter(arrived)
            for row, e in enumerate(ids):
                out[row].copy_(previous.weights[p][held[e]] if e in held else next(arriving))
            weights.append(out)
        # the ids pinned too: a copy from pageable memory would wait for everything queued on the device
        small = [t.pin_memory() if cuda else t for t in (index, slot_of)]
        index_device, slot_of = (t.to(self.device, non_blocking=True) for t in small)
        return ResidentSet(ids, index_device, slot_of, tuple(weights))

    def choose(self) -> ResidentSet:
        """The set this call computes with: a new one when a snapshot of the counts has landed."""
        if self.pending is not None:
            counts, event = self.pending
            if event is None or event.query():
                self.pending = None
                ids = top_experts(counts.tolist(), self.n, self.current.ids)
                if ids != self.current.ids:
                    start = time.perf_counter()
                    self.current = self._build(ids, self.current)
                    self.refresh_s += time.perf_counter() - start
                    self.refreshes += 1
        return self.current

    def count(self, top_k_index: torch.Tensor) -> None:
        """Add a call's token-slots per expert; every ``interval`` calls, start copying the counts to the host."""
        ids = top_k_index.reshape(-1)
        self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))
        self.calls += 1
        if self.calls < self.interval:
            return
        cuda = self.device.type == "cuda"
        snapshot = torch.empty(self.experts, dtype=self.counts.dtype, pin_memory=cuda)
        snapshot.copy_(self.counts, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self.counts.mul_(DECAY)
        self.calls = 0
        self.pending = (snapshot, event)


def attach(module, layer, n: int, interval: int, name: str, dtype, device) -> None:
    """Make a cpu layer (``layer`` packs all its experts) keep ``n`` of them resident on ``device``."""
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"{name}: kt_num_gpu_experts with transposed or interleaved experts is not supported yet; "
                         "set kt_num_gpu_experts: 0 for this layer")
    layer.overlap = HybridPoint()  # the CPU share returns at once on a GPU, collected after the device's share
    module.__dict__["_ktcore_resident"] = ResidentExperts(name, layer, module.num_experts, n, interval, device, dtype)


def resident_forward(module, layer, resident: ResidentExperts, hidden_states, top_k_index, top_k_weights):
    """One call: the CPU backend's share submitted first, the resident experts' share enqueued beside it."""
    chosen = replay.kept() if replay.recomputing() else None
    if chosen is None:
        chosen = resident.choose()
        resident.count(top_k_index)
        replay.keep(chosen)
    lora = expert_lora_of(module)
    slot = chosen.slot_of[top_k_index]  # each slot's row among the resident experts, N for the CPU's
    y_cpu = layer(hidden_states, torch.where(slot < resident.n, module.num_experts, top_k_index), top_k_weights, lora)
    y_gpu = resident_share(module, chosen, hidden_states, slot, top_k_weights, lora)
    return layer.overlap.collect(y_cpu) + y_gpu


def resident_share(module, chosen: ResidentSet, hidden_states, slot, top_k_weights, lora):
    """The resident experts' share: ``device_experts`` on their device weights, with their LoRA factors gathered
    (differentiably) from the layer's, so the gradients reach PEFT's own tensors."""
    ids = chosen.ids_device

    def gathered(a, b, scale):
        return None if a is None else (b.index_select(0, ids), a.index_select(0, ids), scale)

    factors = (None, None) if lora is None else (gathered(lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale),
                                                 gathered(lora.down_a, lora.down_b, lora.down_scale))
    return device_experts(module, chosen.weights, factors, hidden_states, slot, top_k_weights)
