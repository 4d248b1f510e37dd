"""The hookimpl only; the format class is imported when it is used."""

from ktcore import hookimpl
from ktcore.specs import AdapterFormatSpec


@hookimpl
def ktcore_register_adapter_formats():
    return [AdapterFormatSpec(name="fused_expert", factory="ktcore_adapter_fused_expert.format:Format",
                              description="KT-compatible fused-expert LoRA (fused_expert_lora.safetensors + kt_adapter_manifest.json), validated fail-closed.",
                              files=("kt_adapter_manifest.json", "fused_expert_lora.safetensors"),
                              beside=("peft",))]
