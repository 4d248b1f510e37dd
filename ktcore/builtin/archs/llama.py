"""Built-in plugin: Llama (dense). Each MLP runs on the CPU backend as one expert with weight 1, so a dense
model whose MLPs do not fit the GPU can keep them in host RAM. The MLP's gate_proj/up_proj/down_proj keep
their names, so PEFT adapters are unchanged."""

from ktcore import hookimpl
from ktcore.specs import ArchSpec

_MLP = "model.layers.{layer}.mlp"


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="llama",
            hf_architectures=("LlamaForCausalLM",),
            model_types=("llama",),
            experts_module=_MLP,
            expert_keys={part: _MLP + "." + part + "_proj.weight" for part in ("gate", "up", "down")},
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            expert_lora_parameters=(),
            dense_mlp=True,
            gguf_architecture="llama",
            gguf_config="ktcore.builtin.archs.gguf_configs:llama",
            gguf_expert_keys={part: "blk.{layer}.ffn_" + part + ".weight" for part in ("gate", "up", "down")},
            gguf_rope_permuted=True,
        )
    ]
