"""The yardsticks of ``ktcore doctor``, ``ktcore bench`` and ``benchmarks/bench_amx_bf16.py``: the AMX BF16
tile-only peak and the DRAM streaming read rate, measured by the optional extension ``ktcore_amx_bf16._measure``
(built by this package's CMake project; the backend never imports it).

``Meter(num_threads, kernels)`` measures on a pool of its own: ``read_seconds(addr, nbytes)`` (one streaming read of
a buffer, e.g. a layer's packed weights), ``read_bandwidth(nbytes, repeats)``, ``amx_peak(seconds)`` and the
``bench_gemm(m, kb, iters)`` micro-benchmark of the kernel table's ``gemm_block``.
"""

from __future__ import annotations

from ._measure import Meter, measure_amx_peak_gflops, measure_read_bandwidth

__all__ = ["Meter", "amx_peak_gflops", "read_bandwidth_gbps"]


def amx_peak_gflops(seconds: float = 1.0) -> float:
    """GFLOP/s of AMX BF16 tile dot products alone on every hardware thread (raises where AMX is unavailable)."""
    return float(measure_amx_peak_gflops(seconds))


def read_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """GB/s of the best of five streaming reads of a fresh buffer of nbytes on every hardware thread."""
    return float(measure_read_bandwidth(nbytes))
