"""Plugin module: registers the ``llamafactory`` frontend. Imports nothing heavy (listing must not import
llamafactory)."""

from ktcore import hookimpl
from ktcore.specs import FrontendSpec


@hookimpl
def ktcore_register_frontends():
    return [
        FrontendSpec(
            name="llamafactory",
            run="ktcore_llamafactory.train:run",
            evaluate="ktcore_llamafactory.evaluate:run",
            required_packages=("llamafactory",),
            stages=("sft", "dpo"),
            description="LLaMA-Factory's own run_exp (SFT, DPO) on a ktcore-loaded model; LoRA incl. routed-expert LoRA",
        )
    ]
