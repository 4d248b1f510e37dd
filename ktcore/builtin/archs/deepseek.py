"""Built-in plugin: DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (MLA attention, shared experts, dense first layers)."""

from ktcore import hookimpl
from ktcore.specs import ArchSpec

_EXPERTS = "model.layers.{layer}.mlp.experts"
_PER_EXPERT = {part: _EXPERTS + ".{expert}." + part + "_proj.weight" for part in ("gate", "up", "down")}
_FUSED = {"gate_up": _EXPERTS + ".gate_up_proj", "down": _EXPERTS + ".down_proj"}
# MLA: q_proj (V2-Lite) or q_a_proj/q_b_proj (V2, V3), kv_a_proj_with_mqa, kv_b_proj, o_proj
_SHARED = "model.layers.{layer}.mlp.shared_experts"  # the MoE block calls it after the routed experts
_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="deepseek_v2",
            hf_architectures=("DeepseekV2ForCausalLM",),
            model_types=("deepseek_v2",),
            experts_module=_EXPERTS,
            expert_keys=_PER_EXPERT,
            fused_expert_keys=_FUSED,
            router="model.layers.{layer}.mlp.gate (softmax, greedy or group-limited top-k, routed_scaling_factor)",
            shared_experts="model.layers.{layer}.mlp.shared_experts (n_shared_experts x moe_intermediate_size)",
            shared_experts_module=_SHARED,
            default_lora_targets=_ATTENTION,
            notes="layers below first_k_dense_replace are dense MLPs and stay on the GPU",
        ),
        ArchSpec(
            name="deepseek_v3",
            hf_architectures=("DeepseekV3ForCausalLM",),
            model_types=("deepseek_v3",),
            experts_module=_EXPERTS,
            expert_keys=_PER_EXPERT,
            fused_expert_keys=_FUSED,
            router="model.layers.{layer}.mlp.gate (sigmoid scores + e_score_correction_bias, n_group/topk_group, "
                   "norm_topk_prob, routed_scaling_factor)",
            shared_experts="model.layers.{layer}.mlp.shared_experts",
            shared_experts_module=_SHARED,
            default_lora_targets=_ATTENTION,
            notes="published checkpoints are FP8 with 128x128 weight_scale_inv blocks, dequantised while streaming",
        ),
    ]
