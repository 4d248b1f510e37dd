"""Sparse upcycling: turn a dense Llama-style model into an MoE of a given family with the same outputs.

Every expert is a copy of the dense MLP and top-k routing weights are renormalised to sum to one, so the
MoE computes exactly the dense MLP whatever the router picks. Families with a shared expert get a zeroed
one. This gives real, pretrained MoE models to test with (SmolLM2 answering as Mixtral or Qwen2-MoE).
"""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe")

_SHARED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")


def _moe_config(dense_config, arch: str, num_experts: int, top_k: int):
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = {k: getattr(dense_config, k) for k in _SHARED_KEYS if getattr(dense_config, k, None) is not None}
    inter = dense_config.intermediate_size
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=inter, num_local_experts=num_experts,
                             num_experts_per_tok=top_k)
    return Qwen2MoeConfig(**common, intermediate_size=inter, moe_intermediate_size=inter,
                          shared_expert_intermediate_size=inter, num_experts=num_experts,
                          num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], use_sliding_window=False)


def upcycle(model, arch: str, num_experts: int, top_k: int, seed: int = 0):
    """A new ``arch`` MoE model (``mixtral`` or ``qwen2_moe``) computing what the dense ``model`` computes."""
    from transformers import AutoModelForCausalLM

    if arch not in FAMILIES:
        raise ValueError(f"upcycle supports {', '.join(FAMILIES)} (Llama attention), not {arch!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts], got top_k={top_k}, num_experts={num_experts}")
    config = _moe_config(model.config, arch, num_experts, top_k)
    moe = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    dense = model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            if ".mlp." not in name:
                if name in dense:
                    param.copy_(dense[name])
                elif name.endswith("_proj.bias"):  # Qwen2 attention biases: zero, as Llama has none
                    param.zero_()
                elif name == "lm_head.weight":
                    param.copy_(dense["model.embed_tokens.weight"])
                else:
                    raise KeyError(f"upcycle: no dense counterpart for {name}")
                continue
            layer = name.split(".mlp.")[0]
            gate, up, down = (dense[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
            if name.endswith("experts.gate_up_proj"):
                param.copy_(torch.cat([gate, up], 0).expand(num_experts, -1, -1))
            elif name.endswith("experts.down_proj"):
                param.copy_(down.expand(num_experts, -1, -1))
            elif name.endswith("mlp.gate.weight"):  # router: any weights work, the experts are identical
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            elif ".shared_expert" in name:
                param.zero_()  # contributes nothing
            else:
                raise KeyError(f"upcycle: unexpected MoE parameter {name}")
    moe.generation_config = model.generation_config
    return moe.eval()
