"""Tiny models shared by the core tests (a plain module: conftest.py names clash across the plugin packages'
test folders)."""

import torch


def tiny_qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    kwargs = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                  max_position_embeddings=128, tie_word_embeddings=False)
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


def tiny_qwen3_moe(seed=0, **overrides):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**overrides)).float().eval()
    # HF initialises with std 0.02; larger weights make the experts matter in the comparison
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # decisive routing: bf16 rounding rarely flips an expert
                p.normal_(0, 1.0)
    return model


def backend_unusable(name, weight_format="auto"):
    """Why expert backend ``name`` cannot train ``weight_format`` experts here (None when it can): for skip
    reasons."""
    from ktcore.plugins.select import resolve_backend

    reasons = resolve_backend("auto", weight_format=weight_format, need_backward=True, need_lora=True).reasons
    if name not in reasons:
        return f"backend {name!r} is not installed"
    why = reasons[name]
    return None if why is None or why.startswith("usable") else why
