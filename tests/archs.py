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


def _fp8_blocks(weight, block=128):
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_dim, :in_dim] = weight
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).view(rows * block, cols * block)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn), scale


def save_fp8_checkpoint(model, path) -> dict:
    """Save ``model`` into ``path`` as DeepSeek-V3 ships: every projection weight float8_e4m3fn with 128x128
    block scales (``<name>_scale_inv``), ``quantization_config`` in config.json. Returns the dequantised
    state dict (float32): the weights a correct reader gives."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(path)
    model.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    quantised = {}
    for name, value in state.items():
        if name.endswith("proj.weight") and "layernorm" not in name and value.dim() == 2:
            q, scale = _fp8_blocks(value)
            quantised[name], quantised[name + "_scale_inv"] = q, scale
            state[name] = (q.float() * scale.repeat_interleave(128, 0)[: value.shape[0]]
                           .repeat_interleave(128, 1)[:, : value.shape[1]])
        else:
            quantised[name] = value
    save_file(quantised, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    return state
