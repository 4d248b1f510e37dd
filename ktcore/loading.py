"""``load_model``: build an HF model without ever materialising its routed experts outside the backend.

The model is built on the meta device; every tensor it needs is checked against the checkpoint headers
first (fail before loading anything); non-expert weights then go to the GPU (or CPU) and routed experts are
streamed layer by layer from the memory-mapped files into the backend, so peak host memory stays near the
packed size plus one layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from .experts import ExpertLayer, ExpertWeights
from .weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from .wrap import activation_name, canonical_weights, finish, install_layer, prepare


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


def _expert_layout(ckpt: SafetensorsCheckpoint, arch, layer: int) -> str:
    per_expert = arch.expert_keys.get("gate", "").format(layer=layer, expert=0)
    fused = arch.fused_expert_keys.get("gate_up", "").format(layer=layer)
    if per_expert and per_expert in ckpt:
        return "per_expert"
    if fused and fused in ckpt:
        return "fused"
    raise CheckpointError(f"{ckpt.root}: no routed-expert tensors for layer {layer} (looked for {per_expert!r} "
                          f"and {fused!r})")


def _plan_experts(ckpt, arch, layer: int, module) -> str:
    """Check every expert tensor of one layer; returns its on-disk layout."""
    num_experts, rows, cols = module.gate_up_proj.shape
    if getattr(module, "is_transposed", False):  # [E, H, 2I]
        hidden, inter = rows, cols // 2
    else:  # [E, 2I, H]
        hidden, inter = cols, rows // 2
    layout = _expert_layout(ckpt, arch, layer)
    what = f" (routed experts of layer {layer})"
    if layout == "per_expert":
        for expert in range(num_experts):  # nn.Linear layout: [out, in]
            for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
                ckpt.expect(arch.expert_keys[part].format(layer=layer, expert=expert), shape, what)
    else:
        ckpt.expect(arch.fused_expert_keys["gate_up"].format(layer=layer), tuple(module.gate_up_proj.shape), what)
        ckpt.expect(arch.fused_expert_keys["down"].format(layer=layer), tuple(module.down_proj.shape), what)
    return layout


def _read_experts(ckpt, arch, layer: int, module, layout: str, dtype) -> ExpertWeights:
    if layout == "fused":
        gate_up = ckpt.get(arch.fused_expert_keys["gate_up"].format(layer=layer)).to(dtype)
        down = ckpt.get(arch.fused_expert_keys["down"].format(layer=layer)).to(dtype)
        return canonical_weights(module, gate_up, down)
    num_experts = module.gate_up_proj.shape[0]
    first = {p: ckpt.shape(arch.expert_keys[p].format(layer=layer, expert=0)) for p in ("gate", "up", "down")}
    out = {p: torch.empty((num_experts, *shape), dtype=dtype) for p, shape in first.items()}
    for expert in range(num_experts):
        for part, dest in out.items():
            dest[expert].copy_(ckpt.get(arch.expert_keys[part].format(layer=layer, expert=expert)))
    return ExpertWeights(out["gate"], out["up"], out["down"])


def load_model(path, config=None, *, device=None, dtype=None, need_backward: bool = True,
               progress: bool = True):
    """Load the HF model in ``path`` with routed experts in the backend chosen by ``config``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a model directory saved by save_pretrained")
    hf_config = AutoConfig.from_pretrained(path)
    dtype = _resolve_dtype(hf_config, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with SafetensorsCheckpoint(path) as ckpt:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        kt, arch, backend, budget, modules = prepare(model, config, need_backward)
        act = activation_name(model.config)
        expert_prefixes = tuple(name + "." for _, name, _ in modules)

        # 1. validate everything against the headers before loading a byte
        params = [(n, p) for n, p in model.named_parameters() if not n.startswith(expert_prefixes)]
        tied = set((getattr(model, "_tied_weights_keys", None) or {}) if hf_config.get_text_config().tie_word_embeddings
                   else {})
        for name, p in params:
            if name in tied and name not in ckpt:
                continue
            ckpt.expect(name, tuple(p.shape))
        layouts = {name: _plan_experts(ckpt, arch, layer, module) for layer, name, module in modules}

        # 2. non-expert weights onto the device
        for name, p in params:
            if name in ckpt:
                value = ckpt.get(name)
                _set_tensor(model, name, value.to(device, dtype if value.is_floating_point() else value.dtype), True)
        persistent = set(model.state_dict(keep_vars=True).keys())
        for name, buf in list(model.named_buffers()):
            if name in ckpt:
                _set_tensor(model, name, ckpt.get(name).to(device), False)
            elif buf.is_meta:
                _set_tensor(model, name, torch.empty_like(buf, device=device), False)
                if name not in persistent:  # computed buffers (rotary inv_freq): let the model fill them
                    model._init_weights(model.get_submodule(name.rpartition(".")[0]))
        if tied:
            model.tie_weights()

        # 3. routed experts, one layer at a time, straight into the backend
        layers = {}
        for layer, name, module in tqdm(modules, desc="experts -> backend", disable=not progress, unit="layer"):
            weights = _read_experts(ckpt, arch, layer, module, layouts[name], dtype)
            packed = backend.pack(weights, activation=act)
            del weights
            layers[name] = ExpertLayer(backend, packed, budget, kt.kt_cpu_activation, name)
            install_layer(module, layers[name], dtype, device)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{path}: no weights for {', '.join(leftover[:5])}; the checkpoint does not match "
                              "config.json")
    finish(model, kt, arch, backend, layers)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
