"""Adapters: the canonical in-memory form (``canonical``), finding adapters and base models (``locate``), and
the dispatch to the adapter-format plugins.

A format plugin's ``AdapterFormatSpec`` declares how its files are recognised (``files``: names a directory in
the format holds; ``magic``: the first bytes of a file in it), so telling a format needs no import of the
plugin (a format that declares another ``beside`` it owns a directory holding both formats' files, and its
reader checks them all); its factory class has ``save(adapter, dst, base=None)``, ``load(path, base=None)`` and
``verify(path, base=None)``. ``convert``, ``verify``, ``load`` and ``load_adapter_into`` here sniff the format
and dispatch to it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..outputs import output_path
from ..plugins import get_registry
from ..specs import AdapterFormatSpec, import_object
from .canonical import Adapter, AdapterError
from .integrity import check_contents
from .locate import local_adapter_path, resolve_base

__all__ = ["Adapter", "AdapterError", "convert", "format_names", "get_format", "known_files", "load",
           "load_adapter_into", "sniff", "verify"]


def _specs() -> dict[str, AdapterFormatSpec]:
    return get_registry().specs("adapter_format")


def format_names() -> list[str]:
    return sorted(_specs())


def get_format(name: str):
    """An instance of the adapter-format plugin ``name``."""
    return import_object(get_registry().get("adapter_format", name).factory)()


def known_files() -> tuple[str, ...]:
    """File names that mark a directory as an adapter a format's ``save`` may replace: every installed format's
    (never a model's config.json: a user's project holds one too)."""
    return tuple(sorted({name for spec in _specs().values() for name in spec.files}))


def _claims(spec: AdapterFormatSpec, path: Path) -> bool:
    if path.is_dir():
        return any((path / name).exists() for name in spec.files)
    if spec.magic and path.is_file():
        with open(path, "rb") as f:
            return f.read(len(spec.magic)) == spec.magic
    return False


def sniff(path) -> str:
    """The name of the format of the adapter at ``path`` (exactly one plugin must claim it)."""
    path = local_adapter_path(path)
    specs = _specs()
    claims = [name for name, spec in sorted(specs.items()) if _claims(spec, path)]
    # a directory holding two formats' files side by side is in the one that declares the others ``beside`` it
    leaders = [c for c in claims if set(claims) - {c} <= set(specs[c].beside)]
    if len(leaders) == 1:
        return leaders[0]
    if not claims:
        raise AdapterError(f"{path}: not an adapter in any installed format ({', '.join(format_names()) or 'none'}"
                           f" installed; `ktcore list-adapter-formats`)")
    raise AdapterError(f"{path}: claimed by several adapter formats ({', '.join(claims)})")


def _checked(fmt, path, base=None) -> tuple[Adapter, list[str]]:
    """The adapter ``fmt`` reads from ``path`` (its own checks, its integrity record included), after the checks
    every format's adapters pass (``integrity.check_contents``: names, dtypes, finiteness, rank/alpha, and the
    base model's modules and shapes when the base is here)."""
    adapter = fmt.load(path, base=base)
    return adapter, check_contents(adapter, path, resolve_base(adapter.base_model, base))


def load(path, base=None) -> Adapter:
    path = local_adapter_path(path)
    return _checked(get_format(sniff(path)), path, base)[0]


def convert(src, dst, to: str = "peft", base=None, overwrite: bool = False) -> dict:
    """Read ``src`` (format sniffed), write ``dst`` in format ``to``; returns a summary. ``dst`` must be new or
    empty, or an earlier output of ``ktcore adapter convert`` replaced with ``overwrite``
    (``ktcore.outputs.output_path``); a single-file format recognises its own files with the optional
    ``written_by_ktcore(path)`` method."""
    src = local_adapter_path(src)
    source = sniff(src)
    target = get_format(to)
    adapter = _checked(get_format(source), src, base)[0]
    with output_path(dst, "adapter convert", overwrite, getattr(target, "written_by_ktcore", None)) as stage:
        target.save(adapter, stage, base=base)
    return {"from": source, "to": to, "src": str(src), "dst": str(dst), "r": adapter.r, "alpha": adapter.alpha,
            "linear": len(adapter.linear), "experts": len(adapter.experts)}


def verify(path, base=None) -> tuple[str, list[str]]:
    """(format, the checks that passed); raises AdapterError on the first failure."""
    path = local_adapter_path(path)
    name = sniff(path)
    fmt = get_format(name)
    checks = list(fmt.verify(path, base=base))
    return name, checks + _checked(fmt, path, base)[1]


def load_adapter_into(model, path, base=None, is_trainable: bool = False):
    """A PeftModel of ``model`` with the adapter at ``path`` in any installed format (sniffed): validated and
    read by PEFT itself when PEFT reads the format (``peft_native``), else converted into such a format first."""
    from peft import PeftModel

    from ..model.peft_expert_lora import peft_wrapping

    path = local_adapter_path(path)
    name = sniff(path)
    fmt = get_format(name)
    if _specs()[name].peft_native:
        _checked(fmt, path, base)
        with peft_wrapping(model):
            return PeftModel.from_pretrained(model, str(path), is_trainable=is_trainable)
    native = [n for n, spec in sorted(_specs().items()) if spec.peft_native]
    if not native:
        raise AdapterError(f"{path}: loading a {name} adapter into PEFT needs an installed adapter format that PEFT "
                           "reads (ktcore-adapter-peft)")
    adapter = _checked(fmt, path, base)[0]
    with tempfile.TemporaryDirectory(prefix="ktcore-adapter-") as tmp:
        get_format(native[0]).save(adapter, Path(tmp) / "adapter", base=base)
        with peft_wrapping(model):
            return PeftModel.from_pretrained(model, str(Path(tmp) / "adapter"), is_trainable=is_trainable)
