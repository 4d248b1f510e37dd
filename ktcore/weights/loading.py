"""``load_model``: build an HF model without ever materialising its routed experts outside the backend.

The model is built on the meta device; every tensor it needs is checked against the checkpoint headers
first (fail before loading anything); non-expert weights then go to the GPU (or CPU) and routed experts are
streamed layer by layer from the memory-mapped files into the backend, so peak host memory stays near the
packed size plus one layer.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..experts import ExpertLayer, ExpertWeights
from .safetensors_reader import CheckpointError, SafetensorsCheckpoint
from ..model.wrap import (activation_name, canonical_weights, finish, install_layer, install_resident, plan_placement,
                   prepare)

PARTS = ("gate", "up", "down")


def _resolve_dtype(hf_config, dtype) -> torch.dtype:
    dtype = dtype or getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    return dtype


def _set_tensor(model, name: str, value: torch.Tensor, is_param: bool) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if is_param:
        old = module._parameters[leaf]
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value


def checkpoint_names(ckpt: SafetensorsCheckpoint, arch) -> dict:
    """model tensor name -> checkpoint tensor name, after the architecture's renames."""
    mapping = {}
    for key in ckpt.keys():
        name = key
        for pattern, replacement in arch.checkpoint_renames:
            name = re.sub(pattern, replacement, name)
        mapping[name] = key
    return mapping


class ExpertSource:
    """Where one layer's experts are in the checkpoint, validated against the model's shapes."""

    def __init__(self, ckpt: SafetensorsCheckpoint, arch, layer: int, module):
        self.ckpt, self.arch, self.layer = ckpt, arch, layer
        if arch.dense_mlp:
            self.num_experts = 1
            inter, hidden = module.gate_proj.weight.shape
        else:
            self.num_experts, rows, cols = module.gate_up_proj.shape
            transposed = getattr(module, "is_transposed", False)  # [E, H, 2I] instead of [E, 2I, H]
            hidden, inter = (rows, cols // 2) if transposed else (cols, rows // 2)
        self.shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}  # nn.Linear [out, in]
        self.module = module
        what = f" (routed experts of layer {layer})"
        if self._key("gate", 0) in ckpt:
            self.layout = "per_expert"
            for expert in range(self.num_experts):
                for part in PARTS:
                    ckpt.expect(self._key(part, expert), self.shapes[part], what)
        elif arch.fused_expert_keys and arch.fused_expert_keys["gate_up"].format(layer=layer) in ckpt:
            self.layout = "fused"
            ckpt.expect(self._fused("gate_up"), tuple(module.gate_up_proj.shape), what)
            ckpt.expect(self._fused("down"), tuple(module.down_proj.shape), what)
        else:
            looked = [self._key("gate", 0)] + ([self._fused("gate_up")] if arch.fused_expert_keys else [])
            raise CheckpointError(f"{ckpt.root}: no expert tensors for layer {layer} (looked for "
                                  f"{' and '.join(map(repr, looked))})")

    def _key(self, part: str, expert: int) -> str:
        return self.arch.expert_keys[part].format(layer=self.layer, expert=expert)

    def _fused(self, part: str) -> str:
        return self.arch.fused_expert_keys[part].format(layer=self.layer)

    def read(self, dtype) -> ExpertWeights:
        if self.layout == "fused":
            return canonical_weights(self.module, self.ckpt.get(self._fused("gate_up")).to(dtype),
                                     self.ckpt.get(self._fused("down")).to(dtype))
        out = {p: torch.empty((self.num_experts, *self.shapes[p]), dtype=dtype) for p in PARTS}
        for expert in range(self.num_experts):
            for part in PARTS:
                out[part][expert].copy_(self.ckpt.get(self._key(part, expert)))
        return ExpertWeights(out["gate"], out["up"], out["down"])


class SafetensorsWeights:
    """The tensors of a safetensors checkpoint under the model's names (after the architecture's renames)."""

    def __init__(self, ckpt: SafetensorsCheckpoint, arch):
        self.ckpt, self.arch = ckpt, arch
        self.names = checkpoint_names(ckpt, arch)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def describe(self, name: str) -> str:
        return ""

    def expect(self, name: str, shape: tuple) -> None:
        self.ckpt.expect(self.names[name], shape)

    def get(self, name: str) -> torch.Tensor:
        return self.ckpt.get(self.names[name])

    def experts(self, layer: int, module) -> ExpertSource:
        return ExpertSource(self.ckpt, self.arch, layer, module)


def _materialise_buffers(model, weights, device) -> None:
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, buf in list(model.named_buffers()):
        if name in weights:
            _set_tensor(model, name, weights.get(name).to(device), False)
        elif buf.is_meta:
            _set_tensor(model, name, torch.empty_like(buf, device=device), False)
            if name not in persistent:  # computed buffers (rotary inv_freq): the model fills them
                model._init_weights(model.get_submodule(name.rpartition(".")[0]))


def fill_model(model, config, open_weights, *, path, dtype, device, need_backward: bool = True,
               progress: bool = True):
    """Populate a model built on the meta device: validate every tensor ``open_weights(model, arch)`` offers
    first, then non-experts onto ``device`` and routed experts layer by layer into the backend."""
    hf_config = model.config
    kt, arch, backend, budget, modules = prepare(model, config, need_backward)
    act = activation_name(model.config)
    expert_prefixes = tuple(name + "." for _, name, _ in modules)
    weights = open_weights(model, arch)

    # 1. validate everything against the headers before loading a byte
    params = [(n, p) for n, p in model.named_parameters() if not n.startswith(expert_prefixes)]
    tied = set(getattr(model, "_tied_weights_keys", None) or {}) \
        if hf_config.get_text_config().tie_word_embeddings else set()
    for name, p in params:
        if name in weights:
            weights.expect(name, tuple(p.shape))
        elif name not in tied:
            raise CheckpointError(f"{path}: tensor {name!r}{weights.describe(name)} is missing from the checkpoint")
    sources = {name: weights.experts(layer, module) for layer, name, module in modules}

    # 2. non-expert weights onto the device
    for name, p in params:
        if name in weights:
            value = weights.get(name).reshape(p.shape)
            _set_tensor(model, name, value.to(device, dtype if value.is_floating_point() else value.dtype), True)
    _materialise_buffers(model, weights, device)
    if tied:
        model.tie_weights()

    # 3. routed experts, one layer at a time, straight into the backend (or onto the device, kt_placement)
    plan = plan_placement(modules, kt, backend, need_backward)
    layers = {}
    for _, name, module in tqdm(modules, desc="experts -> backend", disable=not progress, unit="layer"):
        target = plan[name]
        # a backend that computes with the checkpoint's own blocks (llamafile on GGUF) takes them as they are
        packed = target.pack_source(sources[name], act) if hasattr(target, "pack_source") else None
        if packed is None:
            expert_weights = sources[name].read(dtype)
            if target is None:
                install_resident(model, name, module, expert_weights, arch, dtype, device)
                continue
            packed = target.pack(expert_weights, activation=act)
            del expert_weights
        layers[name] = ExpertLayer(plan[name], packed, budget, kt.kt_cpu_activation, name)
        install_layer(model, name, module, layers[name], arch, dtype, device)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{path}: no weights for {', '.join(leftover[:5])}; the checkpoint does not match "
                              "its config")
    finish(model, kt, arch, backend, layers)
    return model


def load_model(path, config=None, *, device=None, dtype=None, need_backward: bool = True,
               progress: bool = True, hf_config=None):
    """Load the HF model in ``path`` (a directory saved by save_pretrained, or a ``.gguf`` file) with routed
    experts in the backend chosen by ``config``. ``hf_config``: build from this (already adjusted) transformers
    config instead of ``path``'s config.json (a training frontend that patches the config passes it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from .gguf_loading import load_gguf_model

        return load_gguf_model(path, config, device=device, dtype=dtype, need_backward=need_backward,
                               progress=progress)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a model directory saved by save_pretrained")
    hf_config = AutoConfig.from_pretrained(path) if hf_config is None else hf_config
    fp8_block = (128, 128)
    quant = getattr(hf_config, "quantization_config", None)
    if quant:  # FP8 block-scaled checkpoints (DeepSeek-V3) are dequantised while streaming
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        fp8_block = tuple(quant.get("weight_block_size") or fp8_block)
        del hf_config.quantization_config
    dtype = _resolve_dtype(hf_config, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with SafetensorsCheckpoint(path, fp8_block) as ckpt:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        fill_model(model, config, lambda _model, arch: SafetensorsWeights(ckpt, arch), path=path, dtype=dtype,
                   device=device, need_backward=need_backward, progress=progress)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
