"""Built-in plugin: DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (MLA attention, shared experts, dense first layers).

The router (``mlp.gate``: softmax with greedy or group-limited top-k in V2; sigmoid scores plus
``e_score_correction_bias``, ``n_group``/``topk_group`` and ``norm_topk_prob`` in V3; ``routed_scaling_factor``
in both), the shared experts (``mlp.shared_experts``) and the dense MLPs of the layers below
``first_k_dense_replace`` stay on the GPU. V3's published checkpoints are FP8 with 128x128 ``weight_scale_inv``
blocks, dequantised while streaming. llama.cpp writes both as ``deepseek2``.
"""

from ktcore import hookimpl
from ktcore.builtin.archs.hf_names import EXPERTS, FUSED_KEYS, GGUF_DENSE_MLP, PER_EXPERT_KEYS
from ktcore.specs import ArchSpec

# MLA: q_proj (V2-Lite) or q_a_proj/q_b_proj (V2, V3), kv_a_proj_with_mqa, kv_b_proj, o_proj
_SHARED = "model.layers.{layer}.mlp.shared_experts"  # the MoE block calls it after the routed experts
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
# V3's router bias, which llama.cpp's deepseek2 tables lack too
_GGUF_ROUTER_BIAS = (r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", r"blk.\1.exp_probs_b.bias")


def prepare_model(model) -> None:
    """transformers 5.6 (LLaMA-Factory 0.9.5's pin): DeepSeek-V2's group-limited router reads the MoE block's
    ``num_experts``, which only its experts module sets; give the block the config's count."""
    for module in model.modules():
        if hasattr(module, "route_tokens_to_experts") and not hasattr(module, "num_experts"):
            module.num_experts = model.config.n_routed_experts


def _deepseek(name: str, hf_class: str) -> ArchSpec:
    return ArchSpec(name=name, hf_architectures=(hf_class,), model_types=(name,), experts_module=EXPERTS,
                    expert_keys=PER_EXPERT_KEYS, fused_expert_keys=FUSED_KEYS, default_lora_targets=_ATTENTION,
                    gguf_architecture="deepseek2", gguf_config="ktcore.builtin.archs.gguf_configs:deepseek",
                    gguf_metadata="ktcore.builtin.archs.gguf_metadata:deepseek",
                    gguf_extra_names=(GGUF_DENSE_MLP, _GGUF_ROUTER_BIAS), shared_experts_module=_SHARED,
                    prepare_model="ktcore.builtin.archs.deepseek:prepare_model")


@hookimpl
def ktcore_register_archs():
    return [_deepseek("deepseek_v2", "DeepseekV2ForCausalLM"), _deepseek("deepseek_v3", "DeepseekV3ForCausalLM")]
