"""Choosing an expert backend: ``auto`` or a name, with a reason for every backend not chosen."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ..specs import ExpertBackendSpec, import_object
from . import Registry, UnknownPluginError, get_registry
from .hw import CpuInfo, cpu_info
from .threads import backend_threads


@dataclass(frozen=True)
class BackendChoice:
    spec: Optional[ExpertBackendSpec]
    # every registered backend -> None when usable for this request, else why not
    reasons: dict


def unusable_reason(spec: ExpertBackendSpec, cpu: CpuInfo, weight_format: str = "auto",
                    need_backward: bool = False, need_lora: bool = False, named: bool = False) -> Optional[str]:
    """Why ``spec`` cannot serve this request on this CPU, or None. ``named``: the request names this backend (a
    lossy one, amx_int8, then serves weight format ``auto`` in its own format)."""
    missing = cpu.missing(spec.required_cpu_features)
    if missing:
        return f"CPU lacks {', '.join(missing)}"
    if "amx_tile" in spec.required_cpu_features and not cpu.amx_permission:
        return cpu.amx_permission_reason or "no AMX tile permission"
    if spec.lossy and weight_format == "auto" and not named:
        return (f"quantises the experts ({', '.join(spec.weight_formats)}): chosen only when "
                "kt_expert_weight_format names its format, not for 'auto'")
    if weight_format != "auto" and weight_format not in spec.weight_formats:
        return f"weight format {weight_format!r} not supported (has {', '.join(spec.weight_formats)})"
    if need_backward and not spec.supports_backward:
        return "no backward pass (training needs one)"
    if need_lora and not spec.supports_lora:
        return "no expert LoRA"
    if spec.probe is not None:
        try:
            why = spec.probe()
        except Exception as exc:  # noqa: BLE001 - a probe must never take the caller down
            why = f"probe failed: {type(exc).__name__}: {exc}"
        if why:
            return str(why)
    return None


def resolve_backend(name: str = "auto", *, weight_format: str = "auto", need_backward: bool = False,
                    need_lora: bool = False, registry: Optional[Registry] = None,
                    cpu: Optional[CpuInfo] = None) -> BackendChoice:
    registry = registry or get_registry()
    cpu = cpu or cpu_info()
    specs = registry.specs("expert_backend")
    reasons = {n: unusable_reason(s, cpu, weight_format, need_backward, need_lora, named=n == name)
               for n, s in specs.items()}
    if name != "auto":
        unavailable = {n: r for n, r in reasons.items() if r}
        return BackendChoice(registry.get("expert_backend", name, unavailable), reasons)
    usable = [specs[n] for n, r in reasons.items() if r is None]
    if not usable:
        return BackendChoice(None, reasons)
    best = max(usable, key=lambda s: (s.priority, s.name))
    for spec in usable:
        if spec is not best:
            reasons[spec.name] = f"usable, but {best.name} has higher priority ({best.priority} > {spec.priority})"
    return BackendChoice(best, reasons)


def get_backend(name: str, kt, *, need_backward: bool = False, need_lora: bool = False,
                registry: Optional[Registry] = None):
    """An instance of the backend ``name`` ("auto": the best usable here) built with the KTConfig ``kt``; its
    ``name`` is the name it is registered under."""
    choice = resolve_backend(name, weight_format=kt.kt_expert_weight_format, need_backward=need_backward,
                             need_lora=need_lora, registry=registry)
    if choice.spec is None:
        lines = [f"  {n}: {r}" for n, r in sorted(choice.reasons.items())]
        raise UnknownPluginError("no expert backend can run here:\n" + "\n".join(lines))
    backend = import_object(choice.spec.factory)(replace(kt, kt_num_threads=backend_threads(kt.kt_num_threads)))
    backend.name = choice.spec.name
    return backend


def backend_class(name: str, kt, *, need_backward: bool = False, need_lora: bool = False,
                  registry: Optional[Registry] = None):
    """The class ``get_backend`` would build with the same arguments, or None where no backend can run; nothing is
    built."""
    spec = resolve_backend(name, weight_format=kt.kt_expert_weight_format, need_backward=need_backward,
                           need_lora=need_lora, registry=registry).spec
    return None if spec is None else import_object(spec.factory)


def experts_format(kt, registry: Optional[Registry] = None) -> str:
    """The weight format the routed experts are computed in: kt_expert_weight_format, or for ``auto`` the format of
    a lossy backend kt_backend names (amx_int8: int8), else ``auto`` (the backend's own, unquantised)."""
    if kt.kt_expert_weight_format != "auto":
        return kt.kt_expert_weight_format
    spec = (registry or get_registry()).specs("expert_backend").get(kt.kt_backend)
    return spec.weight_formats[0] if spec is not None and spec.lossy else "auto"
