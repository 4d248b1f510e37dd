"""Per-layer expert placement: regex rules over module names choosing a backend or the GPU.

``kt_config.kt_placement`` is a list of rules; the first whose ``match`` regex finds the experts module's
name decides, and a module no rule matches uses ``kt_backend`` on the CPU::

    kt_placement:
      - match: '^model\\.layers\\.[0-3]\\.'   # the first four MoE layers keep their experts on the GPU
        device: gpu
      - match: '\\.(1[0-9])\\.mlp'            # layers 10-19 on another backend
        backend: torch

``device: gpu`` leaves the layer's experts as transformers' own module on the model's device; ``device:
gpu_stream`` keeps them in host memory and streams them to the model's device for each use (``model/stream.py``);
``device: hybrid`` splits them between ``kt_backend`` and the stream (``model/hybrid.py``); ``device: auto``
chooses among those per call (``model/auto.py``);
``backend`` names any expert backend plugin (computed on the CPU). ``kt_expert_placement`` is the device of the
layers no rule matches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

DEVICES = ("cpu", "gpu", "gpu_stream", "hybrid", "auto")


@dataclass(frozen=True)
class PlacementRule:
    match: str
    device: str = "cpu"
    backend: Optional[str] = None  # None: kt_backend

    def matches(self, module_name: str) -> bool:
        return re.search(self.match, module_name) is not None


def parse_rules(raw, where: str) -> tuple[PlacementRule, ...]:
    """Validate the YAML list; raises ValueError with one line naming the rule and the fix."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}: kt_config.kt_placement must be a list of rules, got {type(raw).__name__}")
    rules = []
    for i, rule in enumerate(raw):
        at = f"{where}: kt_config.kt_placement[{i}]"
        if isinstance(rule, PlacementRule):
            rules.append(rule)
            continue
        if not isinstance(rule, dict) or "match" not in rule:
            raise ValueError(f"{at} must be a mapping with 'match' and 'device' or 'backend', got {rule!r}")
        unknown = set(rule) - {"match", "device", "backend"}
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}; a rule has match, device, backend")
        try:
            re.compile(str(rule["match"]))
        except re.error as exc:
            raise ValueError(f"{at}: match {rule['match']!r} is not a valid regular expression ({exc})") from exc
        device = str(rule.get("device", "cpu")).lower()
        device = "gpu" if device.startswith("cuda") else device
        if device not in DEVICES:
            raise ValueError(f"{at}: device {rule.get('device')!r} is not one of {', '.join(DEVICES)}")
        backend = rule.get("backend")
        if device != "cpu" and backend is not None:
            raise ValueError(f"{at}: a rule places experts on the GPU ({device}) or on a CPU backend, not both")
        rules.append(PlacementRule(str(rule["match"]), device, None if backend is None else str(backend)))
    return tuple(rules)


def place(module_name: str, rules, default_backend: str, default_device: str = "cpu") -> PlacementRule:
    """The rule deciding ``module_name`` (``default_device``, with the default backend on the CPU, when none
    matches)."""
    for rule in rules:
        if rule.matches(module_name):
            return rule if rule.device != "cpu" or rule.backend else PlacementRule(rule.match, "cpu", default_backend)
    return PlacementRule("", default_device, default_backend if default_device == "cpu" else None)
