"""Where an adapter and its base model are, and whether a base model is the one an adapter was made for."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Optional

from .canonical import AdapterError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def safetensors_header(path) -> dict:
    """name -> {"dtype", "shape"} from a safetensors header (no tensor data read), every entry checked against
    the file (``weights.safetensors_reader.read_header``: a truncated file or a bad entry is one line)."""
    from ..errors import CheckpointError
    from ..weights.safetensors_reader import read_header

    try:
        header, _ = read_header(Path(path))
    except CheckpointError as exc:
        raise AdapterError(str(exc)) from exc
    return {k: {"dtype": v["dtype"], "shape": list(v["shape"])} for k, v in header.items()}


def local_adapter_path(value) -> Path:
    """The local path of an adapter; a Hugging Face Hub ID is refused (ktcore reads adapters offline)."""
    path = Path(value)
    if path.exists():
        return path
    text = str(value)
    if _HUB_ID.match(text) and not text.startswith((".", "/")):
        raise AdapterError(f"adapter {text!r} is not a local path and looks like a Hugging Face Hub ID; ktcore "
                           f"loads adapters offline only: download it first (huggingface-cli download {text} "
                           f"--local-dir DIR) and pass DIR")
    raise AdapterError(f"adapter path {text!r} does not exist")


def base_fingerprint(path) -> str:
    """sha256 over a base model's config.json (volatile keys dropped), its tensor names and shapes, and each
    weight file's size and first MiB of tensor data (cheap on a 600 GB checkpoint, yet different weights of the
    same architecture differ). A .gguf file: architecture, tensor names/shapes, file size and its first MiB."""
    path = Path(path)
    h = hashlib.sha256()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from ..weights.gguf_reader import GGUFFile

        with GGUFFile(path) as file:  # its reader parses the header 5x faster than a plain gguf.GGUFReader
            reader = file.reader
        arch = reader.get_field("general.architecture")
        h.update(b"gguf:" + (bytes(arch.parts[-1]) if arch else b"?"))
        for t in sorted(reader.tensors, key=lambda t: t.name):
            h.update(f"\n{t.name}:{list(map(int, t.shape))}".encode())
        with open(path, "rb") as fh:
            h.update(f"\n{path.stat().st_size}:".encode() + hashlib.sha256(fh.read(1 << 20)).digest())
        return "sha256:" + h.hexdigest()
    cfg = path / "config.json"
    if not cfg.is_file():
        raise AdapterError(f"base model {str(path)!r}: no config.json (need a local model directory or .gguf)")
    config = json.loads(cfg.read_text(encoding="utf-8"))
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        config.pop(key, None)
    h.update(json.dumps(config, sort_keys=True).encode())
    names = {}
    for f in sorted(path.glob("*.safetensors")):
        names.update({k: v["shape"] for k, v in safetensors_header(f).items()})
        with open(f, "rb") as fh:  # the first MiB of tensor data tells same-shaped models apart, cheaply
            (n,) = struct.unpack("<Q", fh.read(8))
            fh.seek(8 + n)
            h.update(f"\n{f.name}:{f.stat().st_size}:".encode() + hashlib.sha256(fh.read(1 << 20)).digest())
    if not names:
        raise AdapterError(f"base model {str(path)!r}: no *.safetensors files")
    for name in sorted(names):
        h.update(f"\n{name}:{names[name]}".encode())
    return "sha256:" + h.hexdigest()


def is_base_model(path) -> bool:
    """A local base model: a directory with config.json, or a .gguf file (nothing else is read as one)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() or path.is_file() and path.suffix.lower() == ".gguf"


def resolve_base(adapter_base: Optional[str], base=None) -> Optional[Path]:
    """The local base model: ``base`` if given, else the adapter's base_model_name_or_path if it is one (a
    recorded path that is a file other than a .gguf, or a directory without config.json, is never read)."""
    if base is not None:
        path = Path(base)
        if not path.exists():
            raise AdapterError(f"base model {str(base)!r} does not exist")
        if not is_base_model(path):
            raise AdapterError(f"base model {str(base)!r} is neither a model directory with config.json nor a .gguf "
                               "file")
        return path
    if isinstance(adapter_base, str) and adapter_base and is_base_model(adapter_base):
        return Path(adapter_base)
    return None
