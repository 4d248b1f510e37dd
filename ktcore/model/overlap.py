"""Shared experts on the device while the CPU computes the routed experts of the same MoE block.

transformers' DeepSeek MoE block calls the routed experts, then the shared experts, then adds the two. The
routed experts' call therefore returns before the backend is done (``ExpertLayer`` defers), and a forward hook
on the shared-experts module makes the result valid (``ExpertsResult``) once the shared experts' device work
is enqueued, right before the block reads it. A block that runs its shared experts first (Qwen2-MoE) or has
none waits inside the experts call, as without overlap.

By default a layer defers when its input is on a CUDA device; ``set_overlap`` forces it on or off (the CPU
tests compare both).
"""

from __future__ import annotations

from typing import Optional

from ..experts import ExpertsResult


class OverlapPoint:
    """The hooks of one MoE block, and the experts result they still owe the block."""

    def __init__(self, block_name: str):
        self.block_name = block_name
        self.enabled: Optional[bool] = None  # None: overlap when the input is on a CUDA device
        self._shared_ran = False
        self._pending = None

    def __deepcopy__(self, memo):
        return self  # a deep-copied model shares its ExpertLayers, so it shares their overlap state too

    def defers(self, x) -> bool:
        on = x.is_cuda if self.enabled is None else self.enabled
        return on and not self._shared_ran

    def hold(self, job, y) -> None:
        self._pending = (job, y)

    def _collect(self) -> None:
        if self._pending is not None:
            job, y = self._pending
            self._pending = None
            ExpertsResult.apply(job, y)

    def before_block(self, module, args) -> None:
        self._shared_ran = False
        self._pending = None  # left over from a forward that raised

    def after_shared(self, module, args, output) -> None:
        self._shared_ran = True
        self._collect()

    def after_block(self, module, args, output) -> None:
        if self._pending is not None:
            self._collect()
            raise RuntimeError(f"{self.block_name}: the block returned before its shared experts ran after the "
                               "routed experts, so it may have read their output unfinished; the architecture "
                               "plugin's shared_experts_module is wrong for this model (set it to '' to turn "
                               "overlap off)")


def install_overlap(model, arch, layers: dict, layer_index) -> int:
    """Hook every MoE block of ``layers`` (experts module name -> ExpertLayer) whose shared-experts module
    (``arch.shared_experts_module``) exists; ``layer_index(name)`` gives the decoder layer of an experts module.
    Returns how many blocks were hooked."""
    if not arch.shared_experts_module:
        return 0
    hooked = 0
    for name, layer in layers.items():
        try:
            shared = model.get_submodule(arch.shared_experts_module.format(layer=layer_index(name)))
        except AttributeError:  # this layer has no shared experts (n_shared_experts: 0)
            continue
        block_name = name.rpartition(".")[0]
        block = model.get_submodule(block_name)
        point = OverlapPoint(block_name)
        block.register_forward_pre_hook(point.before_block)
        shared.register_forward_hook(point.after_shared)
        block.register_forward_hook(point.after_block)
        layer.overlap = point
        hooked += 1
    return hooked


def set_overlap(model, enabled: Optional[bool]) -> None:
    """Force overlap on (True) or off (False) for every hooked block of a ktcore model, or back to the
    default (None: on for CUDA inputs)."""
    for layer in model.ktcore.layers.values():
        if layer.overlap is not None:
            layer.overlap.enabled = enabled
