"""Entry point ``ktcore: amx_int8``: describes the backend without loading the compiled extension."""

from __future__ import annotations

from typing import Optional

import ktcore
from ktcore.specs import ExpertBackendSpec

# The VNNI kernels need these; AMX INT8 (amx_tile, amx_int8) is used on top where the CPU and kernel allow it.
REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def probe() -> Optional[str]:
    """None when this process can run the kernels (AMX INT8, or AVX-512 VNNI without AMX), else why not; never
    executes an AVX-512 or AMX instruction."""
    try:
        from . import _ext  # baseline-compiled glue: importing it is safe on any x86-64 CPU
    except ImportError as exc:
        return f"the compiled extension ktcore_amx_int8._ext does not import: {exc}"
    if not _ext.amx_unavailable_reason():
        return None
    return _ext.vnni_unavailable_reason() or None


@ktcore.hookimpl
def ktcore_register_expert_backends():
    return [
        ExpertBackendSpec(
            name="amx_int8",
            factory="ktcore_amx_int8.backend:AMXInt8Backend",
            required_cpu_features=REQUIRED,
            # chosen by `auto` only for kt_expert_weight_format: int8: quantising is the user's choice
            weight_formats=("int8",),
            lossy=True,
            supports_backward=True,
            supports_lora=True,
            priority=30,
            probe=probe,
            description="int8 experts: AMX INT8 tiles (AVX-512 VNNI for few rows, and where AMX is missing); "
                        "forward, backward and expert LoRA",
            doctor="ktcore_amx_int8.doctor:report",
        )
    ]
