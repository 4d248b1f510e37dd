"""``ktcore convert`` of a safetensors model directory into a weight store (``ktcore.weights.store``).

Routed experts (``convert_experts``): one file per MoE layer and thread pool, ``experts-layerLLL-poolP.safetensors``.
With ``threadpools`` N each layer's intermediate dim is cut into N contiguous ranges (the first ``I % N`` one row
longer), as ``kt_tp_enabled`` splits it between thread pools, so each pool's (NUMA node's) share is one file:

* ``bf16``: ``gate``, ``up`` ``[E, I_p, H]`` and ``down`` ``[E, H, I_p]`` in bf16;
* ``int8`` (``ktcore.experts.int8``, ``int8-sym-channel-v1``): ``{gate,up}.codes`` ``[E, I_p, H]`` int8 with
  ``{gate,up}.scales`` ``[E, I_p]``, ``down.codes`` ``[E, H, I_p]`` with ``down.scales`` ``[E, H]``; the scales
  are those of the whole row, so down's are the same in every pool's file. Quantised in float32 from the weights
  as stored (bf16 converts exactly; FP8 blocks dequantised in float32 first), never from a bf16 rounding of them.

A layer's files are built in place (``ktcore.weights.staged``): the checkpoint's tensors are read straight into
the file's bytes (one bf16 file a layer) or a few experts at a time into reused buffers and quantised or split
into them; then each file is hashed while it is written. ``workers`` layers are converted at once, one of them
reading the checkpoint at a time.

Non-expert tensors (``convert_non_experts``): every tensor the model needs besides its routed experts, under the
model's names, in bf16 (FP8 weights dequantised with their block scales, which are not kept), one file per
decoder layer (``non-expert-layerLLL.safetensors``) and one for the rest (``non-expert-rest.safetensors``).

A conversion killed at any point resumes where it stopped (``StoreWriter``); it reads only the source
checkpoint, and the store is read without it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import CheckpointError
from ..experts import ExpertWeights
from ..model.wrap import expert_modules, find_arch
from ..specs import import_object
from .buffers import reused
from ..experts.int8 import Int8Experts, quantize_into
from .safetensors_reader import (FP8_DTYPES, SafetensorsCheckpoint, SafetensorsExpertSource, SafetensorsWeights,
                                 take_fp8_block)
from .staged import StagedFile
from .store import LAYOUTS, StoreWriter, identity, model_fingerprint

FORMATS = tuple(LAYOUTS)


def pool_ranges(inter: int, threadpools: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` rows of the intermediate dim each thread pool's file holds."""
    if not 1 <= threadpools <= inter:
        raise CheckpointError(f"--threadpools {threadpools}: must be between 1 and the experts' intermediate size "
                              f"{inter}")
    base, extra = divmod(inter, threadpools)
    bounds = [0]
    for p in range(threadpools):
        bounds.append(bounds[-1] + base + (p < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def expert_file(layer: int, pool: int) -> str:
    return f"experts-layer{layer:03d}-pool{pool}.safetensors"


def pool_tensors(weights, fmt: str, start: int, end: int) -> dict[str, torch.Tensor]:
    """One thread pool's share of a layer's experts (``weights``: float ExpertWeights, or Int8Experts)."""
    if fmt == "int8":
        (gc, gs), (uc, us), (dc, ds) = weights.gate, weights.up, weights.down
        return {"gate.codes": gc[:, start:end], "gate.scales": gs[:, start:end], "up.codes": uc[:, start:end],
                "up.scales": us[:, start:end], "down.codes": dc[:, :, start:end], "down.scales": ds}
    return {"gate": weights.gate[:, start:end], "up": weights.up[:, start:end], "down": weights.down[:, :, start:end]}


def _meta_model(model_dir: Path):
    """(the model on the meta device, its ArchSpec, its FP8 block size) of a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir}: no config.json; `ktcore convert` takes a safetensors model directory "
                              "(or a .gguf file)")
    hf_config = AutoConfig.from_pretrained(model_dir)
    fp8_block = take_fp8_block(hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    arch = find_arch(model.config)
    if arch.prepare_model:
        import_object(arch.prepare_model)(model)
    return model, arch, fp8_block


CHUNK_BYTES = 256 << 20  # source weights read at once where a layer is not read straight into its file
QUANTIZE_BLOCK_BYTES = 1 << 20  # float32 rows quantised at once: the passes over them stay in cache


def layer_template(fmt: str, e: int, i: int, h: int):
    """One layer's experts as the store holds them, on the meta device: (dtype, shape) of every tensor."""
    def empty(*shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")
    if fmt == "int8":
        return Int8Experts((empty(e, i, h, dtype=torch.int8), empty(e, i, dtype=torch.float32)),
                           (empty(e, i, h, dtype=torch.int8), empty(e, i, dtype=torch.float32)),
                           (empty(e, h, i, dtype=torch.int8), empty(e, h, dtype=torch.float32)))
    return ExpertWeights(empty(e, i, h, dtype=torch.bfloat16), empty(e, i, h, dtype=torch.bfloat16),
                         empty(e, h, i, dtype=torch.bfloat16))


def staged_layer(fmt: str, e: int, inter: int, hidden: int, ranges) -> list[StagedFile]:
    """A layer's thread-pool files, empty, in this thread's reused buffers."""
    template = layer_template(fmt, e, inter, hidden)
    return [StagedFile.make({k: (v.dtype, tuple(v.shape)) for k, v in pool_tensors(template, fmt, s, t).items()},
                            {"format": "pt"}, slot=("file", pool))
            for pool, (s, t) in enumerate(ranges)]


def file_weights(staged: StagedFile, fmt: str, experts: range):
    """``experts`` of a layer stored whole in one file, as views of it (ExpertWeights, or Int8Experts)."""
    t = {k: v[experts.start:experts.stop] for k, v in staged.tensors.items()}
    if fmt == "int8":
        return Int8Experts(*((t[f"{p}.codes"], t[f"{p}.scales"]) for p in ("gate", "up", "down")))
    return ExpertWeights(t["gate"], t["up"], t["down"])


def quantize_experts(dense: ExpertWeights, into: Int8Experts) -> None:
    """``Int8Experts.quantize(dense)`` written into ``into``, a block of rows at a time."""
    for weight, (codes, scales) in ((dense.gate, into.gate), (dense.up, into.up), (dense.down, into.down)):
        rows, k = weight.shape[-2:]
        block = max(1, QUANTIZE_BLOCK_BYTES // (4 * k))
        work, magnitude = reused("work", torch.float32, (block, k)), reused("magnitude", weight.dtype, (block, k))
        for e in range(weight.shape[0]):
            for r in range(0, rows, block):
                n = min(block, rows - r)
                quantize_into(weight[e, r:r + n], codes[e, r:r + n], scales[e, r:r + n], work[:n], magnitude[:n])


def reused_int8(dense: ExpertWeights) -> Int8Experts:
    """Codes and scales for ``dense``'s shapes in this thread's reused buffers."""
    return Int8Experts(*((reused(f"{p}.codes", torch.int8, w.shape), reused(f"{p}.scales", torch.float32, w.shape[:-1]))
                         for p, w in (("gate", dense.gate), ("up", dense.up), ("down", dense.down))))


def fill_layer(source: SafetensorsExpertSource, fmt: str, files: list[StagedFile], ranges,
               reading=nullcontext()) -> None:
    """Read ``source``'s experts into its pool files' tensors, quantised on the way for int8: straight into the
    file where the layer is one bf16 file, else ``CHUNK_BYTES`` of experts at a time through reused buffers. int8
    is quantised from the weights as stored (FP8 dequantised in float32), never from a bf16 rounding of them.
    Every read of the checkpoint happens inside ``reading`` (a lock: one layer reads at a time, so the disk reads
    one stream in order while other layers quantise, hash and write)."""
    e, (inter, hidden) = source.num_experts, source.shapes["gate"]
    whole = len(files) == 1
    if fmt == "bf16" and whole:
        with reading:
            source.read_into(file_weights(files[0], fmt, range(e)))
        return
    dtype = source.dtype if fmt == "int8" else torch.bfloat16
    step = max(1, CHUNK_BYTES // (3 * inter * hidden * dtype.itemsize))
    for start in range(0, e, step):
        experts = range(start, min(start + step, e))
        n = len(experts)
        weights = ExpertWeights(reused("gate", dtype, (n, inter, hidden)), reused("up", dtype, (n, inter, hidden)),
                                reused("down", dtype, (n, hidden, inter)))
        with reading:
            source.read_into(weights, experts)
        if fmt == "int8":
            into = file_weights(files[0], fmt, experts) if whole else reused_int8(weights)
            quantize_experts(weights, into)
            if whole:
                continue
            weights = into
        for staged, (begin, end) in zip(files, ranges):  # each pool's share
            for name, t in pool_tensors(weights, fmt, begin, end).items():
                staged.tensors[name][start:start + n].copy_(t)


def is_fp8(ckpt: SafetensorsCheckpoint) -> bool:
    return any(ckpt.dtype(name) in FP8_DTYPES for name in ckpt.keys())


def default_workers() -> int:
    """Layers converted at once: one reads while the others quantise, hash and write, so a few layers in flight
    keep the disk and the cores busy (host memory: one layer's files per worker)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def convert_experts(ckpt: SafetensorsCheckpoint, arch, modules, out, fmt: str, fingerprint: str,
                    threadpools: int = 1, progress: bool = True, workers: int = 0) -> dict:
    """Write the routed experts of ``modules`` (``expert_modules``) read from ``ckpt`` into the store ``out``,
    ``workers`` layers at a time (0: ``default_workers()``)."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt}: a safetensors model converts to one of {', '.join(FORMATS)}")
    sources = [(layer, name, SafetensorsExpertSource(ckpt, arch, layer, module)) for layer, name, module in modules]
    e, (inter, hidden) = sources[0][2].num_experts, sources[0][2].shapes["gate"]
    ranges = pool_ranges(inter, threadpools)
    writer = StoreWriter(Path(out), identity("experts", fmt, fingerprint, threadpools))
    if writer.finished:
        return {"out": str(out), "format": fmt, "threadpools": threadpools, "written_layers": [],
                "kept_layers": "all: the store was already complete", "bytes_written": 0, "seconds": 0.0}
    files = {layer: [expert_file(layer, p) for p in range(threadpools)] for layer, _, _ in sources}
    writer.expect_names(f for names in files.values() for f in names)
    todo = [(layer, source) for layer, _, source in sources if not all(writer.done(f) for f in files[layer])]

    reading = threading.Lock()

    def convert_layer(layer: int, source) -> int:
        staged = staged_layer(fmt, e, inter, hidden, ranges)
        fill_layer(source, fmt, staged, ranges, reading)
        return sum(writer.write_staged(name, file) for name, file in zip(files[layer], staged)
                   if not writer.done(name))

    start, nbytes = time.perf_counter(), 0
    executor = ThreadPoolExecutor(max_workers=workers or default_workers())
    try:
        futures = [executor.submit(convert_layer, layer, source) for layer, source in todo]
        for future in tqdm(as_completed(futures), total=len(futures), desc=f"convert experts -> {fmt}",
                           unit="layer", disable=not progress):
            nbytes += future.result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)  # a failed layer stops the rest
    seconds = time.perf_counter() - start
    writer.finish({"layers": {name: {"layer": layer, "files": files[layer]} for layer, name, _ in sources},
                   "shapes": {"num_experts": e, "intermediate_size": inter, "hidden_size": hidden},
                   "pool_ranges": ranges, "source_fp8": is_fp8(ckpt)})
    return {"out": str(out), "format": fmt, "threadpools": threadpools, "written_layers": [layer for layer, _ in todo],
            "kept_layers": [layer for layer, _, _ in sources if layer not in dict(todo)], "bytes_written": nbytes,
            "seconds": round(seconds, 3), "mb_per_s": round(nbytes / max(seconds, 1e-9) / 1e6, 1)}


def non_expert_names(model, modules) -> list[str]:
    """Every parameter and persistent buffer of ``model`` outside its routed experts."""
    prefixes = tuple(name + "." for _, name, _ in modules)
    persistent = set(model.state_dict(keep_vars=True))
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in persistent]
    return [n for n in names if not n.startswith(prefixes)]


def non_expert_file(name: str) -> str:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return f"non-expert-layer{int(match.group(1)):03d}.safetensors" if match else "non-expert-rest.safetensors"


def convert_non_experts(ckpt: SafetensorsCheckpoint, arch, model, modules, out, fingerprint: str,
                        progress: bool = True) -> dict:
    """Write every non-expert tensor of ``model`` found in ``ckpt`` (bf16) into the store ``out``."""
    weights = SafetensorsWeights(ckpt, arch)
    groups: dict[str, list[str]] = {}
    for name in non_expert_names(model, modules):
        if name in weights:
            groups.setdefault(non_expert_file(name), []).append(name)
    writer = StoreWriter(Path(out), identity("non_expert", "bf16", fingerprint))
    if writer.finished:
        return {"out": str(out), "format": "bf16", "written_files": [], "bytes_written": 0, "seconds": 0.0}
    writer.expect_names(groups)
    written, nbytes, start = [], 0, time.perf_counter()
    for file, names in tqdm(sorted(groups.items()), desc="convert non-experts -> bf16", unit="file",
                            disable=not progress):
        if writer.done(file):
            continue
        tensors = {}
        for name in names:
            value = weights.get(name)
            tensors[name] = value.to(torch.bfloat16) if value.is_floating_point() else value
        nbytes += writer.write(file, tensors, {"format": "pt"})
        written.append(file)
    seconds = time.perf_counter() - start
    writer.finish({"tensors": sum(len(v) for v in groups.values()), "source_fp8": is_fp8(ckpt)})
    return {"out": str(out), "format": "bf16", "written_files": written, "bytes_written": nbytes,
            "seconds": round(seconds, 3)}


def convert_model(model_dir, out, fmt: str = "bf16", threadpools: int = 1, non_expert: bool = False,
                  progress: bool = True, workers: int = 0) -> dict:
    """``ktcore convert MODEL_DIR``: its routed experts (``fmt``, ``threadpools``, ``workers`` layers at a
    time) or, with ``non_expert``, every other tensor, into the store ``out``."""
    model_dir = Path(model_dir)
    model, arch, fp8_block = _meta_model(model_dir)
    modules = expert_modules(model, arch)
    if not modules:
        raise CheckpointError(f"{model_dir}: no routed-experts modules found; nothing to convert")
    fingerprint = model_fingerprint(model_dir)
    with SafetensorsCheckpoint(model_dir, fp8_block) as ckpt:
        if non_expert:
            return convert_non_experts(ckpt, arch, model, modules, out, fingerprint, progress)
        return convert_experts(ckpt, arch, modules, out, fmt, fingerprint, threadpools, progress, workers)
