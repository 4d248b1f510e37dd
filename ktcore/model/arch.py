"""Which architecture plugin serves a model, and where its routed-experts modules are (wrap, the cost model's
shapes and the converters look them up the same way)."""

from __future__ import annotations

import re

import torch

from ..plugins import UnknownPluginError, get_registry
from ..specs import ArchSpec
from .dense_mlp import PROJECTIONS


def find_arch(hf_config, registry=None) -> ArchSpec:
    registry = registry or get_registry()
    archs = registry.specs("arch")
    names = tuple(getattr(hf_config, "architectures", None) or ())
    model_type = getattr(hf_config, "model_type", None)
    for spec in archs.values():
        if set(names) & set(spec.hf_architectures) or model_type in spec.model_types:
            return spec
    handled = sorted(a for spec in archs.values() for a in spec.hf_architectures)
    raise UnknownPluginError(f"no ktcore architecture plugin handles {', '.join(names) or model_type!r}; handled: "
                     f"{', '.join(handled) or '(none)'} (see `ktcore list-archs`)")


def experts_pattern(arch: ArchSpec) -> re.Pattern:
    return re.compile(re.escape(arch.experts_module).replace(re.escape("{layer}"), r"(\d+)") + "$")


def expert_modules(model, arch: ArchSpec) -> list[tuple[int, str, torch.nn.Module]]:
    """(layer index, module name, module) of every routed-experts module (dense MLP for dense archs)."""
    pattern = experts_pattern(arch)
    parts = PROJECTIONS if arch.dense_mlp else ("gate_up_proj", "down_proj")
    found = []
    for name, module in model.named_modules():
        match = pattern.search(name)
        if match and all(hasattr(module, p) for p in parts):
            found.append((int(match.group(1)), name, module))
    return sorted(found, key=lambda item: item[0])
