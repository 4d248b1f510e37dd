"""Plugin module: registers the ``trl`` frontend. Imports nothing heavy (listing must not import trl)."""

from ktcore import hookimpl
from ktcore.specs import FrontendSpec


@hookimpl
def ktcore_register_frontends():
    return [
        FrontendSpec(
            name="trl",
            run="ktcore_trl.train:run",
            required_packages=("trl", "datasets"),
            stages=("sft", "dpo"),
            description="TRL SFTTrainer / DPOTrainer with LLaMA-Factory-style datasets; LoRA incl. routed-expert LoRA",
        )
    ]
