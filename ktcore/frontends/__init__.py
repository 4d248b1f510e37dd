"""Training frontends: running a frontend plugin by name (after the checks that need no model), and the
skeleton every frontend shares (``ktcore.frontends.skeleton``)."""

from __future__ import annotations

import importlib.util

from ..config import ConfigError, TrainConfig
from ..plugins import PluginError, get_registry
from ..specs import FrontendSpec, import_object


def missing_packages(spec: FrontendSpec) -> list[str]:
    return [pkg for pkg in spec.required_packages if importlib.util.find_spec(pkg) is None]


def resolve_frontend(name: str) -> FrontendSpec:
    from .environments import not_set_up

    registry = get_registry()
    if name not in registry.specs("frontend") and (how := not_set_up(name)):
        raise PluginError(how)
    unavailable = {n: f"needs {', '.join(m)}: pip install {' '.join(m)} (or the frontend's wheel, ktcore-{n})"
                   for n, s in registry.specs("frontend").items() if (m := missing_packages(s))}
    return registry.get("frontend", name, unavailable)


def _imported(name: str, target: str):
    try:
        return import_object(target)
    except Exception as exc:  # noqa: BLE001
        raise PluginError(f"frontend {name!r}: cannot import {target}: {type(exc).__name__}: {exc}") from exc


def evaluate_frontend(name: str, cfg: TrainConfig) -> dict:
    """``ktcore eval``: the frontend's ``evaluate`` (loss and perplexity on ``eval_dataset``), after the checks
    that need no model."""
    spec = resolve_frontend(name)
    with_eval = sorted(n for n, s in get_registry().specs("frontend").items() if s.evaluate)
    if not spec.evaluate:
        raise PluginError(f"frontend {name!r} has no evaluation; use --frontend "
                          f"{' or '.join(with_eval) or 'llamafactory (scripts/setup_llamafactory.sh)'}")
    if not cfg.model_name_or_path:
        raise ConfigError(f"{cfg.where}: model_name_or_path is required")
    if not (cfg.eval_dataset or cfg.dataset):
        raise ConfigError(f"{cfg.where}: eval_dataset (or dataset) is required: the data to evaluate on")
    from .skeleton import check_paths_and_backend

    check_paths_and_backend(cfg, hub_ok=True)
    return _imported(name, spec.evaluate)(cfg)


def run_frontend(name: str, cfg: TrainConfig) -> dict:
    spec = resolve_frontend(name)
    where = cfg.where
    if cfg.stage not in spec.stages:
        raise ConfigError(f"{where}: stage {cfg.stage!r} is not supported by the {name} frontend "
                          f"(it runs: {', '.join(spec.stages)})")
    if not cfg.model_name_or_path:
        raise ConfigError(f"{where}: model_name_or_path is required for training")
    if not cfg.output_dir:
        raise ConfigError(f"{where}: output_dir is required for training")
    from .skeleton import check_paths_and_backend

    check_paths_and_backend(cfg, hub_ok=True)  # before the frontend's imports (torch, transformers) take seconds
    return _imported(name, spec.run)(cfg)
