"""Dense gated MLPs (Llama) on the expert backend: one expert, every token routed to it with weight 1.

``OffloadedMLP`` keeps the MLP's ``gate_proj``/``up_proj``/``down_proj`` children (with placeholder weights),
so parameter names, PEFT targets and adapter files are exactly those of the plain model. PEFT wraps those
children in ``lora.Linear``; this module reads their active LoRA factors and hands them to the backend in
the expert layout (gate and up LoRA stacked into one rank-(r_gate + r_up) gate_up LoRA, exact).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..experts import ExpertLayer, ExpertLoRA, ExpertWeights
from .placeholder import ExpertWeightPlaceholder

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _linear(child) -> nn.Linear:
    return child.get_base_layer() if hasattr(child, "get_base_layer") else child


def dense_weights(mlp) -> ExpertWeights:
    gate, up, down = (_linear(getattr(mlp, p)).weight.detach() for p in PROJECTIONS)
    return ExpertWeights(gate.unsqueeze(0), up.unsqueeze(0), down.unsqueeze(0))


def _active_factors(child) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(A [r, in], scaling * B [out, r])] for each active LoRA adapter of a PEFT lora.Linear, else []."""
    if not hasattr(child, "lora_A") or child.disable_adapters or child.merged:
        return []
    factors = []
    for name in child.active_adapters:
        if name not in child.lora_A:
            continue
        if child.training and not isinstance(child.lora_dropout[name], nn.Identity):
            raise ValueError("lora_dropout must be 0 for MLPs computed by the ktcore backend")
        factors.append((child.lora_A[name].weight, child.scaling[name] * child.lora_B[name].weight))
    return factors


def dense_lora(mlp) -> Optional[ExpertLoRA]:
    gate, up, down = (_active_factors(getattr(mlp, p)) for p in PROJECTIONS)
    if not (gate or up or down):
        return None
    lora = ExpertLoRA()
    if gate or up:
        inter = _linear(mlp.gate_proj).out_features
        blocks_a, blocks_b = [], []
        for factors, rows in ((gate, slice(0, inter)), (up, slice(inter, 2 * inter))):
            for a, b in factors:
                full_b = b.new_zeros(2 * inter, b.shape[1])
                full_b[rows] = b
                blocks_a.append(a)
                blocks_b.append(full_b)
        lora.gate_up_a = torch.cat(blocks_a, 0).unsqueeze(0)
        lora.gate_up_b = torch.cat(blocks_b, 1).unsqueeze(0)
    if down:
        lora.down_a = torch.cat([a for a, _ in down], 0).unsqueeze(0)
        lora.down_b = torch.cat([b for _, b in down], 1).unsqueeze(0)
    return lora


class OffloadedMLP(nn.Module):
    """Drop-in for a dense gated MLP whose math runs on the CPU expert backend."""

    def __init__(self, mlp: nn.Module, layer: ExpertLayer, dtype, device):
        super().__init__()
        for name in PROJECTIONS:
            linear = getattr(mlp, name)
            linear.weight = nn.Parameter(ExpertWeightPlaceholder(linear.weight.shape, dtype, device),
                                         requires_grad=False)
            setattr(self, name, linear)
        self.__dict__["_ktcore_layer"] = layer  # not a submodule, not in state_dict

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        ids = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
        weights = torch.ones(flat.shape[0], 1, dtype=flat.dtype, device=flat.device)
        out = self._ktcore_layer(flat, ids, weights, dense_lora(self))
        return out.view_as(hidden_states)
