"""``ktcore doctor``: what this machine offers the expert backends, with short measured probes.

The peak rates are the yardsticks the benchmarks divide by: DRAM read bandwidth (memory-bound expert
layers) and bf16 matrix throughput (compute-bound ones). oneDNN's bf16 GEMM rate is always measured; an
expert backend adds what it measures itself (amx_bf16: its AMX tile peak) through the ``doctor`` probe its
descriptor names, whose fields are printed and put in ``--json`` with the others.
"""

from __future__ import annotations

import os
import time

import torch

from ..experts.probe import best_rate, measure_read_bandwidth
from ..plugins import get_registry
from ..plugins.hw import KNOWN_FLAGS, cpu_info, total_memory_bytes
from ..specs import import_object


def measure_onednn_bf16_gflops(seconds: float = 0.5, max_n: int = 2048) -> tuple[float, int]:
    """(GFLOP/s, n) of torch's bf16 n x n GEMM; n grows while one call stays well inside the time budget
    (CPUs without bf16 instructions run it hundreds of times slower)."""
    n = 256
    while True:
        a = torch.randn(n, n).to(torch.bfloat16)
        b = torch.randn(n, n).to(torch.bfloat16)
        start = time.perf_counter()
        a @ b
        took = time.perf_counter() - start
        if n >= max_n or took * 8 > seconds:
            return best_rate(lambda: a @ b, seconds, 2.0 * n ** 3) / 1e9, n
        n *= 2


def backend_reports(seconds: float = 0.5) -> dict:
    """The fields every expert backend's doctor probe reports (a probe that fails reports why, in one field)."""
    fields = {}
    for name, spec in sorted(get_registry().specs("expert_backend").items()):
        if spec.doctor:
            try:
                fields.update(import_object(spec.doctor)(seconds))
            except Exception as exc:  # noqa: BLE001 - a broken probe must not take the report down
                fields[f"{name}_doctor_error"] = f"{type(exc).__name__}: {exc}"
    return fields


def collect(seconds: float = 0.5) -> dict:
    info = cpu_info()
    report = {
        "cpu": info.model_name,
        "logical_cores": info.logical_cores,
        "torch_threads": torch.get_num_threads(),
        "flags": {flag: flag in info.flags for flag in KNOWN_FLAGS},
        "flags_overridden_by_KTCORE_CPU_FLAGS": info.overridden,
        "amx_permission": info.amx_permission,
        "amx_permission_reason": info.amx_permission_reason,
        "ram_gib": round(total_memory_bytes() / 2**30, 1),
        "torch": torch.__version__,
        "gpu": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
    }
    report["dram_read_gbps"] = round(measure_read_bandwidth(seconds=seconds), 1)
    gemm, n = measure_onednn_bf16_gflops(seconds=seconds)
    report["onednn_bf16_gemm_gflops"], report["onednn_bf16_gemm_n"] = round(gemm, 1), n
    report.update(backend_reports(seconds))
    from ..plugins.select import resolve_backend

    choice = resolve_backend("auto", need_backward=True, need_lora=True)
    report["auto_backend"] = choice.spec.name if choice.spec else None
    report["threads_env"] = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "KTCORE_CPU_FLAGS") if k in os.environ}
    return report


CORE_FIELDS = ("cpu", "logical_cores", "torch_threads", "flags", "flags_overridden_by_KTCORE_CPU_FLAGS",
               "amx_permission", "amx_permission_reason", "ram_gib", "gpu", "torch", "dram_read_gbps",
               "onednn_bf16_gemm_gflops", "onednn_bf16_gemm_n", "auto_backend", "threads_env", "rates")


def format_report(report: dict) -> str:
    flags = " ".join(f"{f}{'+' if ok else '-'}" for f, ok in report["flags"].items())
    lines = [
        f"CPU            {report['cpu']} ({report['logical_cores']} logical cores, torch uses "
        f"{report['torch_threads']} threads)",
        f"features       {flags}" + ("  (from KTCORE_CPU_FLAGS)" if report["flags_overridden_by_KTCORE_CPU_FLAGS"]
                                      else ""),
        f"AMX permission {'granted' if report['amx_permission'] else 'no: ' + report['amx_permission_reason']}",
        f"RAM            {report['ram_gib']} GiB",
        f"GPU            {', '.join(report['gpu']) or 'none (everything runs on the CPU)'}",
        f"torch          {report['torch']}",
        f"DRAM read      {report['dram_read_gbps']} GB/s (measured)",
        f"oneDNN bf16    {report['onednn_bf16_gemm_gflops']} GFLOP/s (measured {report['onednn_bf16_gemm_n']}^3 GEMM)",
    ]
    lines += [f"{key}: {value}" for key, value in report.items() if key not in CORE_FIELDS]  # the backends' probes
    lines.append(f"auto backend   {report['auto_backend']}")
    if "rates" in report:
        lines.append("plan rates     " + ", ".join(f"{k} {v}" for k, v in report["rates"].items())
                     + "  (ktcore doctor --json > rates.json; ktcore plan CFG.yaml --rates rates.json)")
    return "\n".join(lines)
