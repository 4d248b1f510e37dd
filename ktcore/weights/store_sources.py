"""What ``load_model`` reads from weight stores (``ktcore.weights.store``): ``kt_weight_path`` (routed experts),
``kt_non_expert_weight_path`` (everything else) and ``kt_config.kt_weight_lifecycle: ephemeral`` (experts
converted into a scratch store, each layer's files deleted once it is in the backend).

``open_weights`` gives ``fill_model`` the tensors under the model's names from the non-expert store or the
checkpoint, and each layer's experts from the expert store or the checkpoint. Both stores are validated against
the model (``open_store``) when they are opened, before ``fill_model`` loads a byte; the checkpoint's shards are
opened only when something is read from them (with both stores, only its config.json and index are read).
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch

from ..experts import ExpertWeights
from .convert import convert_experts, layer_template, non_expert_names, pool_tensors
from ..experts.int8 import Int8Experts
from .safetensors_reader import DTYPES, FP8_DTYPES, SafetensorsCheckpoint, SafetensorsWeights, expert_dims
from .scratch import scratch_dir
from .store import Store, StoreError, open_store, model_fingerprint

SCALE_NAME = re.compile(r"(_scale_inv|weight_scale|input_scale)$")


class StoreExpertSource:
    """One layer's experts in a store, checked against the model's shapes when made; ``read(dtype)``: the dense
    weights (dequantised from int8); ``done()``: the layer is in the backend (an ephemeral store deletes it)."""

    def __init__(self, store: Store, name: str, arch, module, *, mapped: bool = True, delete_when_done: bool = False):
        self.store, self.mapped, self.delete_when_done = store, mapped, delete_when_done
        entry = store.manifest.get("layers", {}).get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), list):
            raise StoreError(f"{store.root}: no experts of {name} in its manifest; the store is of another model")
        self.files = entry["files"]
        e, i, h = expert_dims(arch, module)
        ranges = store.manifest.get("pool_ranges") or []
        template = layer_template(store.format, e, i, h)
        if len(ranges) != len(self.files) or ranges[-1][1] != i:
            raise StoreError(f"{store.root}: {name} is split into {ranges} in {len(self.files)} files, the model's "
                             f"intermediate size is {i}; the store is of another model")
        for file, (start, end) in zip(self.files, ranges):
            want = {k: (v.dtype, tuple(v.shape)) for k, v in pool_tensors(template, store.format, start, end).items()}
            header, _ = store.headers[file]
            got = {k: (DTYPES[meta["dtype"]], tuple(meta["shape"])) for k, meta in header.items()}
            if got != want:
                raise StoreError(f"{store.root / file}: holds {got}, {name} needs {want}; the store is of another "
                                 "model, convert it again")

    def _pools(self) -> list[dict]:
        return [self.store.read(f, mapped=self.mapped) for f in self.files]

    def read(self, dtype) -> ExpertWeights:
        pools = self._pools()
        return ExpertWeights(*(_join(pools, key, dim).to(dtype) for key, dim in (("gate", 1), ("up", 1), ("down", 2))))

    def done(self) -> None:
        if self.delete_when_done:
            for file in self.files:
                self.store.delete(file)


class Int8StoreExpertSource(StoreExpertSource):
    """An int8 store's layer: also offers ``read_int8`` (what an int8 backend's ``pack_source`` takes); every
    other backend gets ``read(dtype)``, the dequantised weights."""

    def read_int8(self) -> Int8Experts:
        pools = self._pools()
        return Int8Experts((_join(pools, "gate.codes", 1), _join(pools, "gate.scales", 1)),
                           (_join(pools, "up.codes", 1), _join(pools, "up.scales", 1)),
                           (_join(pools, "down.codes", 2), pools[0]["down.scales"]))  # whole-row scales

    def read(self, dtype) -> ExpertWeights:
        return self.read_int8().dequantize(dtype)


def _join(pools: list[dict], key: str, dim: int) -> torch.Tensor:
    """One tensor of a layer from its thread pools' files (the file's own view when there is one pool)."""
    return pools[0][key] if len(pools) == 1 else torch.cat([p[key] for p in pools], dim)


class NonExpertStoreWeights:
    """The non-expert store's tensors under the model's names, refusing what it must not hold (routed-expert
    tensors, FP8 weights or their scales, names the model does not have)."""

    def __init__(self, store: Store, model, modules):
        self.store = store
        expected = set(non_expert_names(model, modules))
        self.index, self._read = {}, {}
        for file, (header, _) in sorted(store.headers.items()):
            for name, meta in header.items():
                what = None
                if name.startswith(tuple(n + "." for _, n, _ in modules)) or ".experts." in name:
                    what = "a routed-expert tensor (experts come from kt_weight_path or the checkpoint)"
                elif SCALE_NAME.search(name) or DTYPES[meta["dtype"]] in FP8_DTYPES:
                    what = "an FP8 weight or scale (the store holds dequantised bf16 tensors)"
                elif name not in expected:
                    what = "not a non-expert tensor of this model"
                if what:
                    raise StoreError(f"{store.root / file}: tensor {name!r} is {what}; kt_non_expert_weight_path "
                                     "takes a store written by `ktcore convert MODEL --non-expert --out DIR`")
                self.index[name] = (file, tuple(meta["shape"]))

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def describe(self, name: str) -> str:
        return f" (not in the non-expert store {self.store.root} either)"

    def expect(self, name: str, shape: tuple) -> None:
        file, got = self.index[name]
        if got != tuple(shape):
            raise StoreError(f"{self.store.root / file}: tensor {name!r} has shape {list(got)}, the model needs "
                             f"{list(shape)}; the store is of another model")

    def get(self, name: str) -> torch.Tensor:
        file = self.index[name][0]
        if file not in self._read:  # each file read (and its SHA-256 checked) once
            self._read[file] = self.store.read(file)
        return self._read[file][name]


class StoreWeights:
    """``fill_model``'s weights: tensors from one reader, each layer's experts from another."""

    def __init__(self, tensors, experts):
        self.tensors, self._experts = tensors, experts

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def describe(self, name: str) -> str:
        return self.tensors.describe(name)

    def expect(self, name: str, shape: tuple) -> None:
        self.tensors.expect(name, shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors.get(name)

    def experts(self, layer: int, module):
        return self._experts(layer, module)


def uses_store(kt) -> bool:
    return bool(kt.kt_weight_path or kt.kt_non_expert_weight_path or kt.kt_weight_lifecycle == "ephemeral")


def open_weights(path: Path, kt, model, arch, fp8_block, stack: ExitStack, progress: bool = True):
    """The weights ``fill_model`` reads for the model directory ``path`` under ``kt``'s store keys."""
    from ..model.wrap import expert_modules

    modules = expert_modules(model, arch)
    names = {id(module): name for _, name, module in modules}
    fingerprint = model_fingerprint(path)
    checkpoint = []

    def ckpt() -> SafetensorsCheckpoint:
        if not checkpoint:
            checkpoint.append(stack.enter_context(SafetensorsCheckpoint(path, fp8_block)))
        return checkpoint[0]

    non_experts = experts = None
    if kt.kt_non_expert_weight_path:  # checked first: an ephemeral conversion is not wasted on a broken store
        non_experts = NonExpertStoreWeights(open_store(kt.kt_non_expert_weight_path, "non_expert", fingerprint,
                                                       "kt_non_expert_weight_path"), model, modules)
    mapped, delete = True, False
    if kt.kt_weight_lifecycle == "ephemeral":
        scratch = stack.enter_context(scratch_dir())
        fmt = "int8" if kt.kt_expert_weight_format == "int8" else "bf16"
        convert_experts(ckpt(), arch, modules, scratch, fmt, fingerprint,
                        kt.kt_threadpool_count if kt.kt_tp_enabled else 1, progress)
        experts = open_store(scratch, "experts", fingerprint, "kt_weight_lifecycle: ephemeral")
        mapped, delete = False, True  # read into memory, so deleting a loaded layer frees its disk
    elif kt.kt_weight_path:
        experts = open_store(kt.kt_weight_path, "experts", fingerprint, "kt_weight_path")
        if experts.format == "int8" and experts.manifest.get("source_fp8") and non_experts is None:
            raise StoreError(f"kt_weight_path: {experts.root} holds int8 experts of an FP8 checkpoint; set "
                             "kt_non_expert_weight_path too (write it with `ktcore convert MODEL --non-expert "
                             "--out DIR`)")
    tensors = non_experts if non_experts is not None else SafetensorsWeights(ckpt(), arch)
    if experts is None:
        in_checkpoint = tensors if isinstance(tensors, SafetensorsWeights) else SafetensorsWeights(ckpt(), arch)
        return StoreWeights(tensors, in_checkpoint.experts)
    source = Int8StoreExpertSource if experts.format == "int8" else StoreExpertSource
    return StoreWeights(tensors, lambda layer, module: source(experts, names[id(module)], arch, module,
                                                              mapped=mapped, delete_when_done=delete))
