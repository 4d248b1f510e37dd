"""The hookimpl only; the format class is imported when it is used."""

from ktcore import hookimpl
from ktcore.specs import AdapterFormatSpec


@hookimpl
def ktcore_register_adapter_formats():
    return [AdapterFormatSpec(name="gguf", factory="ktcore_adapter_gguf.format:Format",
                              description="llama.cpp LoRA adapter GGUF (general.type = adapter), expert LoRA on the _exps tensors.",
                              magic=b"GGUF")]
