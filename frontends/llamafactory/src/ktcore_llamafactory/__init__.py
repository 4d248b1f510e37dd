"""ktcore's LLaMA-Factory training frontend (``ktcore train CFG.yaml --frontend llamafactory``).

LLaMA-Factory's own ``run_exp`` runs the training (SFT, DPO); ktcore loads the model (routed experts in the CPU
expert backend) and attaches the LoRA (routed-expert LoRA in PEFT's ``target_parameters`` layout).

Kept import-light: ``ktcore_llamafactory.plugin`` registers the frontend without importing llamafactory. The
integration surface that LLaMA-Factory releases with KT support call is available here, imported lazily:
``load_kt_pretrained_model(config, model_args)``, ``get_kt_peft_model(model, peft_kwargs)`` and
``load_kt_peft_model(model_args, model)``.
"""

__version__ = "0.1.0"

__all__ = ["load_kt_pretrained_model", "get_kt_peft_model", "load_kt_peft_model", "run"]


def __getattr__(name):
    if name in ("load_kt_pretrained_model", "get_kt_peft_model", "load_kt_peft_model"):
        from . import integration

        return getattr(integration, name)
    if name == "run":
        from .train import run

        return run
    raise AttributeError(f"module 'ktcore_llamafactory' has no attribute {name!r}")
