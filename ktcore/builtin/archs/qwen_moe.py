"""Built-in plugin: the Qwen MoE family (Qwen2-MoE with its gated shared expert, Qwen3-MoE)."""

from ktcore import hookimpl
from ktcore.specs import ArchSpec

_EXPERTS = "model.layers.{layer}.mlp.experts"
_PER_EXPERT = {part: _EXPERTS + ".{expert}." + part + "_proj.weight" for part in ("gate", "up", "down")}
_FUSED = {"gate_up": _EXPERTS + ".gate_up_proj", "down": _EXPERTS + ".down_proj"}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="qwen2_moe",
            hf_architectures=("Qwen2MoeForCausalLM",),
            model_types=("qwen2_moe",),
            experts_module=_EXPERTS,
            expert_keys=_PER_EXPERT,
            fused_expert_keys=_FUSED,
            router="model.layers.{layer}.mlp.gate (softmax top-k, norm_topk_prob)",
            shared_experts="model.layers.{layer}.mlp.shared_expert, scaled by sigmoid(mlp.shared_expert_gate)",
            default_lora_targets=_ATTENTION,
            notes="the shared expert and its gate stay on the GPU; decoder_sparse_step/mlp_only_layers give dense layers",
        ),
        ArchSpec(
            name="qwen3_moe",
            hf_architectures=("Qwen3MoeForCausalLM",),
            model_types=("qwen3_moe",),
            experts_module=_EXPERTS,
            expert_keys=_PER_EXPERT,
            fused_expert_keys=_FUSED,
            router="model.layers.{layer}.mlp.gate (softmax top-k, optional norm_topk_prob)",
            default_lora_targets=_ATTENTION,
            notes="dense layers listed in mlp_only_layers keep a plain MLP on the GPU; PEFT maps v4-style "
                  "gate_proj/up_proj/down_proj targets onto the fused experts",
        ),
    ]
