"""``kt_expert_lora_device: host``: the routed experts' LoRA factors live in host memory, and with them their
gradients and the optimizer state a trainer creates for them.

Why: a CPU backend computes with these factors and writes their gradients on the host. Kept on the model's GPU
(``model``, the default), every MoE layer copies its factors to the host and their gradients back, each step, and
the GPU holds them with their gradients and AdamW's two moments (16 bytes a parameter in fp32: 1.8 GB for
DeepSeek-V2-Lite at r=8, 111 M parameters; 39 GB for DeepSeek-V3, 2.4 B). In host memory the backend reads them in
place (``CudaStaging.to_host`` passes host tensors through) and its gradients are the ones autograd accumulates
(``ExpertJob`` neither pins nor copies them); the optimizer updates them on the CPU, with torch given the cores the
idle backend pool leaves (``ktcore.plugins.threads.give_optimizer_steps_the_cores``).

How: PEFT creates the factors as the ``lora_A``/``lora_B`` ``nn.Linear`` of a ``ParamWrapper`` per expert
parameter, on the device of the (placeholder) parameter. ``keep_on_host`` moves their parameters to host memory in
place (the Parameter objects stay, so an optimizer that already holds them keeps working, and state it creates
later lands beside them) and makes each a ``HostLoRALinear``, whose ``_apply`` keeps it there: every
``model.to(device)``, ``.cuda()``, accelerate's ``prepare_model`` and HF Trainer's ``_move_model_to_device`` go
through ``Module._apply``, so this one override covers them all, and a user's own ``model.to("cuda")`` too; dtype
moves still apply. It runs when ktcore makes a PeftModel (``peft_wrapping(model)``: the frontends, adapter
loading, DPO's trainer) and, for a PeftModel made by the user's own ``get_peft_model``, before an MoE block's
first forward (``install``'s pre-hook). Only layers computed wholly by a CPU backend qualify: a layer on the GPU,
streamed or split (``kt_placement``) computes its LoRA on the GPU, so its factors stay with the model.

DDP all-reduces gradients on the model's device and refuses a module on two device types, so with several
processes and the model on a GPU ``keep_on_host`` refuses in one line (use ``model``).
"""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from ..plugins.threads import give_optimizer_steps_the_cores

HOST = "host"


class HostLoRALinear(torch.nn.Linear):
    """An expert-LoRA factor (PEFT's ``lora_A``/``lora_B`` Linear) that stays in host memory: a move to another
    device leaves it where it is, a dtype change applies."""

    def _apply(self, fn, recurse=True):
        # Module._apply hands over only a function; what it does to a tensor like ours is learnt from an empty one
        # (a 0-element tensor moved to the GPU costs nothing), and only its dtype is kept
        dtype = fn(torch.empty(0, dtype=self.weight.dtype)).dtype
        return super()._apply(lambda t: t.to(dtype=dtype) if t.is_floating_point() else t, recurse)


def wants_host(model) -> bool:
    info = model.__dict__.get("ktcore")
    return info is not None and info.config.kt_expert_lora_device == HOST


def on_cpu_backend(experts) -> bool:
    """A routed-experts module computed wholly by a CPU backend (not on the GPU, streamed, split or with experts
    resident on the GPU)."""
    marks = experts.__dict__  # what wrap.py installed: a split layer (hybrid, auto, resident) also computes on the GPU
    return "_ktcore_layer" in marks and not any(k in marks for k in ("_ktcore_stream", "_ktcore_auto",
                                                                       "_ktcore_cpu_experts", "_ktcore_resident"))


def expert_lora_factors(module) -> list:
    """The LoRA Linears of every PEFT ``ParamWrapper`` under ``module`` whose experts a CPU backend computes."""
    from peft.tuners.lora.layer import ParamWrapper

    found = []
    for wrapper in module.modules():
        if isinstance(wrapper, ParamWrapper) and on_cpu_backend(wrapper.get_base_layer()):
            found += [*wrapper.lora_A.values(), *wrapper.lora_B.values()]
    return found


def _refuse_distributed() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    if world > 1:
        raise ConfigError(f"kt_config.kt_expert_lora_device: host cannot run with {world} processes: DDP all-reduces "
                          "gradients on the model's device and refuses a model on two device types; use "
                          "kt_expert_lora_device: model")


def _to_host(linear: torch.nn.Linear) -> None:
    for param in linear.parameters(recurse=False):
        if param.device.type != "cpu":
            param.data = param.data.to("cpu")  # in place: optimizers hold the Parameter object
            if param.grad is not None:
                param.grad = param.grad.to("cpu")
    linear.__class__ = HostLoRALinear  # a subclass adding only _apply: PEFT's references and state stay valid


def keep_on_host(module) -> int:
    """Move the expert-LoRA factors under ``module`` (a PeftModel, its base model or one MoE block) to host memory
    and keep them there; returns how many factor Linears it changed (0 when all already were)."""
    pending = [f for f in expert_lora_factors(module) if not isinstance(f, HostLoRALinear)]
    if not pending:
        return 0
    if any(p.device.type != "cpu" for f in pending for p in f.parameters()):
        _refuse_distributed()
    for factor in pending:
        _to_host(factor)
    give_optimizer_steps_the_cores()
    return len(pending)


def _before_block(block, args) -> None:
    keep_on_host(block)


def install(model, experts_names) -> None:
    """For ``kt_expert_lora_device: host``: a forward pre-hook on the MoE block holding each of ``experts_names``
    (CPU-backend experts modules), so that expert LoRA a user's own ``get_peft_model`` created moves to the host
    before the block first runs (a no-op scan of the block's few modules afterwards)."""
    blocks = {name.rpartition(".")[0] for name in experts_names}
    for name in blocks:
        model.get_submodule(name).register_forward_pre_hook(_before_block)


def host_factor_bytes(model) -> int:
    """Bytes of expert-LoRA parameters kept in host memory (for reports)."""
    return sum(p.numel() * p.element_size() for f in expert_lora_factors(model) if isinstance(f, HostLoRALinear)
               for p in f.parameters())
