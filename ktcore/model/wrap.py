"""transformers integration: ktcore's experts implementation and ``wrap_model``.

transformers 5 dispatches every MoE experts module's forward through its ``ExpertsInterface`` keyed by
``config._experts_implementation``. ktcore registers ``"ktcore"`` there, so HF's router, shared experts and
attention run unchanged and only the routed-expert math reaches the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..experts import ActivationBudget, ExpertLayer, ExpertWeights
from ..experts.int8 import Int8Experts
from ..plugins.threads import apply_budget
from ..specs import ArchSpec, import_object
from . import host_lora, peft_expert_lora
from .arch import expert_modules, experts_pattern, find_arch
from .dense_mlp import PROJECTIONS, OffloadedMLP, dense_weights
from .device_experts import GPU_EXPERTS_IMPLEMENTATION
from .auto import AutoLayer, AutoPoint, AutoWindow, auto_forward, make_auto
from .hybrid import HybridPoint, cpu_experts, hybrid_forward
from .overlap import install_overlap
from .peft_expert_lora import expert_lora_of
from .placement import num_gpu_experts, parse_rules, place
from .placeholder import is_placeholder, make_placeholder
from .resident import attach as attach_resident, check_count, check_unpack, resident_forward
from .stream import ExpertStream, host_layout, streamed_forward

if TYPE_CHECKING:  # the config module sits above this one: it is parsed at the edge and handed down
    from ..config import KTConfig

EXPERTS_IMPLEMENTATION = "ktcore"

_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}


def ktcore_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts forward transformers calls for ``experts_implementation="ktcore"``."""
    auto = self.__dict__.get("_ktcore_auto")
    if auto is not None:  # auto: this call's split of the experts between the CPU and the stream
        return auto_forward(self, *auto, hidden_states, top_k_index, top_k_weights)
    layer: Optional[ExpertLayer] = self.__dict__.get("_ktcore_layer")
    streamed = self.__dict__.get("_ktcore_stream")
    if streamed is not None and layer is not None:  # hybrid: the first experts on the CPU, the others streamed
        return hybrid_forward(self, layer, self.__dict__["_ktcore_cpu_experts"], *streamed, hidden_states,
                              top_k_index, top_k_weights)
    if streamed is not None:  # gpu_stream: host experts copied to the model's device for this call
        return streamed_forward(self, *streamed, hidden_states, top_k_index, top_k_weights, expert_lora_of(self))
    resident = self.__dict__.get("_ktcore_resident")
    if resident is not None:  # cpu, with kt_num_gpu_experts of them resident on the model's device
        return resident_forward(self, layer, resident, hidden_states, top_k_index, top_k_weights)
    if layer is None:
        if is_placeholder(self.gate_up_proj):
            raise RuntimeError(f"{type(self).__name__}: experts were never moved into a backend; build the model "
                               "with ktcore.load_model or ktcore.wrap_model")
        # a layer placed on the GPU (kt_placement): its real weights run through transformers' own kernels
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[GPU_EXPERTS_IMPLEMENTATION](self, hidden_states, top_k_index, top_k_weights)
    return layer(hidden_states, top_k_index, top_k_weights, expert_lora_of(self))


def register_experts_implementation() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, ktcore_experts_forward)


@dataclass
class WrapInfo:
    """What ktcore did to a model (``model.ktcore``)."""

    arch: ArchSpec
    backend: object  # the default backend (kt_backend)
    config: KTConfig
    layers: dict  # experts module name -> ExpertLayer (layers on a CPU backend)
    on_gpu: tuple = ()  # experts module names kept on the model's device by kt_placement
    stream: Optional[ExpertStream] = None  # the experts placed gpu_stream or hybrid (stream.host), in model order
    streamed: tuple = ()  # experts module names with (some of) their experts in the stream
    auto: Optional[object] = None  # the AutoPlacement of the auto (and re-balanced hybrid) layers
    resident: Optional[dict] = None  # experts module name -> ResidentExperts (kt_num_gpu_experts), in model order

    @property
    def packed_bytes(self) -> int:
        return sum(getattr(layer.packed, "nbytes", 0) for layer in self.layers.values())


def activation_name(hf_config) -> str:
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} has no ktcore expert kernel; supported: {', '.join(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[act]


def check_experts_module(module, name: str, arch: ArchSpec) -> None:
    if arch.dense_mlp:
        if any(getattr(module, p).bias is not None for p in PROJECTIONS):
            raise ValueError(f"{name}: MLPs with bias (mlp_bias=True) are not supported by ktcore yet")
        return
    for flag, ok in (("has_bias", False), ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(module, flag, ok) != ok:
            raise ValueError(f"{name}: experts with {flag}={not ok} are not supported by ktcore yet")


def is_wrapped(module) -> bool:
    return isinstance(module, OffloadedMLP) or is_placeholder(getattr(module, "gate_up_proj", None))


def module_weights(module, arch: ArchSpec) -> ExpertWeights:
    if arch.dense_mlp:
        return dense_weights(module)
    return canonical_weights(module, module.gate_up_proj.detach(), module.down_proj.detach())


def weight_dtype_device(module, arch: ArchSpec):
    ref = module.gate_proj.weight if arch.dense_mlp else module.gate_up_proj
    return ref.dtype, ref.device


def canonical_weights(module, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
    """HF experts tensors -> ExpertWeights (gate/up [E, I, H], down [E, H, I])."""
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if not getattr(module, "is_concatenated", True):
        return ExpertWeights(gate_up[:, 0::2], gate_up[:, 1::2], down)
    return ExpertWeights.from_fused(gate_up, down)


def install_layer(model, name: str, module, layer: ExpertLayer, arch: ArchSpec, dtype, device) -> None:
    """Hand the experts to the backend: placeholders (and the layer) in the module, or an OffloadedMLP."""
    if arch.dense_mlp:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, OffloadedMLP(module, layer, dtype, device))
        return
    module.gate_up_proj = make_placeholder(module.gate_up_proj.shape, dtype, device)
    module.down_proj = make_placeholder(module.down_proj.shape, dtype, device)
    module.__dict__["_ktcore_layer"] = layer  # plain attribute: not a submodule, not in state_dict


def prepare(model, kt: KTConfig, need_backward: bool = True):
    """Common set-up of wrap_model and load_model: (arch, backend, budget, experts modules)."""
    from ..plugins.select import get_backend

    if hasattr(model, "peft_config"):
        raise ValueError("wrap the base model with ktcore before PEFT (get_peft_model / PeftModel.from_pretrained)")
    arch = find_arch(model.config)
    if arch.prepare_model:
        import_object(arch.prepare_model)(model)
    modules = expert_modules(model, arch)
    if not modules:
        raise ValueError(f"found no routed-experts modules matching {arch.experts_module!r} in this "
                         f"{type(model).__name__}")
    for _, name, module in modules:
        check_experts_module(module, name, arch)
    check_resident(modules, kt, need_backward)
    if kt.kt_rates:  # read now: a bad file is one line before any weight
        from .cost import load_rates

        load_rates(kt.kt_rates)
    backend = get_backend(kt.kt_backend, kt, need_backward=need_backward, need_lora=need_backward)
    return arch, backend, ActivationBudget(kt.kt_max_cache_depth), modules


def check_resident(modules, kt: KTConfig, need_backward: bool = True) -> None:
    """Every layer's kt_num_gpu_experts (or its rule's num_gpu_experts) is below its expert count, and its backend
    can unpack experts for the device (the combinations are checked with the config); ``modules`` may be on the
    meta device."""
    from ..plugins.select import backend_class

    rules = parse_rules(kt.kt_placement, "kt_config")
    for _, name, module in modules:
        rule = place(name, rules, kt.kt_backend, kt.kt_expert_placement)
        n = num_gpu_experts(rule, kt.kt_num_gpu_experts)
        if n:
            check_count(n, getattr(module, "num_experts", 1), name)
            cls = backend_class(rule.backend, kt, need_backward=need_backward, need_lora=need_backward)
            check_unpack(cls, rule.backend, name)


@dataclass(frozen=True)
class Resident:
    """plan_placement's value for a layer on a CPU ``backend`` keeping ``n`` experts resident on the model's
    device (``model/resident.py``)."""

    backend: object
    n: int


STREAM = "gpu_stream"  # plan_placement's value for a layer streamed to the model's device
HYBRID = "hybrid"  # ... for a layer split between the default backend and the stream at kt_hybrid_cpu_share


def plan_placement(modules, kt: KTConfig, default_backend, need_backward: bool = True, model=None,
                   device=None) -> dict:
    """experts module name -> the backend computing it (a Resident of it with kt_num_gpu_experts), None for a layer
    kept on the model's device, STREAM, HYBRID, or an AutoWindow for an auto layer and a hybrid one without
    kt_hybrid_cpu_share (re-balanced); ``model`` (on any device, meta included) and the ``device`` it will
    compute on are needed for those."""
    from ..plugins.select import get_backend

    rules = parse_rules(kt.kt_placement, "kt_config")
    backends = {kt.kt_backend: default_backend}
    plan, windows, auto = {}, {}, None
    for _, name, _ in modules:
        rule = place(name, rules, kt.kt_backend, kt.kt_expert_placement)
        if rule.device == "auto" or (rule.device == "hybrid" and kt.kt_hybrid_cpu_share is None):
            if rule.device not in windows:  # one AutoPlacement per model: its rates are measured once
                auto = auto or make_auto(model, kt, default_backend, device)
                experts = auto.shape.experts
                windows[rule.device] = auto.window(0, experts, "kt_expert_placement auto") if rule.device == "auto" \
                    else auto.window(1, experts - 1, "hybrid without kt_hybrid_cpu_share")
            plan[name] = windows[rule.device]
            continue
        if rule.device != "cpu":
            plan[name] = {"gpu": None, "gpu_stream": STREAM, "hybrid": HYBRID}[rule.device]
            continue
        if rule.backend not in backends:
            backends[rule.backend] = get_backend(rule.backend, kt, need_backward=need_backward,
                                                 need_lora=need_backward)
        n = num_gpu_experts(rule, kt.kt_num_gpu_experts)
        plan[name] = Resident(backends[rule.backend], n) if n else backends[rule.backend]
    return plan


def install_resident(model, name: str, module, weights: ExpertWeights, arch: ArchSpec, dtype, device) -> None:
    """Give a layer placed on the GPU its real weights (transformers' own module computes it)."""
    if arch.dense_mlp:
        for part, value in zip(PROJECTIONS, (weights.gate, weights.up, weights.down)):
            getattr(module, part).weight = torch.nn.Parameter(value[0].to(device, dtype), requires_grad=False)
        return
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"{name}: GPU placement of transposed or interleaved experts is not supported yet")
    gate_up = torch.cat([weights.gate, weights.up], dim=1)
    module.gate_up_proj = torch.nn.Parameter(gate_up.to(device, dtype), requires_grad=False)
    module.down_proj = torch.nn.Parameter(weights.down.to(device, dtype), requires_grad=False)


def streams_int8(kt: KTConfig) -> bool:
    """Whether streamed experts are kept and copied as int8 codes: when the experts are int8 (kt_expert_weight_format
    int8, or kt_backend amx_int8), so the GPU computes with the weights the CPU does (the two sides of a hybrid or
    auto layer agree) from half the host memory and half the copies."""
    from ..plugins.select import experts_format

    return experts_format(kt) == "int8"


def stream_share(weights, lo: int, int8: bool):
    """Experts ``lo..`` of a layer as the stream keeps them: ``weights`` (``ExpertWeights``, or ``Int8Experts`` that
    an int8 store holds) sliced, and quantised when ``int8`` (``ktcore.experts.int8``)."""
    if isinstance(weights, Int8Experts):
        return Int8Experts(*((codes[lo:], scales[lo:]) for codes, scales in (weights.gate, weights.up, weights.down)))
    share = ExpertWeights(weights.gate[lo:], weights.up[lo:], weights.down[lo:])
    return Int8Experts.quantize(share) if int8 else share


def install_streamed(model, name: str, module, weights, arch: ArchSpec, dtype, device, base: int = 0) -> None:
    """Keep a gpu_stream layer's experts (a hybrid layer's GPU share: experts ``base..``; ``stream_share``'s) in
    host memory in HF's layout, dense in ``dtype`` or int8 codes and scales (``finish`` hands them to the stream);
    the module gets placeholders of its whole shape, so PEFT's expert LoRA folds onto it as on a CPU-backend layer."""
    if arch.dense_mlp or getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        raise ValueError(f"{name}: gpu_stream placement of dense MLPs or transposed / interleaved experts is not "
                         "supported yet")
    gate_up, down = host_layout(weights, dtype)
    module.gate_up_proj = make_placeholder(module.gate_up_proj.shape, dtype, device)
    module.down_proj = make_placeholder(module.down_proj.shape, dtype, device)
    module.__dict__["_ktcore_host_experts"] = (gate_up, down, base, dtype)


def install_hybrid(model, name: str, module, weights: ExpertWeights, arch: ArchSpec, dtype, device, backend,
                   budget, kt, act: str, n: Optional[int] = None, streamed=None):
    """Split a hybrid layer: the first ``n`` experts (kt_hybrid_cpu_share's) packed into ``backend``, the others
    kept for the stream (from ``streamed`` when given: an int8 store's own codes)."""
    n = cpu_experts(kt.kt_hybrid_cpu_share, weights.gate.shape[0], name) if n is None else n
    cpu = ExpertWeights(weights.gate[:n], weights.up[:n], weights.down[:n])
    layer = ExpertLayer(backend, backend.pack(cpu, activation=act), budget, kt.kt_cpu_activation, name)
    layer.overlap = HybridPoint()
    share = stream_share(weights if streamed is None else streamed, n, streams_int8(kt))
    install_streamed(model, name, module, share, arch, dtype, device, base=n)
    module.__dict__.update(_ktcore_layer=layer, _ktcore_cpu_experts=n)
    return layer


def install_auto(model, name: str, module, weights: ExpertWeights, arch: ArchSpec, dtype, device, backend,
                 budget, kt, act: str, window: AutoWindow, streamed=None):
    """An auto layer: experts ``..hi`` packed into ``backend``, experts ``lo..`` kept for the stream (from
    ``streamed`` when given), so a call can put any ``lo..hi`` of them on the CPU (``model/auto.py``). A window of
    one split is a fixed placement."""
    experts, lo, hi = weights.gate.shape[0], window.lo, window.hi
    host, int8 = weights if streamed is None else streamed, streams_int8(kt)
    if lo == hi == experts:
        return install_cpu(model, name, module, weights, arch, dtype, device, backend, budget, kt, act)
    if lo == hi == 0:
        return install_streamed(model, name, module, stream_share(host, 0, int8), arch, dtype, device)
    if lo == hi:
        return install_hybrid(model, name, module, weights, arch, dtype, device, backend, budget, kt, act, n=lo,
                              streamed=streamed)
    packed = backend.pack(ExpertWeights(weights.gate[:hi], weights.up[:hi], weights.down[:hi]), activation=act)
    layer = ExpertLayer(backend, packed, budget, kt.kt_cpu_activation, name)
    install_streamed(model, name, module, stream_share(host, lo, int8), arch, dtype, device, base=lo)
    module.__dict__.update(_ktcore_layer=layer, _ktcore_window=window)
    return layer


def install_cpu(model, name: str, module, weights: ExpertWeights, arch: ArchSpec, dtype, device, backend, budget,
                kt, act: str):
    resident = backend if isinstance(backend, Resident) else None
    backend = backend.backend if resident else backend
    layer = ExpertLayer(backend, backend.pack(weights, activation=act), budget, kt.kt_cpu_activation, name)
    install_layer(model, name, module, layer, arch, dtype, device)
    if resident:
        attach_resident(module, layer, resident.n, kt.kt_gpu_experts_interval, name, dtype, device)
    return layer


def _build_stream(model, kt, arch) -> Optional[ExpertStream]:
    streamed = [m for _, _, m in expert_modules(model, arch) if "_ktcore_host_experts" in m.__dict__]
    if not streamed:
        return None
    stream = ExpertStream(model.device, kt.kt_stream_ring, recompute=kt.kt_stream_activation == "recompute")
    for module in streamed:
        module.__dict__["_ktcore_stream"] = (stream, stream.add(*module.__dict__.pop("_ktcore_host_experts")))
    return stream


def _build_auto(model, arch, stream, layers: dict):
    """The AutoPlacement of the model's auto layers, each given its state and its overlap point (the cpu
    placement's where the block has shared experts after the routed ones)."""
    found = [(name, m) for _, name, m in expert_modules(model, arch) if "_ktcore_window" in m.__dict__]
    if not found:
        return None
    auto = found[0][1].__dict__["_ktcore_window"].auto
    auto.attach(stream)
    pattern = experts_pattern(arch)
    install_overlap(model, arch, {name: layers[name] for name, _ in found}, lambda n: int(pattern.search(n).group(1)))
    for name, module in found:
        window, (_, index) = module.__dict__.pop("_ktcore_window"), module.__dict__.pop("_ktcore_stream")
        layer = layers[name]
        layer.overlap = AutoPoint(layer.overlap)
        state = AutoLayer(name, index, module.num_experts, window.lo, window.hi, layer)
        auto.add(state)
        module.__dict__["_ktcore_auto"] = (auto, state)
    return auto


def finish(model, kt, arch, backend, layers) -> None:
    if not arch.dense_mlp:  # dense MLPs were replaced by OffloadedMLP; MoE experts dispatch through HF
        register_experts_implementation()
        try:
            model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        except ValueError:
            # transformers before ~5.2x (5.6 seen) validate the name against its built-in list, although the
            # dispatch (ExpertsInterface.get_interface) serves any registered implementation: set it directly
            for module in model.modules():
                config = getattr(module, "config", None)
                if hasattr(config, "_experts_implementation_internal"):
                    config._experts_implementation_internal = EXPERTS_IMPLEMENTATION
    stream = _build_stream(model, kt, arch)
    auto = _build_auto(model, arch, stream, layers)
    streamed = tuple(name for _, name, m in expert_modules(model, arch)
                     if "_ktcore_stream" in m.__dict__ or "_ktcore_auto" in m.__dict__)
    resident = {name: m.__dict__["_ktcore_resident"] for _, name, m in expert_modules(model, arch)
                if "_ktcore_resident" in m.__dict__}
    on_gpu = tuple(name for _, name, _ in expert_modules(model, arch) if name not in layers and name not in streamed)
    pattern = experts_pattern(arch)
    whole = {name: layer for name, layer in layers.items() if layer.overlap is None}
    install_overlap(model, arch, whole, lambda name: int(pattern.search(name).group(1)))
    peft_expert_lora.install(model, whole)  # their expert LoRA reaches the backend uncast
    if kt.kt_expert_lora_device == host_lora.HOST:
        host_lora.install(model, whole)
    apply_budget([layer.backend for layer in layers.values()], model.device)
    model.__dict__["ktcore"] = WrapInfo(arch, backend, kt, layers, on_gpu, stream, streamed, auto, resident)


def wrap_model(model, kt: KTConfig, need_backward: bool = True):
    """Move the routed experts of a loaded HF model into the CPU backend, in place; returns the model."""
    arch, backend, budget, modules = prepare(model, kt, need_backward)
    act = activation_name(model.config)
    plan = plan_placement(modules, kt, backend, need_backward, model, model.device)
    layers = {}
    for _, name, module in modules:
        if is_wrapped(module):
            raise ValueError(f"{name} is already wrapped by ktcore")
        if plan[name] is None:
            continue  # kt_placement keeps this layer as it is, on the model's device
        dtype, device = weight_dtype_device(module, arch)
        if plan[name] == STREAM:
            share = stream_share(module_weights(module, arch), 0, streams_int8(kt))
            install_streamed(model, name, module, share, arch, dtype, device)
            continue
        if plan[name] == HYBRID:
            layers[name] = install_hybrid(model, name, module, module_weights(module, arch), arch, dtype, device,
                                          backend, budget, kt, act)
            continue
        if isinstance(plan[name], AutoWindow):
            layer = install_auto(model, name, module, module_weights(module, arch), arch, dtype, device, backend,
                                 budget, kt, act, plan[name])
            if layer is not None:
                layers[name] = layer
            continue
        layers[name] = install_cpu(model, name, module, module_weights(module, arch), arch, dtype, device, plan[name],
                                   budget, kt, act)
    finish(model, kt, arch, backend, layers)
    return model
