"""``ktcore doctor``'s probe of the amx_bf16 backend: the AMX BF16 peak, measured by a tile-only loop."""

from __future__ import annotations


def report(seconds: float) -> dict:
    """amx_bf16_peak_gflops (None where this process may not run AMX), which kernels the backend would run here
    (amx, avx512 on CPUs with AVX-512 BF16 but no AMX, or None), and where the figure comes from."""
    from ktcore.plugins.hw import cpu_info

    from . import _ext

    kernels = "amx" if not _ext.amx_unavailable_reason() else (
        "avx512" if not _ext.avx512_bf16_unavailable_reason() else None)
    info = cpu_info()
    if not info.amx_permission:
        return {"amx_bf16_peak_gflops": None, "amx_bf16_peak_source": info.amx_permission_reason,
                "amx_bf16_kernels": kernels}
    from .measure import amx_peak_gflops

    return {"amx_bf16_peak_gflops": round(amx_peak_gflops(seconds), 1),
            "amx_bf16_peak_source": "amx_bf16 tile loop", "amx_bf16_kernels": kernels}
