"""Running a training frontend plugin by name, after the checks that need no model."""

from __future__ import annotations

import importlib.util

from ..config import ConfigError, TrainConfig
from ..plugins import PluginError, get_registry
from ..specs import FrontendSpec, import_object


def missing_packages(spec: FrontendSpec) -> list[str]:
    return [pkg for pkg in spec.required_packages if importlib.util.find_spec(pkg) is None]


def resolve_frontend(name: str) -> FrontendSpec:
    registry = get_registry()
    unavailable = {n: f"needs {', '.join(m)}: pip install {' '.join(m)} (or the frontend's wheel, ktcore-{n})"
                   for n, s in registry.specs("frontend").items() if (m := missing_packages(s))}
    return registry.get("frontend", name, unavailable)


def run_frontend(name: str, cfg: TrainConfig) -> dict:
    spec = resolve_frontend(name)
    where = cfg.source or "<config>"
    if cfg.stage not in spec.stages:
        raise ConfigError(f"{where}: stage {cfg.stage!r} is not supported by the {name} frontend "
                          f"(it runs: {', '.join(spec.stages)})")
    if not cfg.model_name_or_path:
        raise ConfigError(f"{where}: model_name_or_path is required for training")
    if not cfg.output_dir:
        raise ConfigError(f"{where}: output_dir is required for training")
    try:
        run = import_object(spec.run)
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"frontend {name!r}: cannot import {spec.run}: {type(exc).__name__}: {exc}") from exc
    return run(cfg)


def peak_memory() -> dict:
    """Peak GPU memory (torch's allocator, when CUDA is there) and peak host RSS of this process, GiB, for a
    frontend's run summary."""
    import torch

    out = {}
    if torch.cuda.is_available():
        out["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    try:
        import resource

        out["peak_host_mem_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    except (ImportError, OSError):
        pass
    return out
