"""The rates ``ktcore plan``'s cost model takes, measured on this machine (``ktcore doctor`` prints them as
``rates``): the CPU backend's routed-expert rate, DRAM bandwidth, and with a GPU its pinned copy rate, bf16 GEMM
peak and memory."""

from __future__ import annotations

import torch

from ..plugins.hw import total_memory_bytes
from .doctor import best_rate, measure_read_bandwidth


def measure_expert_gflops(backend, seconds: float = 0.5, tokens: int = 512) -> float:
    """GFLOP/s of ``backend``'s routed-expert forward + backward with expert LoRA r=8, as a training step runs
    it, on a compute-bound layer (8 experts of H=1024, I=512, top-2): the ``cpu_expert_gflops`` of the cost
    model (``ktcore plan``)."""
    from .bench import Shape, _Timed, make_problem, median_time

    shape = Shape("rate probe", 8, 2, 1024, 512, (tokens,))
    weights, x, ids, w, lora = make_problem(shape, tokens, torch.bfloat16, lora_rank=8)
    timed = _Timed(backend, weights, x, ids, w, backward=True, lora=lora)
    flops = tokens * shape.top_k * 12 * shape.hidden * shape.inter  # 3 matmuls of H x I, forward and backward
    return flops / median_time(timed.step, seconds) / 1e9


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


def rates_of_auto(seconds: float) -> dict:
    """The cost model's rates with the backend auto picks (``ktcore doctor --json > rates.json`` for plan)."""
    from ..config import KTConfig
    from ..plugins.select import get_backend
    from ..plugins.threads import backend_threads

    try:
        backend = get_backend("auto", KTConfig(), need_backward=True, need_lora=True)
        return measure_rates(backend, backend_threads(None), seconds)
    except Exception as exc:  # noqa: BLE001 - a failing probe must not take the report down
        return {"error": f"{type(exc).__name__}: {exc}"}
