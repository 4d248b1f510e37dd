"""Frozen descriptors returned by plugin hooks.

A descriptor says what a plugin offers and how to reach it; it never does work. Anything heavy is named
as a "module:attribute" string and imported only when the plugin is used.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional


def import_object(ref: str):
    """Import "package.module:attr.sub" and return the attribute."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected 'module:attribute', got {ref!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _check_name(kind: str, name: str) -> None:
    if not name or not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"{kind} name {name!r} must be non-empty and use only letters, digits, '_' and '-'")


@dataclass(frozen=True)
class ExpertBackendSpec:
    """A CPU expert backend (DESIGN section 3, the op boundary)."""

    name: str
    factory: str  # "module:Class"; the class takes (config: KTConfig) and implements ExpertBackend
    required_cpu_features: tuple[str, ...] = ()
    weight_formats: tuple[str, ...] = ("bf16",)
    supports_backward: bool = True
    supports_lora: bool = True
    priority: int = 0  # higher wins among usable backends
    # quantises the experts (amx_int8): `auto` chooses it only where kt_expert_weight_format names one of its
    # weight_formats, never for format `auto` (a lossy format is the user's choice); naming it in kt_backend does
    lossy: bool = False
    probe: Optional[Callable[[], Optional[str]]] = None  # cheap check: None if usable, else the reason
    description: str = ""
    # "module:function" (seconds) -> dict of report fields: what this backend measures for `ktcore doctor`
    doctor: Optional[str] = None
    # "module:function" (model, out_dir, fmt, overwrite=False) -> summary dict: `ktcore convert` for the formats
    # below; an existing output is replaced only with overwrite and only when it wrote it (ktcore.outputs)
    converter: Optional[str] = None
    convert_formats: tuple[str, ...] = ()  # the --format values the converter writes; the first is the default

    def __post_init__(self):
        _check_name("backend", self.name)


# llama.cpp's names of one layer's routed experts, stacked per projection (every MoE family it converts)
GGUF_EXPERT_KEYS = {"gate": "blk.{layer}.ffn_gate_exps.weight", "up": "blk.{layer}.ffn_up_exps.weight",
                    "down": "blk.{layer}.ffn_down_exps.weight"}


@dataclass(frozen=True)
class ArchSpec:
    """A model family: where its routed experts live, how its checkpoints name them, and its GGUF files.

    Key templates use ``{layer}`` and ``{expert}``; the experts module path uses ``{layer}``.
    """

    name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    experts_module: str  # e.g. "model.layers.{layer}.mlp.experts"
    # per-expert checkpoint keys (what save_pretrained writes and the Hub checkpoints hold)
    expert_keys: dict = field(default_factory=dict)  # {"gate": ..., "up": ..., "down": ...}
    # fused keys (transformers 5 in-memory layout, also found on disk)
    fused_expert_keys: dict = field(default_factory=dict)  # {"gate_up": ..., "down": ...}
    # the shared-experts module the MoE block calls after the routed experts and before it reads their output
    # (e.g. "model.layers.{layer}.mlp.shared_experts"): the CPU computes the routed experts while the device
    # computes this module (ktcore.model.overlap); "" when there is none or it runs first
    shared_experts_module: str = ""
    default_lora_targets: tuple[str, ...] = ()  # linear module names for lora_target: all
    expert_lora_parameters: tuple[str, ...] = ("gate_up_proj", "down_proj")
    # (regex, replacement) applied to checkpoint names to get the model's names (e.g. Mixtral's
    # ".block_sparse_moe." -> ".mlp."); expert key templates above use the checkpoint's own names
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # "module:function" called with the transformers model before its experts are wrapped: the family's fix-ups
    # for transformers versions whose modules lack something ktcore's path needs (empty: none)
    prepare_model: str = ""
    # True: experts_module is a dense gated MLP (gate_proj/up_proj/down_proj) run as one expert of weight 1
    dense_mlp: bool = False
    # -- GGUF: read by the GGUF loader and the GGUF adapter format --
    # the general.architecture llama.cpp writes this family under ("qwen3moe"); "" = no GGUF support
    gguf_architecture: str = ""
    # "module:function" taking a ktcore.weights.gguf_reader.GGUFFile and returning the transformers config, or
    # None when the file is another family written under the same gguf_architecture (llama: Llama or Mixtral)
    gguf_config: str = ""
    # the inverse: "module:function" taking a gguf.GGUFWriter and the transformers config and writing the
    # family's {arch}.* metadata keys, so that gguf_config reads the same config back ("" = ktcore writes no GGUF
    # of this family; `ktcore bench train --expert-format` needs it)
    gguf_metadata: str = ""
    # one layer's routed experts (or, with dense_mlp, its MLP) in the file, {"gate", "up", "down"} with {layer}
    gguf_expert_keys: dict = field(default_factory=lambda: dict(GGUF_EXPERT_KEYS))
    # (regex over a model tensor name, replacement) for the tensors gguf's own name map lacks for the family
    gguf_extra_names: tuple[tuple[str, str], ...] = ()
    # llama.cpp's converter permutes the rows of attn_q/attn_k for its rope; readers invert it
    gguf_rope_permuted: bool = False

    def __post_init__(self):
        _check_name("architecture", self.name)


@dataclass(frozen=True)
class FrontendSpec:
    """A training frontend (TRL, LLaMA-Factory, ...)."""

    name: str
    run: str  # "module:function" taking (config: TrainConfig) and returning a summary dict
    evaluate: str = ""  # the same for `ktcore eval` (evaluation loss and perplexity); "" when it has none
    required_packages: tuple[str, ...] = ()
    stages: tuple[str, ...] = ("sft",)
    description: str = ""

    def __post_init__(self):
        _check_name("frontend", self.name)


@dataclass(frozen=True)
class AdapterFormatSpec:
    """An adapter file format; ``factory`` names a class with save/load/verify.

    ``files`` and ``magic`` say how an adapter in the format is recognised without importing the plugin."""

    name: str
    factory: str
    description: str = ""
    files: tuple[str, ...] = ()  # a directory holding any of these files is in this format
    magic: bytes = b""  # a file starting with these bytes is in this format
    peft_native: bool = False  # PeftModel.from_pretrained reads the format's directories as they are
    # formats whose files may share a directory with this format's: that directory is then in this format, whose
    # reader must check the other format's files too (fused_expert beside peft: plain PEFT reads the PEFT half)
    beside: tuple[str, ...] = ()

    def __post_init__(self):
        _check_name("adapter format", self.name)


SPEC_TYPES = {
    "expert_backend": ExpertBackendSpec,
    "arch": ArchSpec,
    "frontend": FrontendSpec,
    "adapter_format": AdapterFormatSpec,
}
