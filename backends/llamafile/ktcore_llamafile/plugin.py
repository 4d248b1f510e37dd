"""Entry point ``ktcore: llamafile``: describes the backend without loading the compiled extension."""

from __future__ import annotations

from typing import Optional

import ktcore
from ktcore.specs import ExpertBackendSpec

FORMATS = ("auto", "gguf", "f32", "fp32", "f16", "bf16", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")
CONVERT_FORMATS = ("q4_k", "q8_0", "q4_0", "q4_1")  # what `ktcore convert` writes; the first is its default


def probe() -> Optional[str]:
    """None when this process can run the kernels, else why not."""
    from ktcore.plugins.hw import cpu_info

    missing = cpu_info().missing(("avx2", "fma"))
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    try:
        from . import _ext  # baseline-compiled glue: importing it is safe on any x86-64 CPU
    except ImportError as exc:
        return f"the compiled extension ktcore_llamafile._ext does not import: {exc}"
    if not _ext.cpu_has("avx2"):
        return "CPU lacks avx2/fma/f16c"
    return None


@ktcore.hookimpl
def ktcore_register_expert_backends():
    return [
        ExpertBackendSpec(
            name="llamafile",
            factory="ktcore_llamafile.backend:LlamafileBackend",
            required_cpu_features=("avx2", "fma"),
            weight_formats=FORMATS,
            supports_backward=True,
            supports_lora=True,
            priority=10,
            probe=probe,
            description="GGUF blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K/F16/BF16/F32) x int8 activations, "
                        "AVX-512 VNNI or AVX2; forward, backward and expert LoRA",
            converter="ktcore_llamafile.convert:convert_gguf",
            convert_formats=CONVERT_FORMATS,
        )
    ]
