"""Entry point ``ktcore: amx_bf16``: describes the backend without loading the compiled extension."""

from __future__ import annotations

from typing import Optional

import ktcore
from ktcore.specs import ExpertBackendSpec


def probe() -> Optional[str]:
    """None when this process can run the AMX kernels or, without AMX, the AVX-512 BF16 ones; else why not (never
    executes an AMX or AVX-512 instruction)."""
    from ktcore.plugins.hw import cpu_info

    missing = cpu_info().missing(REQUIRED)
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    try:
        from . import _ext  # baseline-compiled glue: importing it is safe on any x86-64 CPU
    except ImportError as exc:
        return f"the compiled extension ktcore_amx_bf16._ext does not import: {exc}"
    if not _ext.amx_unavailable_reason():
        return None
    return _ext.avx512_bf16_unavailable_reason() or None


REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # the avx512 kernels'; AMX adds amx_tile, amx_bf16


@ktcore.hookimpl
def ktcore_register_expert_backends():
    return [
        ExpertBackendSpec(
            name="amx_bf16",
            factory="ktcore_amx_bf16.backend:AMXBF16Backend",
            required_cpu_features=REQUIRED,
            weight_formats=("auto", "bf16"),
            supports_backward=True,
            supports_lora=True,
            priority=20,
            probe=probe,
            description="AMX BF16 tiles (AVX-512 BF16 for decode, and for every product on CPUs without AMX); "
                        "forward, backward and expert LoRA",
            doctor="ktcore_amx_bf16.doctor:report",
        )
    ]
