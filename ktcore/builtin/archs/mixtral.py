"""Built-in plugin: Mixtral (checkpoints name the MoE block block_sparse_moe and the experts w1/w3/w2)."""

from ktcore import hookimpl
from ktcore.specs import ArchSpec

_DISK = "model.layers.{layer}.block_sparse_moe.experts"


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="mixtral",
            hf_architectures=("MixtralForCausalLM",),
            model_types=("mixtral",),
            experts_module="model.layers.{layer}.mlp.experts",
            expert_keys={"gate": _DISK + ".{expert}.w1.weight", "up": _DISK + ".{expert}.w3.weight",
                         "down": _DISK + ".{expert}.w2.weight"},
            fused_expert_keys={"gate_up": "model.layers.{layer}.mlp.experts.gate_up_proj",
                               "down": "model.layers.{layer}.mlp.experts.down_proj"},
            router="model.layers.{layer}.mlp.gate (softmax top-k, renormalised)",
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            checkpoint_renames=((r"\.block_sparse_moe\.", ".mlp."),),
        )
    ]
