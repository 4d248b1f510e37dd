"""What a model's config says about its cost: parameter counts and layer sizes, with no weight read.

The model is built on the meta device by transformers itself, so the counts are the real module tree's, not a
formula per family; ``expert_modules`` (the same lookup ``wrap_model`` uses) says which tensors are routed experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The sizes the cost model needs (weights counted in parameters, not bytes)."""

    layers: int  # decoder layers
    moe_layers: int  # layers whose routed experts ktcore places
    experts: int  # routed experts per MoE layer (1 for a dense MLP)
    top_k: int
    hidden: int
    expert_intermediate: int
    vocab: int
    non_expert_params: int  # everything the GPU holds: attention, dense and shared MLPs, embeddings, head
    embedding_params: int  # looked up, not multiplied: no compute
    attention_heads: int
    attention_head_dim: int  # query/key dim + value dim of one head (attention FLOPs per token pair)
    lora_params_per_rank: int  # LoRA parameters per unit of rank on every linear and on the routed experts

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def routed_params(self) -> int:
        return self.moe_layers * self.experts * self.expert_params


def _head_dims(config) -> int:
    qk = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0)  # DeepSeek MLA
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (qk or head_dim) + (getattr(config, "v_head_dim", None) or head_dim)


def model_shape(hf_config) -> ModelShape:
    """Count a transformers config's model (meta tensors only: seconds for a 671B model, no memory)."""
    import torch  # here: the cost model (and a config's kt_rates check) reads ModelShape without torch
    from transformers import AutoModelForCausalLM

    from .arch import expert_modules, find_arch

    config = copy.deepcopy(hf_config)
    # ktcore dequantises an FP8 checkpoint while loading: the model it builds has no quantised modules
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    arch = find_arch(config)
    modules = expert_modules(model, arch)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no experts module matching {arch.experts_module!r}")
    _, _, first = modules[0]
    if arch.dense_mlp:
        experts, inter, hidden, top_k = 1, first.gate_proj.out_features, first.gate_proj.in_features, 1
    else:
        experts, rows, hidden = first.gate_up_proj.shape
        if getattr(first, "is_transposed", False):
            experts, hidden, rows = first.gate_up_proj.shape
        inter, top_k = rows // 2, int(config.num_experts_per_tok)
    expert_names = tuple(name + "." for _, name, _ in modules)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if n.startswith(expert_names))
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head
               and not n.startswith(expert_names)]
    per_expert_lora = 3 * (hidden + inter) if arch.dense_mlp else (hidden + 2 * inter) + (inter + hidden)  # gate_up, down
    lora = sum(m.in_features + m.out_features for m in linears) + len(modules) * experts * per_expert_lora
    return ModelShape(layers=int(config.num_hidden_layers), moe_layers=len(modules), experts=int(experts),
                      top_k=top_k, hidden=int(hidden), expert_intermediate=int(inter), vocab=int(config.vocab_size),
                      non_expert_params=total - routed, embedding_params=embedding,
                      attention_heads=int(config.num_attention_heads), attention_head_dim=_head_dims(config),
                      lora_params_per_rank=lora)
