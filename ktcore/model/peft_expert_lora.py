"""Routed-expert LoRA in PEFT's own ``target_parameters`` layout.

PEFT wraps each targeted expert parameter in a ``ParamWrapper`` and, while it runs, parametrizes it as
``W + scaling * lhs @ rhs``. ktcore's placeholders turn that into a record of the factors
(``ktcore.model.placeholder``); this module reads them back as an ``ExpertLoRA`` for the backend, and builds the
PEFT ``LoraConfig`` for a training YAML.

PEFT 0.21's mapping (``ParamWrapper.update_layer`` / ``get_delta_factors``), for a parameter of E experts and rank r:
``lora_A.weight`` is ``[E*r, in]`` and ``lora_B.weight`` ``[out, r*E]`` (in/out of the parameter: ``[E, out, in]``,
or ``[E, in, out]`` where the experts module ``is_transposed``); ``A = lora_A.weight.reshape(E, r, in)`` (expert-major
rows) and ``B = lora_B.weight.reshape(out, r, E).permute(2, 0, 1)`` (``[E, out, r]``: expert e's column k is column
``k*E + e``, a strided view); ``(lhs, rhs)`` is ``(B, A)``, or ``(A^T, B^T)`` when transposed; ``scaling`` is
``lora_alpha / r`` (``/ sqrt(r)`` with rslora); and then both are cast ``.to(param.dtype)``: with PEFT's fp32
factors on a bf16 model, a cast of each factor in every forward (and every checkpointed recompute) and one of its
gradient in backward. For experts a CPU backend computes (``host_lora.on_cpu_backend``), ``own_dtype_factors``
drops that cast: the placeholder records the views of the parameters themselves, the backend reads them in their
own dtype (fp32 or bf16, by address and strides) and writes their gradients in that dtype straight into autograd:
the backend's fp32 LoRA gradients reach the fp32 parameters unrounded, and no cast runs, forward or backward.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Optional

import torch

from ..experts import ExpertLoRA
from . import host_lora
from .placeholder import is_placeholder


@contextlib.contextmanager
def peft_wrapping(model=None):
    """Around a call that makes a PeftModel (``get_peft_model``, ``PeftModel.from_pretrained``, a TRL trainer
    given a ``peft_config``) on the ktcore ``model``.

    PEFT (0.21.2, ``PeftModel.__init__``) reads ``model.is_gradient_checkpointing``, which transformers 5.2x
    deprecated in favour of ``is_activation_checkpointing``, so every wrap printed a FutureWarning no ktcore user
    can act on. Exactly that warning, only inside the call; PEFT gets the same answer (the property still returns
    ``is_activation_checkpointing``). Afterwards, with ``kt_expert_lora_device: host``, the expert LoRA the call
    created moves to host memory (``host_lora.keep_on_host``) before anything (a trainer's optimizer or its
    resumed state) is created beside it on the GPU."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield
    if model is not None and host_lora.wants_host(model):
        host_lora.keep_on_host(model)


_peft_get_delta_factors = None  # PEFT's own ParamWrapper.get_delta_factors, once own_dtype_factors replaced it


def _get_delta_factors(self, adapter_name):
    """``ParamWrapper.get_delta_factors``: PEFT's own, except on experts a CPU backend computes, where the factors are
    the views of the LoRA parameters in their own dtype (PEFT 0.21's layout, see the module docstring), uncast.

    Why there too, with the model on a GPU (``kt_expert_lora_device: model``): the native backends compute the LoRA
    terms in fp32 in any case; fp32 factors cross PCIe at twice the bytes of bf16 ones: for DeepSeek-V2-Lite at
    r=8, 4.2 M elements a layer, 8.4 MB more each way, 0.15 ms at the 55 GB/s pinned host-to-device rate measured on
    the H200 machine (``examples/rates/h200.json``), about 8 ms for the 26 layers' forward and backward against a
    step of over 3 s (0.3%). For that, the gradients reach the parameters unrounded (a bf16 gradient is off by up
    to 2^-9 of each element), the forward uses the factors the optimizer holds, and the same adapter trains to the
    same numbers with ``kt_expert_lora_device: model`` or ``host``, on a GPU or a CPU model."""
    base = self.get_base_layer()
    if not host_lora.on_cpu_backend(base) or not is_placeholder(getattr(base, self.parameter_name, None)):
        return _peft_get_delta_factors(self, adapter_name)
    a = self.lora_A[adapter_name].weight
    b = self.lora_B[adapter_name].weight
    a = a.reshape(self.num_experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, self.num_experts).permute(2, 0, 1)  # [E, out, r]
    if not self._did_swap_in_out_features:  # the parameter is [E, in, out] (is_transposed)
        return a.transpose(-2, -1), b.transpose(-2, -1), self.scaling[adapter_name]
    return b, a, self.scaling[adapter_name]


def own_dtype_factors() -> None:
    """Make PEFT's ``ParamWrapper`` hand CPU-backend experts their LoRA factors uncast (``_get_delta_factors``);
    once per process, and only where PEFT is imported already (a model without adapters never imports it). Every
    other ParamWrapper (another model, experts on the GPU, streamed or split) keeps PEFT's own method."""
    global _peft_get_delta_factors
    if _peft_get_delta_factors is not None or "peft" not in sys.modules:
        return
    from peft.tuners.lora.layer import ParamWrapper

    # before 0.21 PEFT has no factor folding (it materialises the delta, which the placeholder refuses): nothing
    # to replace; the tests compare the replacement with the installed PEFT's own method, so a drift shows there
    _peft_get_delta_factors = getattr(ParamWrapper, "get_delta_factors", False)
    if _peft_get_delta_factors:
        ParamWrapper.get_delta_factors = _get_delta_factors


def _before_block(block, args) -> None:
    own_dtype_factors()


def install(model, experts_names) -> None:
    """A forward pre-hook on the MoE block of each of ``experts_names`` (experts a CPU backend computes) that calls
    ``own_dtype_factors`` before PEFT's ParamWrapper (inside the block) builds the factors: PEFT may be imported, and
    the adapter made, after the model was wrapped (a user's own ``get_peft_model``). After the first call the hook is
    a flag test."""
    own_dtype_factors()
    for name in {name.rpartition(".")[0] for name in experts_names}:
        model.get_submodule(name).register_forward_pre_hook(_before_block)


def _factors(module, name: str):
    """(B [E, out, r], A [E, r, in], scaling) of the LoRA on ``module.<name>``, or None."""
    param = getattr(module, name)
    if not is_placeholder(param) or param.lora is None:
        return None
    lhs, rhs, scaling = param.lora
    if getattr(module, "is_transposed", False):  # stored [E, in, out]: lhs = A^T, rhs = B^T
        return rhs.transpose(-1, -2), lhs.transpose(-1, -2), scaling
    return lhs, rhs, scaling


def expert_lora_of(module) -> Optional[ExpertLoRA]:
    """The active expert LoRA of one experts module (None when PEFT is absent or adapters are disabled)."""
    gate_up, down = _factors(module, "gate_up_proj"), _factors(module, "down_proj")
    if gate_up is None and down is None:
        return None
    lora = ExpertLoRA()
    if gate_up is not None:
        b, a, scale = gate_up
        if not getattr(module, "is_concatenated", True):  # interleaved [g0, u0, g1, u1, ...] rows
            b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        lora.gate_up_a, lora.gate_up_b, lora.gate_up_scale = a, b, float(scale)
    if down is not None:
        b, a, scale = down
        lora.down_a, lora.down_b, lora.down_scale = a, b, float(scale)
    return lora


def lora_targets(model, arch, lora_target: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for ``lora_target`` ('all', or a comma list of names).

    'all' means the architecture's linear layers plus the routed experts; 'experts' in a list means the
    routed experts' gate_up_proj and down_proj; any other name every module of that name. A Linear name PEFT
    would move onto the routed experts (``peft_renamed``) is given to PEFT as the parameter ``<name>.weight``
    instead: PEFT's transformers-4 conversion rewrites every form of ``target_modules`` that reaches such a Linear
    (the bare name, a full module path, a regex string: it resolves a regex to the leaf names it matches first) but
    leaves ``target_parameters`` alone, and a ParamWrapper on a Linear's 2-D weight is a plain rank-r LoRA
    (``lora_A`` [r, in], ``lora_B`` [out, r], delta ``scaling * B @ A``) saved under the same keys as one made
    through ``target_modules``.
    """
    present = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    experts_suffix = arch.experts_module.split("{layer}.", 1)[-1]
    expert_params = [f"{experts_suffix}.{p}" for p in arch.expert_lora_parameters]
    wanted = [t.strip() for t in lora_target.split(",") if t.strip()]
    modules, params = [], []
    if wanted == ["all"]:
        modules, params = [t for t in arch.default_lora_targets if t in present], list(expert_params)
        wanted = []
    for target in wanted:
        if target == "experts":
            params += expert_params
            continue
        # a name means every module of that name: the routed experts' parameter (down_proj) and the Linears
        # (a dense MLP's or shared expert's down_proj), as a transformers-4 list target did
        if target in arch.expert_lora_parameters:
            params.append(f"{experts_suffix}.{target}")
        if target in present:
            modules.append(target)
        elif target not in arch.expert_lora_parameters:
            choices = sorted(present | set(arch.expert_lora_parameters) | {"all", "experts"})
            raise ValueError(f"lora_target {target!r} matches no linear layer of this model; choose from "
                             f"{', '.join(choices)}")
    renamed = set(peft_renamed(model, modules))
    params += [f"{m}.weight" for m in modules if m in renamed]
    return [m for m in modules if m not in renamed], list(dict.fromkeys(params))


def peft_renamed(model, modules: list[str]) -> list[str]:
    """The names in ``modules`` that PEFT would not put LoRA on as named.

    PEFT (0.21) converts a LoraConfig written for transformers 4 before it wraps a model of an MoE family whose
    experts transformers 5 fused (Mixtral, Qwen2-MoE and the families mapped onto them: DeepSeek-V2/V3,
    Qwen3-MoE, ...): ``gate_proj``/``up_proj``/``down_proj`` in ``target_modules`` become the routed experts'
    ``gate_up_proj``/``down_proj`` parameters (``gate_proj`` and ``up_proj`` together: a rank pattern of 2r on
    ``gate_up_proj``). On such a model a dense MLP's or a shared expert's ``gate_proj`` (still a Linear) then
    silently gets no LoRA, and the experts a LoRA of another rank than asked. PEFT's own conversion is run on a
    trial config to find those names (``lora_targets`` hands them to PEFT as ``<name>.weight`` parameters)."""
    if not modules:
        return []
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT without the conversion keeps every name
        return []
    renamed = []
    for name in modules:  # one at a time: gate_proj without up_proj makes the conversion raise (fused into one)
        trial = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(trial, model=model, conversions=None)
        except ValueError:
            renamed.append(name)
            continue
        if name not in (trial.target_modules or ()):
            renamed.append(name)
    return renamed


def lora_config_for(model, arch, cfg):
    """A peft.LoraConfig for a TrainConfig ``cfg`` on ``model`` (arch: its ArchSpec)."""
    from peft import LoraConfig

    modules, params = lora_targets(model, arch, cfg.lora_target)
    if params and cfg.lora_dropout:
        raise ValueError(f"lora_dropout={cfg.lora_dropout}: PEFT's target_parameters LoRA ({', '.join(params)}) has "
                         "no dropout; set lora_dropout: 0, or leave those out of lora_target")
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.effective_lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=modules or None, target_parameters=params or None, task_type="CAUSAL_LM")
