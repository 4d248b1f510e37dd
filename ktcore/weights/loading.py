"""``load_model``: build an HF model without ever materialising its routed experts outside the backend.

The model is built on the meta device; every tensor it needs is checked against the checkpoint headers
first (fail before loading anything); non-expert weights then go to the GPU (or CPU) and routed experts are
streamed layer by layer from the checkpoint into the backend, so peak host memory stays near the packed size
plus one layer. ``fill_model`` does this for any checkpoint format that offers the tensors under the model's
names (``SafetensorsWeights``, ``GGUFWeights``); ``load_model`` opens a model directory or a ``.gguf`` file.

GGUF files: the HF config comes from the GGUF metadata (the architecture plugin's ``gguf_config``) and the
routed experts (``blk.L.ffn_{gate,up,down}_exps``; the dense MLP ``blk.L.ffn_*`` for Llama) are read layer by
layer from the mmap, or packed from it as they are by a backend that computes with GGUF blocks.

Weight stores (``ktcore convert``): ``kt_weight_path`` gives the routed experts and ``kt_non_expert_weight_path``
the rest, each validated against the model directory's config and index first (``store_sources.open_weights``).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from tqdm.auto import tqdm

from ..experts import ExpertLayer
from ..model.auto import AutoWindow
from ..model.resident import attach as attach_resident
from ..model.wrap import (HYBRID, STREAM, Resident, activation_name, finish, install_auto, install_hybrid,
                          install_layer, install_resident, install_streamed, plan_placement, prepare, stream_share,
                          streams_int8)
from .gguf_reader import GGUFFile, GGUFWeights, gguf_config
from .model_path import record_base
from .safetensors_reader import CheckpointError, SafetensorsCheckpoint, SafetensorsWeights, take_fp8_block
from .store_sources import open_weights as open_store_weights, uses_store

if TYPE_CHECKING:  # parsed at the edge (ktcore.load_model) and handed down
    from ..config import KTConfig


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


def _materialise_buffers(model, weights, device) -> None:
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, buf in list(model.named_buffers()):
        if name in weights:
            _set_tensor(model, name, weights.get(name).to(device), False)
        elif buf.is_meta:
            _set_tensor(model, name, torch.empty_like(buf, device=device), False)
            if name not in persistent:  # computed buffers (rotary inv_freq): the model fills them
                model._init_weights(model.get_submodule(name.rpartition(".")[0]))


def fill_model(model, kt: KTConfig, open_weights, *, path, dtype, device, need_backward: bool = True,
               progress: bool = True):
    """Populate a model built on the meta device: validate every tensor ``open_weights(model, arch)`` offers
    first, then non-experts onto ``device`` and routed experts layer by layer into the backend."""
    hf_config = model.config
    arch, backend, budget, modules = prepare(model, kt, need_backward)
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
    plan = plan_placement(modules, kt, backend, need_backward, model, device)
    int8 = streams_int8(kt)
    layers = {}
    for _, name, module in tqdm(modules, desc="experts -> backend", disable=not progress, unit="layer"):
        target = plan[name]
        resident = target if isinstance(target, Resident) else None  # some of its experts also on the device
        target = resident.backend if resident else target
        # a backend that computes with the checkpoint's own blocks (llamafile on GGUF) takes them as they are
        packed = target.pack_source(sources[name], act) \
            if target not in (None, STREAM, HYBRID) and not isinstance(target, AutoWindow) else None
        if packed is None:
            to_stream = target in (STREAM, HYBRID) or isinstance(target, AutoWindow)
            streamed = int8_codes(sources[name], int8) if to_stream else None
            expert_weights = None if target == STREAM and streamed is not None else sources[name].read(dtype)
            if target is None:
                install_resident(model, name, module, expert_weights, arch, dtype, device)
            elif target == STREAM:
                share = stream_share(expert_weights if streamed is None else streamed, 0, int8)
                install_streamed(model, name, module, share, arch, dtype, device)
            elif target == HYBRID:
                layers[name] = install_hybrid(model, name, module, expert_weights, arch, dtype, device, backend,
                                              budget, kt, act, streamed=streamed)
            elif isinstance(target, AutoWindow):
                layer = install_auto(model, name, module, expert_weights, arch, dtype, device, backend, budget, kt,
                                     act, target, streamed=streamed)
                if layer is not None:
                    layers[name] = layer
            else:
                packed = target.pack(expert_weights, activation=act)
        if packed is not None:
            layers[name] = ExpertLayer(target, packed, budget, kt.kt_cpu_activation, name)
            install_layer(model, name, module, layers[name], arch, dtype, device)
            if resident:
                attach_resident(module, layers[name], resident.n, kt.kt_gpu_experts_interval, name, dtype, device)
        expert_weights = None  # one layer's dense experts at a time
        if hasattr(sources[name], "done"):  # the layer is loaded: an ephemeral store deletes its files
            sources.pop(name).done()
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(f"{path}: no weights for {', '.join(leftover[:5])}; the checkpoint does not match "
                              "its config")
    finish(model, kt, arch, backend, layers)
    return model


def int8_codes(source, int8: bool):
    """With int8 experts, an int8 store's codes as they are (``read_int8``: for the stream, not
    dequantised and quantised again); None for any other source, or dense experts."""
    return source.read_int8() if int8 and hasattr(source, "read_int8") else None


def load_model(path, kt: KTConfig, *, device=None, dtype=None, need_backward: bool = True,
               progress: bool = True, hf_config=None, gguf: Optional[GGUFFile] = None):
    """Load the HF model in ``path`` (a directory saved by save_pretrained, or a ``.gguf`` file) with routed
    experts in the backend ``kt`` chooses. ``hf_config``: build from this (already adjusted) transformers
    config instead of ``path``'s config.json (a training frontend that patches the config passes it).
    ``gguf``: the ``.gguf`` file's header as the caller already parsed it (``ktcore chat``), not parsed again."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf_model(path, kt, device=device, dtype=dtype, need_backward=need_backward,
                               progress=progress, hf_config=hf_config, file=gguf)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; pass a model directory saved by save_pretrained")
    # a caller's config is copied, as from_pretrained copies it: loading sets its experts implementation and may
    # drop its quantization_config, and the caller may build another model from the same object
    hf_config = AutoConfig.from_pretrained(path) if hf_config is None else copy.deepcopy(hf_config)
    fp8_block = take_fp8_block(hf_config)  # FP8 (DeepSeek-V3) is dequantised while streaming
    dtype = _resolve_dtype(hf_config, dtype)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with ExitStack() as stack:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        if uses_store(kt):  # kt_weight_path, kt_non_expert_weight_path, kt_weight_lifecycle: ephemeral
            def open_weights(model, arch):
                return open_store_weights(path, kt, model, arch, fp8_block, stack, progress)
        else:
            ckpt = stack.enter_context(SafetensorsCheckpoint(path, fp8_block))

            def open_weights(_model, arch):
                return SafetensorsWeights(ckpt, arch)
        fill_model(model, kt, open_weights, path=path, dtype=dtype, device=device, need_backward=need_backward,
                   progress=progress)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def load_gguf_model(path, kt: KTConfig, *, device=None, dtype=None, need_backward: bool = True,
                    progress: bool = True, hf_config=None, file: Optional[GGUFFile] = None):
    """Load a ``.gguf`` file with its routed experts (or Llama MLPs) in the backend ``kt`` chooses.

    ``dtype`` defaults to float32 (GGUF tensors are F32/F16/BF16 or quantised; quantised tensors are
    dequantised, so there is no single on-disk dtype to keep). ``hf_config``: build from this config (the
    metadata's, as a frontend patched it; see ``model_path.write_metadata_dir``) instead of the metadata's own.
    ``file``: ``path`` already opened (its header parsed); the caller closes it."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if uses_store(kt):
        raise CheckpointError(f"{path}: kt_weight_path, kt_non_expert_weight_path and kt_weight_lifecycle: "
                              "ephemeral take a safetensors model directory, not a .gguf file; remove them")
    with (nullcontext(file) if file is not None else GGUFFile(path)) as file:
        kt = backend_for_blocks(kt, file, need_backward)
        hf_config = gguf_config(file) if hf_config is None else copy.deepcopy(hf_config)  # as load_model does
        dtype = _resolve_dtype(hf_config, dtype or getattr(hf_config, "dtype", None) or torch.float32)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        fill_model(model, kt, lambda m, arch: GGUFWeights(file, m, arch), path=path, dtype=dtype,
                   device=device, need_backward=need_backward, progress=progress)
    model.config.dtype = dtype
    record_base(model, path)
    return model.eval()


FLOAT_TYPES = ("F32", "F16", "BF16")


def backend_for_blocks(kt: KTConfig, file: GGUFFile, need_backward: bool) -> KTConfig:
    """``kt_backend: auto`` on a GGUF whose feed-forward weights are quantised blocks: the best backend here that
    computes those blocks as they are (``weight_format`` gguf: llamafile), not one that would dequantise them to
    bf16 at 2-4x their memory (a Q4_K DeepSeek-V3 would not fit the host it was made for). A backend named in
    kt_backend, or a kt_expert_weight_format, is the user's choice and kept."""
    from dataclasses import replace

    from ..plugins.select import resolve_backend

    if kt.kt_backend != "auto" or kt.kt_expert_weight_format != "auto":
        return kt
    if all(file.type_name(n) in FLOAT_TYPES for n in file.keys() if n.startswith("blk.") and ".ffn_" in n):
        return kt
    choice = resolve_backend("auto", weight_format="gguf", need_backward=need_backward, need_lora=need_backward)
    return replace(kt, kt_backend=choice.spec.name) if choice.spec is not None else kt


def meta_model_of(path, trust_remote_code: bool = False):
    """(transformers config, the model built from it on the meta device) of a model directory (its config.json)
    or a ``.gguf`` file (its header): what checks need of a model's names and shapes, with no weight read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        with GGUFFile(path) as file:
            hf_config = gguf_config(file)
    else:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return hf_config, AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
