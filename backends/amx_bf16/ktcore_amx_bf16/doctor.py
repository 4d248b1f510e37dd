"""``ktcore doctor``'s probe of the amx_bf16 backend: the AMX BF16 peak, measured by a tile-only loop."""

from __future__ import annotations


def report(seconds: float) -> dict:
    """amx_bf16_peak_gflops (None where this process may not run AMX) and where the figure comes from."""
    from ktcore.plugins.hw import cpu_info

    info = cpu_info()
    if not info.amx_permission:
        return {"amx_bf16_peak_gflops": None, "amx_bf16_peak_source": info.amx_permission_reason}
    from .measure import amx_peak_gflops

    return {"amx_bf16_peak_gflops": round(amx_peak_gflops(seconds), 1),
            "amx_bf16_peak_source": "amx_bf16 tile loop"}
