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
layers no rule matches. ``num_gpu_experts`` sets ``kt_num_gpu_experts`` for the layers a ``cpu`` rule matches
(``model/resident.py``: that many of each layer's most used experts resident on the model's device); the layers no
rule sets it for take ``kt_num_gpu_experts``.
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
    num_gpu_experts: Optional[int] = None  # None: kt_num_gpu_experts

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
        unknown = set(rule) - {"match", "device", "backend", "num_gpu_experts"}
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {', '.join(sorted(unknown))}; a rule has match, device, backend, "
                             "num_gpu_experts")
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
        resident = rule.get("num_gpu_experts")
        if resident is not None and (isinstance(resident, bool) or not isinstance(resident, int) or resident < 0):
            raise ValueError(f"{at}: num_gpu_experts must be an integer >= 0 (0: none resident), got {resident!r}")
        rules.append(PlacementRule(str(rule["match"]), device, None if backend is None else str(backend), resident))
    return tuple(rules)


RESIDENT_WITH = ("cpu", "gpu")  # the devices kt_num_gpu_experts combines with (gpu: every expert is resident)


def num_gpu_experts(rule: PlacementRule, default: int) -> int:
    """The resident experts of a layer ``rule`` places: its own ``num_gpu_experts``, else ``kt_num_gpu_experts``;
    0 on the GPU, where all of them are."""
    if rule.device == "gpu":
        return 0
    return default if rule.num_gpu_experts is None else rule.num_gpu_experts


def check_num_gpu_experts(rules, kt, where: str) -> None:
    """``kt_num_gpu_experts`` (and a rule's ``num_gpu_experts``) are for ``cpu`` layers: the stream's layers are
    refused in one line (a layer streamed or split has its own GPU share; an expert resident there too would be a
    third place to keep consistent), as are values out of range that need no model to see."""
    n, interval = kt.kt_num_gpu_experts, kt.kt_gpu_experts_interval
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{where}: kt_config.kt_num_gpu_experts must be an integer >= 0 (0: none resident), got {n!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"{where}: kt_config.kt_gpu_experts_interval must be an integer >= 1 (forward calls between "
                         f"two choices of the resident experts), got {interval!r}")
    if n > 0 and kt.kt_expert_placement not in RESIDENT_WITH:
        raise ValueError(f"{where}: kt_config.kt_num_gpu_experts works with kt_expert_placement: cpu, not "
                         f"{kt.kt_expert_placement}; set kt_num_gpu_experts: 0, or place the layers on the cpu")
    for i, rule in enumerate(rules):
        if rule.device not in RESIDENT_WITH and num_gpu_experts(rule, n) > 0:
            raise ValueError(f"{where}: kt_config.kt_placement[{i}]: num_gpu_experts works with device: cpu, not "
                             f"{rule.device}; add num_gpu_experts: 0 to this rule, or give it device: cpu")


def place(module_name: str, rules, default_backend: str, default_device: str = "cpu") -> PlacementRule:
    """The rule deciding ``module_name`` (``default_device``, with the default backend on the CPU, when none
    matches)."""
    for rule in rules:
        if rule.matches(module_name):
            return rule if rule.device != "cpu" or rule.backend else \
                PlacementRule(rule.match, "cpu", default_backend, rule.num_gpu_experts)
    return PlacementRule("", default_device, default_backend if default_device == "cpu" else None)
