"""Built-in plugin: the Qwen MoE family (Qwen3-MoE; Qwen2-MoE joins in the architectures issue)."""

from ktcore import hookimpl
from ktcore.specs import ArchSpec

_EXPERTS = "model.layers.{layer}.mlp.experts"


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="qwen3_moe",
            hf_architectures=("Qwen3MoeForCausalLM",),
            model_types=("qwen3_moe",),
            experts_module=_EXPERTS,
            expert_keys={
                "gate": _EXPERTS + ".{expert}.gate_proj.weight",
                "up": _EXPERTS + ".{expert}.up_proj.weight",
                "down": _EXPERTS + ".{expert}.down_proj.weight",
            },
            fused_expert_keys={"gate_up": _EXPERTS + ".gate_up_proj", "down": _EXPERTS + ".down_proj"},
            router="model.layers.{layer}.mlp.gate (softmax top-k, optional norm_topk_prob)",
            shared_experts="",
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            notes="dense layers listed in mlp_only_layers keep a plain MLP on the GPU; PEFT maps v4-style gate_proj/up_proj/down_proj targets onto the fused experts",
        )
    ]
