"""ktcore plugin module: hook implementations and descriptors only (no torch import here).

``ktcore plugins`` and ``ktcore list-backends`` import this module; the backend class in ``backend.py`` is
imported only when ktcore instantiates the backend.
"""

import importlib.util

from ktcore import hookimpl
from ktcore.specs import ExpertBackendSpec


def _probe():
    """Cheap usability check: None when usable, else the reason. Never import heavy modules here."""
    if importlib.util.find_spec("torch") is None:
        return "needs torch (pip install torch)"
    return None


@hookimpl
def ktcore_register_expert_backends():
    return [
        ExpertBackendSpec(
            name="example",
            factory="ktcore_example_backend.backend:ExampleExpertBackend",
            required_cpu_features=(),  # e.g. ("amx_tile", "amx_bf16") for an AMX kernel
            weight_formats=("auto", "fp32"),
            supports_backward=True,
            supports_lora=True,
            priority=-10,  # slower than the built-in torch backend: `auto` never prefers it
            probe=_probe,
            description="example plugin: per-expert loop with a hand-written backward (fp32)",
        )
    ]
