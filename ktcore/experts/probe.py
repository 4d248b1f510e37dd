"""Short measured probes of this machine: the rates the placement cost model takes (``ktcore doctor`` prints
them as ``rates``, ``ktcore plan`` and ``auto`` placement read them), and the timing helpers the benchmarks
share. Here, below the model, so ``auto`` placement measures at load what no ``kt_rates`` file gives it."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..plugins.hw import total_memory_bytes
from . import ExpertLoRA, ExpertWeights


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple


def best_rate(fn, seconds: float, work: float) -> float:
    """work units per second of the fastest call of ``fn`` within ``seconds`` (at least 3 calls)."""
    fn()  # warm up
    best, deadline, calls = float("inf"), time.perf_counter() + seconds, 0
    while calls < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        calls += 1
    return work / best


def median_time(fn, seconds: float, min_reps: int = 3, max_reps: int = 50) -> float:
    fn()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < seconds and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_problem(shape: Shape, tokens: int, dtype, seed: int = 0, lora_rank: int = 0):
    """Random weights, inputs and routing of one layer, and expert LoRA of rank lora_rank (fp32 factors, as PEFT
    keeps them; None for rank 0)."""
    g = torch.Generator().manual_seed(seed)
    e, k, h, i = shape.experts, shape.top_k, shape.hidden, shape.inter
    weights = ExpertWeights(*((torch.randn(*s, generator=g) * (s[2] ** -0.5)).to(dtype)
                              for s in ((e, i, h), (e, i, h), (e, h, i))))
    x = torch.randn(tokens, h, generator=g).to(dtype)
    ids = torch.rand(tokens, e, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.rand(tokens, k, generator=g), dim=1)
    return weights, x, ids, w, make_expert_lora(e, h, i, lora_rank, g) if lora_rank else None


def make_expert_lora(experts: int, hidden: int, inter: int, rank: int, generator: torch.Generator) -> ExpertLoRA:
    """Random expert LoRA of one layer on gate_up and down, fp32 factors as PEFT keeps them."""
    e, h, i, r, g = experts, hidden, inter, rank, generator
    return ExpertLoRA(torch.randn(e, r, h, generator=g) * h ** -0.5, torch.randn(e, 2 * i, r, generator=g) * 0.01,
                      torch.randn(e, r, i, generator=g) * i ** -0.5, torch.randn(e, h, r, generator=g) * 0.01,
                      gate_up_scale=2.0, down_scale=2.0)


def measure_read_bandwidth(nbytes: int = 512 << 20, seconds: float = 0.5) -> float:
    """GB/s of a multithreaded streaming read (torch sum over a buffer larger than the caches)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return best_rate(lambda: buf.sum(), seconds, buf.numel() * 4) / 1e9


def measure_expert_gflops(backend, seconds: float = 0.5, tokens: int = 512) -> float:
    """GFLOP/s of ``backend``'s routed-expert forward + backward with expert LoRA r=8, as a training step runs
    it, on a compute-bound layer (8 experts of H=1024, I=512, top-2): the ``cpu_expert_gflops`` of the cost
    model (``ktcore plan``)."""
    shape = Shape("rate probe", 8, 2, 1024, 512, (tokens,))
    weights, x, ids, w, lora = make_problem(shape, tokens, torch.bfloat16, lora_rank=8)
    packed = backend.pack(weights, activation="silu")
    grad_y = torch.ones_like(x)

    def step():
        _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
        backend.backward(packed, ctx, grad_y, lora)

    flops = tokens * shape.top_k * 12 * shape.hidden * shape.inter  # 3 matmuls of H x I, forward and backward
    return flops / median_time(step, seconds) / 1e9


def measure_h2d_gbps(nbytes: int = 256 << 20, seconds: float = 0.5) -> float:
    """GB/s of a copy from pinned host memory to the GPU (what gpu_stream placement moves experts with)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return best_rate(copy, seconds, nbytes) / 1e9


def measure_gpu_bf16_tflops(n: int = 8192, seconds: float = 0.5) -> float:
    """TFLOP/s of a bf16 n x n GEMM on the GPU (a peak: a training step reaches a fraction of it)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def gemm():
        a @ b
        torch.cuda.synchronize()

    return best_rate(gemm, seconds, 2.0 * n ** 3) / 1e12


def measure_rates(backend, cores: int, seconds: float = 0.5) -> dict:
    """This machine's rates for the cost model (``ktcore plan --rates``): the CPU backend's expert rate, DRAM
    bandwidth, and where there is a GPU its pinned copy rate, GEMM peak and memory."""
    rates = {"cpu_expert_gflops": round(measure_expert_gflops(backend, seconds), 1),
             "dram_gbps": round(measure_read_bandwidth(seconds=seconds), 1),
             "cpu_cores": cores,
             "host_ram_gib": round(total_memory_bytes() / 2**30, 1)}
    if torch.cuda.is_available():
        rates["h2d_gbps"] = round(measure_h2d_gbps(seconds=seconds), 1)
        rates["gpu_tflops"] = round(measure_gpu_bf16_tflops(seconds=seconds), 1)
        rates["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return rates
