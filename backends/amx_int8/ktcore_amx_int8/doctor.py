"""``ktcore doctor``'s probe of the amx_int8 backend: the AMX INT8 peak, measured by a tile-only loop."""

from __future__ import annotations


def report(seconds: float) -> dict:
    """amx_int8_peak_gops (None where this process may not run AMX INT8), which kernels the backend would run here,
    and where the figure comes from."""
    from . import _ext

    why = _ext.amx_unavailable_reason()
    kernels = "amx" if not why else ("vnni" if not _ext.vnni_unavailable_reason() else None)
    if why:
        return {"amx_int8_peak_gops": None, "amx_int8_peak_source": why, "amx_int8_kernels": kernels}
    return {"amx_int8_peak_gops": round(_ext.amx_int8_peak_gops(seconds), 1),
            "amx_int8_peak_source": "amx_int8 tile loop (TDPBSSD)", "amx_int8_kernels": kernels}
