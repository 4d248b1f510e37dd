"""Zero-storage stand-ins for the routed-expert parameters of a wrapped model.

Once ktcore wraps a model, the expert backend owns the packed weights; the HF ``gate_up_proj``/``down_proj``
parameters become placeholders with the right shape, dtype and device but no storage. The rest of the
ecosystem keeps working on them: parameter counts, ``model.to(...)``, PEFT's ``target_parameters``.

PEFT applies expert LoRA by parametrizing the parameter as ``baddbmm(W, lhs, rhs, alpha=scaling)``. On a
placeholder that returns another placeholder carrying the factors (no ``[E, out, in]`` delta is ever
formed); ktcore's experts forward reads them and hands them to the backend. On experts a CPU backend computes the
factors are views of PEFT's own (fp32) parameters, not casts to the placeholder's dtype
(``ktcore.model.peft_expert_lora._get_delta_factors``).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class ExpertWeightsUnavailable(RuntimeError):
    pass


class ExpertWeightPlaceholder(torch.Tensor):
    """Shape-only tensor; ``lora`` is None or ``(lhs, rhs, scaling)`` with ``W + scaling * lhs @ rhs``."""

    @staticmethod
    def __new__(cls, shape, dtype, device, lora=None):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                 requires_grad=False)
        t.lora = lora
        return t

    def __init__(self, shape, dtype, device, lora=None):
        pass

    def __repr__(self, *, tensor_contents=None):
        extra = ", with LoRA factors" if self.lora is not None else ""
        return (f"ExpertWeightPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}"
                f"{extra}; weights live in the ktcore expert backend)")

    def _like(self, dtype=None, device=None, lora="same"):
        return ExpertWeightPlaceholder(self.shape, dtype or self.dtype, device or self.device,
                                       self.lora if lora == "same" else lora)

    def __reduce_ex__(self, protocol):
        raise ExpertWeightsUnavailable(
            "routed-expert weights of a ktcore-wrapped model live in the CPU expert backend and cannot be "
            "pickled or saved from the model; save the adapter (save_pretrained on the PEFT model) or write a "
            "merged model with `ktcore export`")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        this = args[0]
        if packet in (aten.detach, aten.alias, aten.clone, aten.lift_fresh):
            return this._like()
        if packet is aten._to_copy:
            return this._like(dtype=kwargs.get("dtype"), device=kwargs.get("device"))
        if packet in (aten.empty_like, aten.zeros_like):
            return this._like(dtype=kwargs.get("dtype"), device=kwargs.get("device"), lora=None)
        if packet is aten.set_ and isinstance(args[1], ExpertWeightPlaceholder):
            # torch.nn.utils.parametrize re-seats the original on itself
            this.lora = args[1].lora
            return this
        if packet in (aten.normal_, aten.uniform_, aten.zero_, aten.fill_):
            return this  # model initialisers touch every parameter; the real weights are in the backend
        if packet is aten.baddbmm:
            lhs, rhs = args[1], args[2]
            if kwargs.get("beta", 1) != 1 or this.lora is not None:
                raise ExpertWeightsUnavailable("ktcore supports one active LoRA adapter on routed experts")
            return this._like(lora=(lhs, rhs, kwargs.get("alpha", 1)))
        if packet is aten.add and isinstance(args[1], torch.Tensor) and tuple(args[1].shape) == tuple(this.shape):
            raise ExpertWeightsUnavailable(
                "this PEFT version applies expert LoRA by materialising the full [experts, out, in] delta, which "
                "ktcore does not do; upgrade peft to a version with LoRA factor folding (peft >= 0.21), "
                "or activate a single adapter")
        raise ExpertWeightsUnavailable(
            f"{func} cannot read routed-expert weights: after ktcore.wrap_model/load_model they live in the CPU "
            "expert backend (use `ktcore export` for a merged standalone model)")


def make_placeholder(shape, dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(ExpertWeightPlaceholder(shape, dtype, device), requires_grad=False)


def is_placeholder(t) -> bool:
    return isinstance(t, ExpertWeightPlaceholder)


def hide_from_ddp(module: torch.nn.Module) -> list[str]:
    """Tell torch's DistributedDataParallel to leave ``module``'s placeholders alone; returns their names.

    DDP broadcasts every parameter and buffer from rank 0 when it wraps a model (frozen ones too), which would
    read the placeholders. Every rank loads the same routed-expert weights into its own backend, so there is
    nothing to broadcast; the LoRA factors on them are ordinary parameters and are all-reduced as usual. Call it
    on the module DDP will wrap (the PEFT model): DDP matches the names from that module's ``named_parameters``.
    """
    names = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if is_placeholder(t)]
    module._ddp_params_and_buffers_to_ignore = names  # read by DistributedDataParallel.__init__
    return names
