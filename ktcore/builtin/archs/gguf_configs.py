"""The transformers config of a GGUF file, per family (the ``gguf_config`` of the built-in ``ArchSpec``s).

Each function takes a ``ktcore.weights.gguf_reader.GGUFFile`` and returns the config, or None when the file
is another family written under the same GGUF architecture (``llama`` holds Llama and Mixtral). Where
transformers' own GGUF support reads a family (qwen2moe, qwen3moe) it is used and corrected; the rest is an
explicit mapping of llama.cpp's metadata keys (for llama the same one as transformers'). Imported only when a
GGUF file is read.
"""

from __future__ import annotations

from ktcore.weights.gguf_reader import GGUFFile, common_config_kwargs, transformers_config


def _has_experts(file: GGUFFile) -> bool:
    return int(file.arch_meta("expert_count", 0) or 0) > 0


def llama(file: GGUFFile):
    """transformers' own GGUF mapping for llama (``integrations/ggml.py``: the same keys, ``rope.dimension_count``
    as head_dim), read from the header ktcore has already parsed: ``AutoConfig.from_pretrained(gguf_file=...)``
    would parse the whole file again, tokenizer arrays included (3-4 s for SmolLM2-135M on the 2-core host)."""
    from transformers import LlamaConfig

    if _has_experts(file):
        return None
    m = file.arch_meta
    kwargs = common_config_kwargs(file)
    if m("rope.dimension_count") is not None:
        kwargs["head_dim"] = int(m("rope.dimension_count"))
    if file.meta("tokenizer.ggml.unknown_token_id") is not None:
        kwargs["unk_token_id"] = int(file.meta("tokenizer.ggml.unknown_token_id"))
    return LlamaConfig(**kwargs, intermediate_size=int(m("feed_forward_length")))


def mixtral(file: GGUFFile):
    from transformers import MixtralConfig

    if not _has_experts(file):
        return None
    m = file.arch_meta
    return MixtralConfig(**common_config_kwargs(file),
                         intermediate_size=int(m("expert_feed_forward_length", 0) or m("feed_forward_length")),
                         num_local_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
                         architectures=["MixtralForCausalLM"])


def qwen_moe(file: GGUFFile):
    """Qwen2-MoE and Qwen3-MoE: dense layers are the blocks without a router (``ffn_gate_inp``)."""
    cfg = transformers_config(file)
    cfg.mlp_only_layers = [i for i in range(cfg.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" not in file]
    cfg.decoder_sparse_step = 1
    expert_ff = file.arch_meta("expert_feed_forward_length")
    if expert_ff:
        cfg.moe_intermediate_size = int(expert_ff)
    if file.architecture == "qwen2moe":
        shexp = file.arch_meta("expert_shared_feed_forward_length")
        if shexp:
            cfg.shared_expert_intermediate_size = int(shexp)
    # llama.cpp normalises the top-k weights of qwen3moe and not of qwen2moe unless the file says otherwise
    cfg.norm_topk_prob = bool(file.arch_meta("expert_weights_norm", file.architecture == "qwen3moe"))
    key_length = file.arch_meta("attention.key_length")
    if key_length and hasattr(cfg, "head_dim"):
        cfg.head_dim = int(key_length)
    return cfg


def deepseek(file: GGUFFile):
    """DeepSeek-V3 when the gating function is sigmoid (or the router bias ``exp_probs_b`` is there), else V2."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    m = file.arch_meta
    rope_dim = int(m("rope.dimension_count"))
    key_length = int(m("attention.key_length_mla", 0) or m("attention.key_length"))
    value_length = int(m("attention.value_length_mla", 0) or m("attention.value_length"))
    n_group = int(m("expert_group_count", 1) or 1)
    kwargs = dict(common_config_kwargs(file), intermediate_size=int(m("feed_forward_length")),
                  moe_intermediate_size=int(m("expert_feed_forward_length")),
                  n_routed_experts=int(m("expert_count")), num_experts_per_tok=int(m("expert_used_count")),
                  n_shared_experts=int(m("expert_shared_count", 0)),
                  first_k_dense_replace=int(m("leading_dense_block_count", 0)),
                  kv_lora_rank=int(m("attention.kv_lora_rank")), q_lora_rank=int(m("attention.q_lora_rank", 0)) or None,
                  qk_rope_head_dim=rope_dim, qk_nope_head_dim=key_length - rope_dim, v_head_dim=value_length,
                  n_group=n_group, topk_group=int(m("expert_group_used_count", 1) or 1),
                  routed_scaling_factor=float(m("expert_weights_scale", 1.0)),
                  norm_topk_prob=bool(m("expert_weights_norm", False)))
    sigmoid = int(m("expert_gating_func", 1) or 1) == 2 or "blk.{}.exp_probs_b.bias".format(
        kwargs["first_k_dense_replace"]) in file
    if sigmoid:
        return DeepseekV3Config(**kwargs, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV2Config(**kwargs, topk_method="group_limited_greedy" if n_group > 1 else "greedy",
                            architectures=["DeepseekV2ForCausalLM"])
