"""The placement cost model: time, GPU memory and host memory of one training step for each expert placement.

Pure arithmetic on a ``ModelShape`` (``model/shape.py``) and a few measured ``Rates``; ``ktcore plan`` prints
it and ``auto`` placement chooses with it. One step is one sequence of T tokens, LoRA on the attention,
dense linears and routed experts, frozen base weights (so backward computes input gradients only: as many
FLOPs as the forward).

Placements of the routed experts:

* ``cpu``: the CPU backend computes them; each MoE layer's experts wait for its attention (one sequence), so
  the step is the GPU's own work plus every layer's CPU expert time.
* ``gpu_stream``: they live in pinned host memory; each layer's experts are copied to the GPU while the layer
  before computes, and again in backward unless the ring (``ring`` layers) holds every MoE layer. A layer takes
  the longer of its copy and its GPU work.
* ``hybrid``: each layer's experts are split so the CPU's share (after the layer's attention) and the GPU's
  streamed share finish together.
* ``gpu``: all experts resident on the GPU (transformers' own kernels): the yardstick, when it fits.
* ``cpu_resident`` (only with ``kt_num_gpu_experts`` N): ``cpu`` with N experts of each layer resident on the GPU
  (``model/resident.py``), which computes their token-slots beside the CPU's share.

The constants below were fitted to ``ktcore bench train`` runs on the H200 machine (benchmarks/RESULTS.md,
DeepSeek-V2-Lite shape, amx_bf16), the GPU memory refitted to the 2026-12-05 lease (6 layers at 2K, 8K and 32K
tokens/step, 27 layers at 2K with and without checkpointing, the whole model on the GPU): peak GPU memory within
8% (27 layers at 8K, an older run: 17%), peak host memory within 6% for ``cpu``, tokens/s within 30%
(``tests/test_plan.py`` holds them to it); 27 streamed layers at 8K (2026-12-06): GPU memory within 3%, host memory
within 4%, bf16 tokens/s within 8%, int8 (bound by the GPU's work with checkpointing) 1.22x optimistic (1.38x
before a checkpointed layer's second forward counted its attention and fixed per-layer time too). Where it is
known to be off: ``cpu`` at 32K tokens runs 1.5x faster than the one CPU rate predicts; and ``hybrid`` at 2K and 8K ran 1.5-1.7x slower than predicted, its two sides not overlapping there
(which is why ``auto`` measures).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..errors import ConfigError

if TYPE_CHECKING:  # shape builds models through wrap, which builds auto placement on this module
    from .shape import ModelShape

GIB = 2**30
PLACEMENTS = ("cpu", "gpu_stream", "hybrid", "auto", "gpu")

# bytes per weight of each packed format (GGUF blocks: block bytes / block weights)
FORMAT_BYTES = {"fp32": 4.0, "f32": 4.0, "bf16": 2.0, "f16": 2.0, "int8": 1.0, "gguf": 34 / 32, "q8_0": 34 / 32,
                "q4_0": 18 / 32, "q4_1": 20 / 32, "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256}
GPU_WEIGHT_BYTES = 2.0  # bf16: what the GPU's grouped kernel computes with, and what is streamed to it

# fitted constants (see the module docstring)
ACTIVATION_BYTES_PER_HIDDEN = 53  # GPU: saved activations per token and decoder layer, in units of hidden size
CHECKPOINTED_BYTES_PER_HIDDEN = 4  # the same with whole decoder layers checkpointed (each layer's input)
LOGIT_BYTES = 10  # GPU, transformers' own loss: per token and vocabulary entry (fp32 logits, gradient, bf16 copy)
CHUNKED_LOSS_GIB = 0.25  # GPU, ktcore's chunked loss (``model/lm_loss.py``): a few chunks of logits at a time
ROUTED_SLOT_BYTES = 2  # GPU experts: per token-slot, bf16 (2 H + 4 I) kept for backward by the grouped kernel
GPU_FIXED_GIB = 0.5  # GPU: cuBLAS workspaces and allocator slack beside weights and activations
FORWARD_FIXED_SHARE = 1 / 3  # of gpu_layer_ms: the forward's small kernels (backward launches about twice as many)
HOST_FIXED_GIB = 2.5  # host: python, torch, transformers and the CUDA runtime
LORA_STATE_BYTES = 16  # fp32 weight, gradient and two AdamW moments per LoRA parameter


@dataclass(frozen=True)
class Rates:
    """Measured rates of one machine (``ktcore doctor --json`` writes them; a rates file fixes them)."""

    cpu_expert_gflops: float  # routed-expert forward+backward FLOP/s of the CPU backend inside a step
    dram_gbps: float  # host read bandwidth (the CPU backend's floor at few tokens)
    cpu_cores: int  # cores the CPU rate was measured with
    h2d_gbps: Optional[float] = None  # pinned host-to-device copies (None: no GPU)
    gpu_tflops: Optional[float] = None  # bf16 FLOP/s the GPU reaches on a training step's matmuls
    gpu_layer_ms: float = 0.0  # fixed GPU time per decoder layer and step (kernel launches, small ops)
    gpu_mem_gib: Optional[float] = None
    host_ram_gib: Optional[float] = None

    @property
    def has_gpu(self) -> bool:
        return bool(self.h2d_gbps and self.gpu_tflops)

    def with_cores(self, cores: int) -> "Rates":
        """The CPU rate scaled to ``cores`` (expert GEMMs scale with cores; DRAM bandwidth does not)."""
        return replace(self, cpu_expert_gflops=self.cpu_expert_gflops * cores / self.cpu_cores, cpu_cores=cores)


RATE_FIELDS = tuple(f.name for f in fields(Rates))


@dataclass(frozen=True)
class StepCost:
    placement: str
    step_s: float
    tokens_per_s: float
    gpu_gib: float
    host_gib: float
    fits: bool
    why_not: str  # "" when it fits
    cpu_share: float  # share of the routed token-slots the CPU computes
    expert_s: float  # per step: routed experts (CPU, copies and GPU together, as they overlap)
    copy_gb: float  # host-to-device bytes per step
    choice: str = ""  # auto: what it takes (cpu, gpu_stream, hybrid n/E), and its window when host RAM is short

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Setting:
    """What the config decides about the step."""

    tokens: int
    lora_rank: int = 8
    weight_format: str = "bf16"  # the CPU backend's packed format
    recompute: bool = False  # kt_cpu_activation: recompute
    cache_depth: int = 64  # kt_max_cache_depth
    ring: int = 2  # gpu_stream: layers of experts the GPU ring holds
    stream_recompute: bool = False  # kt_stream_activation: recompute (the GPU's experts forward again in backward)
    gradient_checkpointing: bool = False
    gpu_experts: int = 0  # kt_num_gpu_experts: experts per layer resident on the GPU beside the cpu placement
    gpu_experts_interval: int = 8  # kt_gpu_experts_interval: forward calls between two choices of them


def streamed_weight_bytes(s: Setting) -> float:
    """Bytes per weight the stream keeps pinned and copies: int8 experts go as their codes (dequantised on the
    GPU; the per-channel scales are a few bytes per thousand weights), every other format as bf16."""
    return FORMAT_BYTES["int8"] if s.weight_format == "int8" else GPU_WEIGHT_BYTES


def touched_experts(shape: ModelShape, tokens: int) -> float:
    """Expected experts one layer's T tokens touch, with every expert equally likely."""
    return shape.experts * (1.0 - (1.0 - shape.top_k / shape.experts) ** tokens)


def gpu_dense_s(shape: ModelShape, s: Setting, rates: Rates) -> float:
    """The GPU's own work per step: every matmul but the routed experts' (forward + input-gradient backward),
    causal attention, and the fixed per-layer time; with checkpointing each layer's forward runs again, all three
    parts of it."""
    again = 1 if s.gradient_checkpointing else 0  # forwards run again
    matmul = 2 * (2 + again) * (shape.non_expert_params - shape.embedding_params) * s.tokens
    # causal attention: T^2/2 pairs x heads x (qk + v dims) x 2 FLOPs forward, about 2.5x that backward
    attention = (3.5 + again) * s.tokens ** 2 * shape.attention_heads * shape.attention_head_dim * shape.layers
    fixed = shape.layers * rates.gpu_layer_ms / 1e3 * (1 + again * FORWARD_FIXED_SHARE)
    return (matmul + attention) / (rates.gpu_tflops * 1e12) + fixed


def expert_flops(shape: ModelShape, tokens: int, recompute: bool = False) -> float:
    """Forward + backward FLOPs of one layer's routed experts (three matmuls of H x I per token-slot each way)."""
    return tokens * shape.top_k * 6 * shape.expert_params / 3 * (3 if recompute else 2)


def cpu_layer_s(shape: ModelShape, s: Setting, rates: Rates) -> float:
    """One layer's routed experts on the CPU: compute, or reading the touched weights (forward, backward, and
    the recomputed forward) when that takes longer."""
    compute = expert_flops(shape, s.tokens, s.recompute) / (rates.cpu_expert_gflops * 1e9)
    reads = (3 if s.recompute else 2) * touched_experts(shape, s.tokens) * shape.expert_params \
        * FORMAT_BYTES[s.weight_format]
    return max(compute, reads / (rates.dram_gbps * 1e9))


def stream_layer(shape: ModelShape, s: Setting, rates: Rates) -> tuple[float, float, float]:
    """(copy seconds, GPU compute seconds, bytes) of one layer's routed experts streamed: the whole layer is
    copied in forward and again in backward (unless the ring holds every MoE layer)."""
    copies = 1 if s.ring >= shape.moe_layers else 2
    nbytes = shape.experts * shape.expert_params * streamed_weight_bytes(s) * copies
    flops = expert_flops(shape, s.tokens, recompute=s.stream_recompute)
    return nbytes / (rates.h2d_gbps * 1e9), flops / (rates.gpu_tflops * 1e12), nbytes


@dataclass(frozen=True)
class LayerTimes:
    """One MoE layer's seconds per step (forward + backward), each for the whole layer's experts: on the CPU, their
    copies to the GPU, their GPU compute, and the layer's own GPU work (attention, shared experts)."""

    cpu_s: float
    copy_s: float
    compute_s: float
    dense_s: float

    def at(self, share: float) -> float:
        """The layer with ``share`` of its experts on the CPU: the GPU's share is copied beside the layer's GPU
        work (the copy runs while the layer before computes), the CPU's share runs after the layer's attention
        beside the GPU's share of the experts. share 1 is the cpu placement, 0 gpu_stream."""
        return max((1 - share) * self.copy_s, self.dense_s + max(share * self.cpu_s, (1 - share) * self.compute_s))

    def scaled(self, cpu: float = 1.0, copy: float = 1.0, compute: float = 1.0) -> "LayerTimes":
        return replace(self, cpu_s=self.cpu_s * cpu, copy_s=self.copy_s * copy, compute_s=self.compute_s * compute)

    def best_split(self, experts: int, lo: int = 0, hi: Optional[int] = None) -> tuple[int, float]:
        """(n, seconds): the number of experts in ``lo..hi`` the CPU computes that makes the layer fastest. The
        time is a maximum of lines in the share, so its minimum over an interval lies at an end or where two
        lines cross: only the experts next to those points are tried."""
        hi = experts if hi is None else hi
        crossings = [lo / experts, hi / experts]
        if self.cpu_s + self.compute_s > 0:
            crossings.append(self.compute_s / (self.cpu_s + self.compute_s))  # CPU share = GPU compute
        if self.copy_s + self.cpu_s > 0:
            crossings.append((self.copy_s - self.dense_s) / (self.copy_s + self.cpu_s))  # CPU share = copy
        if self.copy_s > self.compute_s:
            crossings.append(1 - self.dense_s / (self.copy_s - self.compute_s))  # copy = GPU work
        tried = {min(hi, max(lo, f(c * experts))) for c in crossings for f in (math.floor, math.ceil)}
        return min(((self.at(n / experts), n) for n in sorted(tried)))[::-1]


def layer_times(shape: ModelShape, s: Setting, rates: Rates) -> LayerTimes:
    """The cost model's times of one MoE layer (``rates`` with a GPU)."""
    copy_s, compute_s, _ = stream_layer(shape, s, rates)
    return LayerTimes(cpu_layer_s(shape, s, rates), copy_s, compute_s, gpu_dense_s(shape, s, rates) / shape.layers)


def hybrid_share(cpu_s: float, copy_s: float, compute_s: float, dense_layer_s: float) -> tuple[float, float]:
    """(CPU share, seconds) of one hybrid layer (``LayerTimes.at``) at the best share, searched: the layer's time
    is piecewise linear in it."""
    times = LayerTimes(cpu_s, copy_s, compute_s, dense_layer_s)
    best = min((i / 1000 for i in range(1001)), key=times.at)
    return best, times.at(best)


def _gpu_memory(shape: ModelShape, s: Setting, resident_experts: float, routed_slot_share: float,
                held_once: float = 0.0, chunked_loss: bool = True, streamed: bool = False) -> float:
    """Peak GPU bytes: weights, LoRA state, activations, and the routed experts' own when the GPU computes them
    (``resident_experts`` count twice: PEFT's ``W + scaling * B @ A`` is a second copy, kept for backward;
    ``held_once`` experts once: streamed rings and kt_num_gpu_experts' buffers, whose expert LoRA is computed beside
    the GEMMs). ``chunked_loss``: ktcore's LM loss (a run of ktcore), else transformers' full logits; ``streamed``:
    the GPU's token-slots are streamed experts' (``kt_stream_activation`` applies)."""
    weights = (shape.non_expert_params + (2 * resident_experts + held_once) * shape.expert_params) * GPU_WEIGHT_BYTES
    lora = shape.lora_params_per_rank * s.lora_rank * LORA_STATE_BYTES
    per_layer = shape.hidden * (CHECKPOINTED_BYTES_PER_HIDDEN if s.gradient_checkpointing
                                else ACTIVATION_BYTES_PER_HIDDEN)
    logits = CHUNKED_LOSS_GIB * GIB if chunked_loss else s.tokens * shape.vocab * LOGIT_BYTES
    acts = s.tokens * shape.layers * per_layer + logits
    # grouped experts keep per token-slot their permuted input, gate/up output, activation and output for backward
    # (every layer's until its backward; streamed ones recomputing, only the layer's being differentiated)
    layers = 1 if streamed and s.stream_recompute else shape.moe_layers
    routed = routed_slot_share * s.tokens * shape.top_k * layers \
        * (2 * shape.hidden + 4 * shape.expert_intermediate) * ROUTED_SLOT_BYTES
    return weights + lora + acts + routed + GPU_FIXED_GIB * GIB


def _host_memory(shape: ModelShape, s: Setting, cpu_share: float, packed_share: Optional[float] = None,
                 pinned_share: Optional[float] = None) -> float:
    """Peak host bytes: the CPU's experts in the backend's format (``packed_share`` of them, default the CPU's
    share), the streamed ones pinned (default the rest; auto keeps both copies of some; bf16, or int8 codes with
    int8 experts), and what the CPU backend keeps for backward (per token-slot the input in bf16, gate and up in
    fp32 and their SiLU product in bf16; the input alone when recomputing) plus its scratch for one layer (6H + 18I
    per token-slot)."""
    packed_share = cpu_share if packed_share is None else packed_share
    pinned_share = 1 - cpu_share if pinned_share is None else pinned_share
    expert_bytes = shape.routed_params * (packed_share * FORMAT_BYTES[s.weight_format]
                                          + pinned_share * streamed_weight_bytes(s))
    slots = cpu_share * s.tokens * shape.top_k
    saved = (2 * shape.hidden if s.recompute else 2 * shape.hidden + 10 * shape.expert_intermediate)
    kept = slots * saved * min(shape.moe_layers, s.cache_depth)
    scratch = slots * (6 * shape.hidden + 18 * shape.expert_intermediate) if cpu_share else 0
    return expert_bytes + kept + scratch + HOST_FIXED_GIB * GIB


def _cost(placement, shape, s, rates, step_s, expert_s, cpu_share, resident, gpu_slot_share, copy_bytes,
          packed_share=None, pinned_share=None, choice="", held_once=0.0, streamed=False):
    gpu = _gpu_memory(shape, s, resident, gpu_slot_share, held_once, chunked_loss=placement != "gpu",
                      streamed=streamed) / GIB
    host = _host_memory(shape, s, cpu_share, packed_share, pinned_share) / GIB
    why = []
    if rates.gpu_mem_gib is not None and gpu > rates.gpu_mem_gib:
        why.append(f"GPU memory {gpu:.1f} > {rates.gpu_mem_gib:g} GiB")
    if rates.host_ram_gib is not None and host > rates.host_ram_gib:
        why.append(f"host RAM {host:.1f} > {rates.host_ram_gib:g} GiB")
    return StepCost(placement, step_s, s.tokens / step_s, gpu, host, not why, "; ".join(why), cpu_share, expert_s,
                    copy_bytes / 1e9, choice or placement)


def _split(shape, s, rates, placement, share: float, times: LayerTimes, **kwargs) -> StepCost:
    """Every MoE layer with ``share`` of its experts on the CPU (cpu: all, gpu_stream: none)."""
    layers = shape.moe_layers
    _, _, stream_bytes = stream_layer(shape, s, rates)
    return _cost(placement, shape, s, rates, (shape.layers - layers) * times.dense_s + layers * times.at(share),
                 layers * (times.at(share) - times.dense_s), share, 0, 1 - share,
                 layers * (1 - share) * stream_bytes, held_once=(1 - share) * streamed_copies(shape, s),
                 streamed=True, **kwargs)


def streamed_copies(shape: ModelShape, s: Setting) -> float:
    """Experts (in bf16) a streaming step holds on the GPU at once: the ring's layers, and with int8 experts
    their codes (half) plus the layer computing dequantised (rebuilt in backward, not kept from the forward:
    ``stream.rebuilt_in_backward``). Expert LoRA adds no copy: it is computed beside the GEMMs
    (``model/device_experts.py``)."""
    ring = min(s.ring, shape.moe_layers) * streamed_weight_bytes(s) / GPU_WEIGHT_BYTES
    return (ring + (s.weight_format == "int8")) * shape.experts


def fewest_cpu_experts(shape: ModelShape, s: Setting, rates: Rates, lo: int, hi: int) -> int:
    """The fewest CPU experts in ``lo..hi`` at which the step fits the GPU's memory (it falls as the CPU takes
    more: fewer experts streamed and fewer token-slots computed there); ``hi`` when none fits."""
    if rates.gpu_mem_gib is None:
        return lo
    copies = streamed_copies(shape, s)
    for n in range(lo, hi + 1):
        share = n / shape.experts
        if _gpu_memory(shape, s, 0, 1 - share, (1 - share) * copies, streamed=True) / GIB <= rates.gpu_mem_gib:
            return n
    return hi


def resident_cost(shape: ModelShape, s: Setting, rates: Rates) -> StepCost:
    """``cpu`` with ``s.gpu_experts`` (N) experts of each layer resident on the GPU: the GPU computes their
    token-slots while the CPU computes the rest. At the uniform routing the model assumes they get N/E of the
    slots (the most used experts get more: a lower bound of their share). GPU memory: their weights once per layer
    (dequantised at a refresh; expert LoRA beside the GEMMs adds no copy); host: every expert packed once (a choice
    unpacks the resident ones from the backend's); copies: N experts per layer at each choice (every
    ``gpu_experts_interval`` steps at most)."""
    n, layers = s.gpu_experts, shape.moe_layers
    share = n / shape.experts
    dense = gpu_dense_s(shape, s, rates)
    cpu = (1 - share) * cpu_layer_s(shape, s, rates)
    gpu = share * expert_flops(shape, s.tokens) / (rates.gpu_tflops * 1e12)
    experts = layers * max(cpu, gpu)
    refresh_bytes = layers * n * shape.expert_params * streamed_weight_bytes(s) / s.gpu_experts_interval
    return _cost("cpu_resident", shape, s, rates, dense + experts, experts, 1 - share, 0, share, refresh_bytes,
                 packed_share=1.0, pinned_share=0.0,
                 choice=f"cpu, {n}/{shape.experts} experts resident", held_once=layers * n)


def choice_name(n: int, experts: int) -> str:
    """What ``n`` CPU experts of a layer of ``experts`` is: cpu, gpu_stream or hybrid with its split."""
    return "cpu" if n >= experts else "gpu_stream" if n <= 0 else f"hybrid {n}/{experts}"


def predict(shape: ModelShape, s: Setting, rates: Rates, placement: str) -> StepCost:
    """The cost of one step with every MoE layer in ``placement`` (one of PLACEMENTS)."""
    if placement != "cpu" and not rates.has_gpu:
        raise ValueError(f"placement {placement} needs a GPU: the rates have no h2d_gbps / gpu_tflops")
    dense = gpu_dense_s(shape, s, rates) if rates.has_gpu else 0.0
    layers = shape.moe_layers
    if placement == "cpu":
        experts = layers * cpu_layer_s(shape, s, rates)
        return _cost("cpu", shape, s, rates, dense + experts, experts, 1.0, 0, 0.0, 0.0)
    if placement == "gpu":
        experts = layers * expert_flops(shape, s.tokens) / (rates.gpu_tflops * 1e12)
        return _cost("gpu", shape, s, rates, dense + experts, experts, 0.0, layers * shape.experts, 1.0, 0.0,
                     pinned_share=0.0)  # the experts live on the GPU only
    times = layer_times(shape, s, rates)
    if placement == "gpu_stream":
        return _split(shape, s, rates, "gpu_stream", 0.0, times)
    if placement == "hybrid":
        share, _ = hybrid_share(times.cpu_s, times.copy_s, times.compute_s, times.dense_s)
        return _split(shape, s, rates, "hybrid", share, times)
    if placement == "auto":
        return auto_split(shape, s, rates)[0]
    raise ValueError(f"unknown placement {placement!r}; one of {', '.join(PLACEMENTS)}")


def auto_window(shape: ModelShape, s: Setting, rates: Rates, center: int, lo: int = 0, hi: Optional[int] = None
                ) -> tuple[int, int]:
    """The CPU-expert counts ``lo..hi`` an auto layer can switch between: the CPU backend packs experts ``..hi``,
    the stream keeps experts ``lo..`` in pinned memory, so experts ``lo..hi`` are held twice. Both copies of every
    expert (0..E: cpu, gpu_stream and every hybrid split) when host RAM holds them; else the widest window that
    fits around ``center`` (``lo == hi``: one copy, a fixed split)."""
    experts = shape.experts
    hi = experts if hi is None else hi

    def host(a, b):
        return _host_memory(shape, s, b / experts, b / experts, 1 - a / experts) / GIB

    if rates.host_ram_gib is None or host(lo, hi) <= rates.host_ram_gib:
        return lo, hi
    a = b = center
    while True:  # widen one expert at a time, on the side that costs less
        fitting = [w for w in ((a - 1, b), (a, b + 1)) if lo <= w[0] and w[1] <= hi and host(*w) <= rates.host_ram_gib]
        if not fitting:
            return a, b
        a, b = min(fitting, key=lambda w: host(*w))


def auto_split(shape: ModelShape, s: Setting, rates: Rates, lo: int = 0, hi: Optional[int] = None
               ) -> tuple[StepCost, int, int]:
    """``auto`` with ``lo..hi`` CPU experts allowed per layer: (its cost, and the window of CPU-expert counts host
    RAM holds both copies of, ``auto_window``). Every layer takes its fastest split whose GPU memory fits (the
    window is centred there); its host memory counts both copies of the window's experts."""
    experts = shape.experts
    hi = experts if hi is None else hi
    times = layer_times(shape, s, rates)
    gpu_limit = rates.gpu_mem_gib or math.inf

    def best(a, b):
        return min(((_split(shape, s, rates, "auto", n / experts, times), n) for n in range(a, b + 1)),
                   key=lambda c: (c[0].gpu_gib > gpu_limit, c[0].step_s))

    lo, hi = auto_window(shape, s, rates, best(lo, hi)[1], lo, hi)
    _, n = best(lo, hi)
    window = "" if (lo, hi) == (0, experts) else f" (host RAM holds both copies of {hi - lo} of {experts} " \
                                                   f"experts: CPU experts {lo}..{hi})"
    cost = _split(shape, s, rates, "auto", n / experts, times, packed_share=hi / experts,
                  pinned_share=1 - lo / experts, choice=choice_name(n, experts) + window)
    return cost, lo, hi


def plan(shape: ModelShape, s: Setting, rates: Rates) -> dict:
    """Every placement's cost, and what ``auto`` takes: per layer the fastest split of its experts between the CPU
    and the stream (cpu, gpu_stream or hybrid) that fits; None when even that does not fit."""
    if not rates.has_gpu:
        cpu = predict(shape, s, rates, "cpu")
        return {"costs": {"cpu": cpu}, "auto": "cpu" if cpu.fits else None}
    costs = {p: predict(shape, s, rates, p) for p in PLACEMENTS}
    if s.gpu_experts:
        costs["cpu_resident"] = resident_cost(shape, s, rates)
    auto = costs["auto"]
    return {"costs": costs, "auto": auto.choice.split(" ")[0] if auto.fits else None}


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


REQUIRED = ("cpu_expert_gflops", "dram_gbps", "cpu_cores")


def load_rates(path) -> Rates:
    """A rates file: a JSON object of ``Rates`` fields, or ``ktcore doctor --json`` output (its ``rates``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON rates file ({exc}); write one with "
                          "`ktcore doctor --json > rates.json`") from exc
    if isinstance(data, dict) and isinstance(data.get("rates"), dict):
        data = data["rates"]
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a rates file is a JSON object of {', '.join(RATE_FIELDS)}")
    unknown = sorted(set(data) - set(RATE_FIELDS) - {"note"})
    if unknown:
        raise ConfigError(f"{path}: unknown rate key(s) {', '.join(unknown)}; the keys are {', '.join(RATE_FIELDS)}")
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        raise ConfigError(f"{path}: missing {', '.join(missing)} (measure them with `ktcore doctor --json`)")
    for key in RATE_FIELDS:
        if data.get(key) is not None and not (is_finite(data[key]) or (key == "gpu_layer_ms" and data[key] == 0)):
            raise ConfigError(f"{path}: {key} must be a positive number, got {data[key]!r}")
    return Rates(**{k: v for k, v in data.items() if k != "note"})
