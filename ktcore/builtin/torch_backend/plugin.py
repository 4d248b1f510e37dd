"""Built-in plugin: the pure-PyTorch reference expert backend (any CPU; the oracle for every other)."""

from ktcore import hookimpl
from ktcore.specs import ExpertBackendSpec


@hookimpl
def ktcore_register_expert_backends():
    return [
        ExpertBackendSpec(
            name="torch",
            factory="ktcore.builtin.torch_backend.backend:TorchExpertBackend",
            required_cpu_features=(),
            weight_formats=("auto", "fp32", "bf16"),
            supports_backward=True,
            supports_lora=True,
            priority=0,
            description="pure PyTorch per-expert loop; any CPU; reference for the other backends",
        )
    ]
