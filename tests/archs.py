"""Tiny random models of every built-in architecture family, for the architecture tests."""

import torch

COMMON = dict(vocab_size=96, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False)
ODD_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)  # hidden 44: head_dim 22 stays even for RoPE


def _deepseek_v2(odd=False):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(**{**COMMON, "num_key_value_heads": 4}, hidden_size=44 if odd else 48, intermediate_size=72,
                           moe_intermediate_size=20 if odd else 24, num_hidden_layers=3,
                           n_routed_experts=6 if odd else 8, num_experts_per_tok=1 if odd else 2,
                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                           topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    return DeepseekV2ForCausalLM, cfg


def _deepseek_v3(odd=False):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, hidden_size=44 if odd else 48, intermediate_size=72,
                           moe_intermediate_size=20 if odd else 24, num_hidden_layers=3,
                           n_routed_experts=6 if odd else 8, num_experts_per_tok=1 if odd else 2,
                           n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    return DeepseekV3ForCausalLM, cfg


def _qwen2_moe(odd=False):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(**{**COMMON, **(ODD_HEADS if odd else {})}, hidden_size=44 if odd else 48, intermediate_size=72,
                         moe_intermediate_size=20 if odd else 24, shared_expert_intermediate_size=40,
                         num_hidden_layers=3, num_experts=5 if odd else 8, num_experts_per_tok=1 if odd else 2,
                         norm_topk_prob=True, mlp_only_layers=[1])
    return Qwen2MoeForCausalLM, cfg


def _qwen3_moe(odd=False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**COMMON, hidden_size=44 if odd else 48, intermediate_size=72,
                         moe_intermediate_size=20 if odd else 24, num_hidden_layers=3, head_dim=12,
                         num_experts=7 if odd else 8, num_experts_per_tok=1 if odd else 2, norm_topk_prob=True,
                         mlp_only_layers=[1])
    return Qwen3MoeForCausalLM, cfg


def _mixtral(odd=False):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**{**COMMON, **(ODD_HEADS if odd else {})}, hidden_size=44 if odd else 48, intermediate_size=20 if odd else 24,
                        num_hidden_layers=2, num_local_experts=3 if odd else 4, num_experts_per_tok=1 if odd else 2)
    return MixtralForCausalLM, cfg


def _llama(odd=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**COMMON, **(ODD_HEADS if odd else {})}, hidden_size=44 if odd else 48, intermediate_size=36 if odd else 64,
                      num_hidden_layers=2)
    return LlamaForCausalLM, cfg


FAMILIES = {"deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "qwen2_moe": _qwen2_moe,
            "qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "llama": _llama}

# MoE layers (experts modules) each family's tiny model has
MOE_LAYERS = {"deepseek_v2": [1, 2], "deepseek_v3": [1, 2], "qwen2_moe": [0, 2], "qwen3_moe": [0, 2],
              "mixtral": [0, 1], "llama": [0, 1]}


def tiny_model(family: str, odd: bool = False, seed: int = 0, **config):
    """config: overrides of the family's tiny config (num_hidden_layers=...)."""
    cls, cfg = FAMILIES[family](odd)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or (family == "llama" and ".mlp." in name):
                p.normal_(0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # decisive routing
                p.normal_(0, 1.0)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    return model
