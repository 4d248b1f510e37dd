"""The packed weight store: a directory of safetensors files plus ``kt-weight-manifest.json``.

``ktcore convert MODEL --format {bf16,int8} --out DIR`` writes one (``kind: experts``: each MoE layer's routed
experts, split into thread-pool files); ``ktcore convert MODEL --non-expert --out DIR`` writes the other kind
(``kind: non_expert``: every other tensor in bf16). This module is the format both share:

* writing: ``StoreWriter`` writes each file atomically (temp file, fsync, rename; ``ktcore.files.atomic_file``)
  while hashing the bytes it writes, records it in a journal (``kt-weight-manifest.json.partial``) so a killed
  conversion resumes after its last finished file, and writes the manifest last;
* opening: ``open_store`` checks, before a byte of weights is read, that the manifest is this kind, format and
  layout, that it was converted from this model (``model_fingerprint``: its config.json and tensor index), and
  that the directory holds exactly the listed files, as regular files of the listed sizes (no symlinks, no
  extras); every problem is one line naming the file;
* reading: ``Store.read`` maps a file (or reads it, for a store deleted after loading) and checks its SHA-256
  against the manifest before handing out its tensors, so a tampered file fails before it is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .. import __version__
from ..errors import CheckpointError, KtcoreError
from ..files import atomic_file, clean_leftovers, fault_point
from ..experts.int8 import LAYOUT as INT8_LAYOUT
from .safetensors_reader import DTYPES, INDEX_NAME, SINGLE_NAME, read_header
from .staged import StagedFile, safetensors_layout, write_staged

MANIFEST_NAME = "kt-weight-manifest.json"
JOURNAL_NAME = MANIFEST_NAME + ".partial"
STORE_VERSION = 1
# format -> (layout name, layout version): what a reader must understand to use the files
LAYOUTS = {"bf16": ("bf16-dense-v1", 1), "int8": (INT8_LAYOUT, 1)}


class StoreError(CheckpointError):
    """A weight store that is missing, incomplete, changed or converted from another model."""


def model_fingerprint(model_dir) -> str:
    """SHA-256 of a safetensors model directory's config.json and tensor index (the index's weight_map, or the
    single file's tensor names, dtypes and shapes): what a store records as its source, read without weights."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
        if (model_dir / INDEX_NAME).is_file():
            tensors = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
        else:
            header, _ = read_header(model_dir / SINGLE_NAME)
            tensors = {name: [meta["dtype"], meta["shape"]] for name, meta in header.items()}
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{model_dir}: cannot read config.json and the tensor index to fingerprint the model "
                              f"({exc}); pass a model directory saved by save_pretrained") from exc
    blob = json.dumps({"config": config, "tensors": tensors}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


# ---- writing ------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> dict:
    """Write ``tensors`` as one safetensors file at ``path`` atomically (layout: ``safetensors_layout``); returns
    ``{"size", "sha256"}``, hashed from the bytes as they are written (no second read)."""
    prefix, spans = safetensors_layout({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, metadata)
    digest, size = hashlib.sha256(), 0
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        for chunk in (prefix, *(tensors[n].contiguous().reshape(-1).view(torch.uint8).numpy()
                                for n in sorted(spans, key=lambda n: spans[n][0]))):
            f.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


@dataclass
class StoreWriter:
    """Writes one store into ``root``, resuming an unfinished conversion with the same ``identity`` (kind,
    format, layout, fingerprint, split): files already finished are kept, not written again.

    ``root`` must be missing, empty, an unfinished conversion of the same identity, or a finished one (then
    ``finished`` is True and nothing is written); anything else there is refused (never overwritten)."""

    root: Path
    identity: dict
    files: dict = field(default_factory=dict)  # name -> {"size", "sha256"} of the finished files
    finished: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.root = Path(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise KtcoreError(f"{self.root} exists and is not a directory; choose another --out")
        self.root.mkdir(parents=True, exist_ok=True)
        manifest, journal = self.root / MANIFEST_NAME, self.root / JOURNAL_NAME
        for path in (manifest, journal):
            if path.is_file():
                recorded = _read_json(path)
                if {k: recorded.get(k) for k in self.identity} != self.identity:
                    raise KtcoreError(f"{path}: {self.root} holds a conversion of another model, format or split "
                                      f"({_describe(recorded)}); choose another --out (it is not overwritten)")
                if path == manifest:
                    self.finished = True
                    return
                self.files = dict(recorded.get("files") or {})
        clean_leftovers(journal)

    def expect_names(self, names) -> None:
        """Refuse a directory holding something other than this store's files (and ktcore's temp files)."""
        allowed = set(names) | {MANIFEST_NAME, JOURNAL_NAME}
        prefixes = tuple(f".{n}.ktcore-" for n in allowed)
        for entry in sorted(os.listdir(self.root)):
            if entry not in allowed and not entry.startswith(prefixes):
                raise KtcoreError(f"{self.root / entry}: not written by this conversion; choose an empty or new "
                                  "--out (ktcore deletes nothing it did not write)")
        for name in list(self.files):
            path = self.root / name
            if name not in allowed or not path.is_file() or path.is_symlink() or \
                    path.stat().st_size != self.files[name]["size"]:
                del self.files[name]  # not what was recorded: written again

    def done(self, name: str) -> bool:
        return name in self.files

    def write(self, name: str, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> int:
        """Write one file, then record it in the journal (a kill between the two rewrites the file next time);
        returns its size. Threads may write different files at once."""
        clean_leftovers(self.root / name)
        return self._record(name, write_safetensors(self.root / name, tensors, metadata))

    def write_staged(self, name: str, staged: StagedFile) -> int:
        """``write`` for a file built in place (``ktcore.weights.staged``)."""
        clean_leftovers(self.root / name)
        return self._record(name, write_staged(self.root / name, staged))

    def _record(self, name: str, entry: dict) -> int:
        with self._lock:
            self.files[name] = entry
            _write_json(self.root / JOURNAL_NAME, {**self.identity, "files": dict(sorted(self.files.items()))})
        fault_point(f"store:written:{name}")
        return entry["size"]

    def finish(self, extra: dict) -> dict:
        """Write the manifest (last), then drop the journal; returns the manifest."""
        manifest = {"kt_weight_store": STORE_VERSION, **self.identity, **extra,
                    "files": dict(sorted(self.files.items())),
                    "written_by": f"ktcore {__version__}"}
        _write_json(self.root / MANIFEST_NAME, manifest)
        (self.root / JOURNAL_NAME).unlink(missing_ok=True)
        self.finished = True
        return manifest


def _write_json(path: Path, data: dict) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as exc:
        raise StoreError(f"{path}: unreadable ({exc}); convert the store again") from exc


def _describe(manifest: dict) -> str:
    return ", ".join(f"{k} {manifest.get(k)}" for k in ("kind", "format", "threadpools") if k in manifest)


def identity(kind: str, fmt: str, fingerprint: str, threadpools: int = 1) -> dict:
    """The keys a manifest must match to be this store: kind, format, layout and its version, source, split."""
    layout, version = LAYOUTS[fmt]
    return {"kind": kind, "format": fmt, "layout": layout, "layout_version": version,
            "model_fingerprint": fingerprint, "threadpools": threadpools}


# ---- opening and reading ------------------------------------------------------------------------------------


@dataclass
class Store:
    """A validated store: its manifest, and each file's header (tensor name -> metadata, data offset)."""

    root: Path
    manifest: dict
    headers: dict

    @property
    def format(self) -> str:
        return self.manifest["format"]

    def read(self, name: str, *, mapped: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of file ``name`` once its SHA-256 matches the manifest: views of a private map of the
        file (``mapped``), or of a copy in memory (for a store whose files are deleted once loaded)."""
        path, size = self.root / name, self.manifest["files"][name]["size"]
        if mapped:
            buf = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
            with open(path, "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [memoryview(buf.numpy())], 0)
            if got != size:
                raise StoreError(f"{path}: short read ({got} of {size} bytes); the file changed after validation")
        if hashlib.sha256(buf.numpy()).hexdigest() != self.manifest["files"][name]["sha256"]:
            raise StoreError(f"{path}: its SHA-256 differs from {MANIFEST_NAME}: the file was changed after "
                             "`ktcore convert` wrote it; convert the store again")
        header, base = self.headers[name]
        return {tensor: buf[base + meta["data_offsets"][0]: base + meta["data_offsets"][1]]
                .view(DTYPES[meta["dtype"]]).reshape(meta["shape"]) for tensor, meta in header.items()}

    def delete(self, name: str) -> None:
        """Remove one of this store's files (an ephemeral store, once the file is loaded)."""
        (self.root / name).unlink(missing_ok=True)


def open_store(root, kind: str, fingerprint: str, key: str) -> Store:
    """Validate the store at ``root`` (named by config key ``key`` in errors) against the model whose
    ``model_fingerprint`` is ``fingerprint``: manifest, kind, layout, source, and the directory's files."""
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    other = "--non-expert --out" if kind == "non_expert" else "--format int8 --out"
    if not root.is_dir():
        raise StoreError(f"{key}: {root} is not a directory; write the store with "
                         f"`ktcore convert MODEL {other} {root}`")
    if not manifest_path.is_file() or manifest_path.is_symlink():
        why = ("an unfinished conversion; run the same `ktcore convert` again to finish it"
               if (root / JOURNAL_NAME).is_file() else f"not a weight store; write it with `ktcore convert MODEL "
               f"{other} {root}`")
        raise StoreError(f"{manifest_path}: missing ({key}: {why})")
    manifest = _read_json(manifest_path)
    if manifest.get("kind") != kind:
        raise StoreError(f"{manifest_path}: a store of kind {manifest.get('kind')!r}, {key} needs {kind!r} "
                         f"(written by `ktcore convert MODEL {other} DIR`)")
    fmt = manifest.get("format")
    if fmt not in LAYOUTS or (manifest.get("layout"), manifest.get("layout_version")) != LAYOUTS[fmt] or \
            manifest.get("kt_weight_store") != STORE_VERSION:
        raise StoreError(f"{manifest_path}: format {fmt!r}, layout {manifest.get('layout')!r} version "
                         f"{manifest.get('layout_version')!r} (store version {manifest.get('kt_weight_store')!r}) is "
                         f"not one this ktcore reads ({', '.join(f'{f}: {l} v{v}' for f, (l, v) in LAYOUTS.items())}); "
                         "convert the model again with this ktcore")
    if manifest.get("model_fingerprint") != fingerprint:
        raise StoreError(f"{manifest_path}: converted from another model (fingerprint "
                         f"{str(manifest.get('model_fingerprint'))[:12]}..., this model's config and tensor index "
                         f"give {fingerprint[:12]}...); convert this model into a new directory")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("size"), int) and
                                              isinstance(v.get("sha256"), str) for v in files.values()):
        raise StoreError(f"{manifest_path}: 'files' is not {{name: {{size, sha256}}}}; convert the store again")
    for entry in sorted(os.listdir(root)):
        path = root / entry
        if path.is_symlink():
            raise StoreError(f"{path}: a symlink in the store ({key}); stores hold only the regular files ktcore "
                             "wrote, copy the file in or convert again")
        if entry != MANIFEST_NAME and entry not in files:
            raise StoreError(f"{path}: not listed in {MANIFEST_NAME} ({key}); remove it or convert the store again")
    headers = {}
    for name, entry in files.items():
        path = root / name
        if "/" in name or name in (".", "..") or not path.is_file():
            raise StoreError(f"{path}: listed in {MANIFEST_NAME} but missing ({key}); convert the store again")
        size = path.stat().st_size
        if size != entry["size"]:
            raise StoreError(f"{path}: {size} bytes, {MANIFEST_NAME} lists {entry['size']} (truncated or changed; "
                             f"{key}); convert the store again")
        headers[name] = read_header(path)
    return Store(root, manifest, headers)


