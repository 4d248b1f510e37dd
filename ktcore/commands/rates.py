"""The rates ``ktcore plan``'s cost model takes, measured on this machine (``ktcore doctor`` prints them as
``rates``): the CPU backend's routed-expert rate, DRAM bandwidth, and with a GPU its pinned copy rate, bf16 GEMM
peak and memory. The probes live in ``ktcore.experts.probe`` (auto placement measures with them at load)."""

from __future__ import annotations

from ..experts.probe import measure_expert_gflops, measure_gpu_bf16_tflops, measure_h2d_gbps, measure_rates

__all__ = ["measure_expert_gflops", "measure_gpu_bf16_tflops", "measure_h2d_gbps", "measure_rates", "rates_of_auto"]


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
