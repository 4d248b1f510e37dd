"""The GGUF metadata of a transformers config, per family (the ``gguf_metadata`` of the built-in ``ArchSpec``s).

Each function is the inverse of the family's reader in ``gguf_configs.py``: it writes the ``{arch}.*`` keys
llama.cpp's converter writes, so that reading the file back gives the config it was written from. Imported only
when a GGUF file is written (``ktcore bench train --expert-format``).
"""

from __future__ import annotations


def common(writer, cfg) -> None:
    """The keys every decoder family shares (what ``gguf_reader.common_config_kwargs`` reads)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope {rope.get('rope_type')!r} is not written to GGUF yet (only plain rope)")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    for key, value in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id), ("pad", cfg.pad_token_id)):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(int(value))


def deepseek(writer, cfg) -> None:
    """DeepSeek-V2 as llama.cpp's older converter writes it (``attn_kv_b`` whole; V3's sigmoid router and its bias
    are not written)."""
    import gguf

    if cfg.model_type != "deepseek_v2":
        raise ValueError(f"only DeepSeek-V2 is written to GGUF, not {cfg.model_type}")
    common(writer, cfg)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    writer.add_expert_group_count(cfg.n_group or 1)
    writer.add_expert_group_used_count(cfg.topk_group or 1)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.v_head_dim)
