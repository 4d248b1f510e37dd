"""The hookimpl only; the format class is imported when it is used."""

from ktcore import hookimpl
from ktcore.specs import AdapterFormatSpec


@hookimpl
def ktcore_register_adapter_formats():
    return [AdapterFormatSpec(name="peft", factory="ktcore_adapter_peft.format:Format",
                              description="The standard PEFT LoRA directory (adapter_config.json + adapter_model.safetensors), ktcore's default adapter format.",
                              files=("adapter_config.json",), peft_native=True)]
