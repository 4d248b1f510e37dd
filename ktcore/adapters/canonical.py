"""The canonical in-memory adapter every adapter-format plugin converts to and from.

A trained adapter is one ``Adapter``: a uniform rank ``r`` and ``alpha`` (scaling ``alpha / r``), the LoRA of
ordinary linear layers (attention, dense MLPs, shared experts) by module name, and the routed-expert LoRA by
experts-module name in per-expert form::

    linear["model.layers.0.self_attn.q_proj"] = (A [r, in], B [out, r])          delta = scaling * B @ A
    experts["model.layers.0.mlp.experts"]["gate_up"] = (A [E, r, H], B [E, 2I, r])  delta_e = scaling * B[e] @ A[e]
    experts["model.layers.0.mlp.experts"]["down"]    = (A [E, r, I], B [E, H, r])

(gate rows first in ``gate_up``, transformers 5's fused layout). PEFT's own ``target_parameters`` tensors are
``lora_A.weight [r*E, in]`` (reshaped ``(E, r, in)``, expert-major) and ``lora_B.weight [out, r*E]`` (reshaped
``(out, r, E)``, rank-major); ``peft_state`` and ``peft_config_for`` give an adapter in PEFT's names and layout
exactly (a reshape and a permute), and the PEFT format reads them back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError

PEFT_PREFIX = "base_model.model."
EXPERT_PARAMS = {"gate_up": "gate_up_proj", "down": "down_proj"}


class AdapterError(ConfigError):
    """An adapter that cannot be used; the message names the file/key and the fix (fail closed)."""


@dataclass
class Adapter:
    r: int
    alpha: float
    linear: dict = field(default_factory=dict)   # module name -> (A [r, in], B [out, r])
    experts: dict = field(default_factory=dict)  # experts module name -> {"gate_up"|"down": (A, B)}
    peft_config: dict = field(default_factory=dict)
    base_model: Optional[str] = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def tensors(self):
        """(key, A, B) for every LoRA pair; key is a module name or (experts module, part)."""
        for name, (a, b) in self.linear.items():
            yield name, a, b
        for name, parts in self.experts.items():
            for part, (a, b) in parts.items():
                yield (name, part), a, b

    @property
    def dtype(self):
        for _, a, _ in self.tensors():
            return a.dtype
        import torch

        return torch.float32

    def check(self) -> None:
        """Every pair has rank r and consistent shapes."""
        for key, a, b in self.tensors():
            expert = isinstance(key, tuple)
            want = 3 if expert else 2
            if a.dim() != want or b.dim() != want or a.shape[-2] != self.r or b.shape[-1] != self.r or \
                    (expert and a.shape[0] != b.shape[0]):
                raise AdapterError(f"LoRA of {key}: A {list(a.shape)} and B {list(b.shape)} do not form a rank-"
                                   f"{self.r} {'expert ' if expert else ''}LoRA")

    def padded(self, r: int) -> "Adapter":
        """The same deltas at rank ``r`` >= self.r: zero rows of A / columns of B, alpha scaled (exact)."""
        return uniform_rank(self.r, self.alpha, dict(self.linear), dict(self.experts), self.peft_config,
                            self.base_model) if r == self.r else uniform_rank(
            self.r, self.alpha, {n: _pad_pair(a, b, r) for n, (a, b) in self.linear.items()},
            {n: {p: _pad_pair(a, b, r) for p, (a, b) in ps.items()} for n, ps in self.experts.items()},
            self.peft_config, self.base_model)


def split_gate_up(a, b):
    """PEFT's fused gate_up LoRA (A [E, r, H], B [E, 2I, r]) -> exact gate and up LoRAs of rank r each.

    gate and up share A; B's first I rows are gate's, the rest up's. No information is lost."""
    inter = b.shape[1] // 2
    return (a.contiguous(), b[:, :inter].contiguous()), (a.clone(), b[:, inter:].contiguous())


def split_expert_parts(parts: dict) -> dict:
    """One experts module's LoRA {"gate_up": (A, B), "down": (A, B)} -> {"gate", "up", "down"} pairs."""
    split = {}
    if "gate_up" in parts:
        split["gate"], split["up"] = split_gate_up(*parts["gate_up"])
    if "down" in parts:
        split["down"] = parts["down"]
    return split


def fuse_gate_up(gate, up):
    """Separate gate and up LoRAs -> one gate_up LoRA, and its rank.

    When both share A exactly (what ``split_gate_up`` writes) the result has rank r. Otherwise the exact fused
    LoRA needs rank 2r: A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]]."""
    import torch

    (ga, gb), (ua, ub) = gate, up
    if ga.shape == ua.shape and torch.equal(ga, ua):
        return ga, torch.cat([gb, ub], 1), ga.shape[-2]
    a = torch.cat([ga, ua], -2)
    b = torch.cat([torch.cat([gb, gb.new_zeros(*gb.shape[:-1], ua.shape[-2])], -1),
                   torch.cat([ub.new_zeros(*ub.shape[:-1], ga.shape[-2]), ub], -1)], 1)
    return a, b, ga.shape[-2] + ua.shape[-2]


def _pad_pair(a, b, r: int):
    import torch

    extra = r - a.shape[-2]
    if extra == 0:
        return a, b
    return (torch.cat([a, a.new_zeros(*a.shape[:-2], extra, a.shape[-1])], -2),
            torch.cat([b, b.new_zeros(*b.shape[:-1], extra)], -1))


def uniform_rank(adapter_r: int, alpha: float, linear: dict, experts: dict, peft_config: dict,
                 base_model=None) -> Adapter:
    """An Adapter from pairs of possibly different ranks (a rank-2r fused gate_up): every pair zero-padded to
    the largest rank, alpha scaled so the scaling stays alpha / adapter_r (exact)."""
    ranks = [a.shape[-2] for a, _ in linear.values()] + \
        [a.shape[-2] for parts in experts.values() for a, _ in parts.values()]
    top = max(ranks + [adapter_r])
    alpha_top = alpha * top / adapter_r
    out = Adapter(top, alpha_top, {n: _pad_pair(a, b, top) for n, (a, b) in linear.items()},
                  {n: {p: _pad_pair(a, b, top) for p, (a, b) in parts.items()} for n, parts in experts.items()},
                  {**peft_config, "r": top, "lora_alpha": alpha_top}, base_model)
    out.check()
    return out


def layer_of(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if not m:
        raise AdapterError(f"cannot tell the layer of module {name!r}")
    return int(m.group(1))


def peft_state(adapter: Adapter) -> dict:
    """The adapter_model.safetensors tensors of ``adapter`` (PEFT's key names and layouts)."""
    state = {}
    for name, (a, b) in adapter.linear.items():
        state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.contiguous()
        state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.contiguous()
    for name, parts in adapter.experts.items():
        for part, (a, b) in parts.items():
            # PEFT nests one ParamWrapper per targeted parameter in the module's parameter order (gate_up_proj
            # first, innermost): with both present gate_up sits under .base_layer
            inner = ".base_layer" if part == "gate_up" and "down" in parts else ""
            e, r = a.shape[0], a.shape[1]
            state[f"{PEFT_PREFIX}{name}{inner}.lora_A.weight"] = a.reshape(e * r, a.shape[2]).contiguous()
            state[f"{PEFT_PREFIX}{name}{inner}.lora_B.weight"] = \
                b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()
    return state


def peft_config_for(adapter: Adapter) -> dict:
    config = dict(adapter.peft_config)
    config.setdefault("peft_type", "LORA")
    config.setdefault("task_type", "CAUSAL_LM")
    config.setdefault("bias", "none")
    config.setdefault("lora_dropout", 0.0)
    config.update(r=adapter.r, lora_alpha=adapter.alpha, rank_pattern={}, alpha_pattern={},
                  base_model_name_or_path=adapter.base_model)
    if not config.get("target_modules") and adapter.linear:
        config["target_modules"] = sorted({n.rsplit(".", 1)[-1] for n in adapter.linear})
    wanted = {re.sub(r"^.*?layers\.\d+\.", "", n) + "." + EXPERT_PARAMS[p]
              for n, parts in adapter.experts.items() for p in parts}
    if wanted and not set(config.get("target_parameters") or []) >= wanted:
        config["target_parameters"] = sorted(wanted)
    return config
