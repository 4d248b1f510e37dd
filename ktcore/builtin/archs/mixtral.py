"""Built-in plugin: Mixtral (checkpoints name the MoE block block_sparse_moe and the experts w1/w3/w2).

The router (``mlp.gate``: softmax top-k, renormalised) stays on the GPU. llama.cpp writes Mixtral as ``llama``
with ``expert_count > 0``.
"""

from ktcore import hookimpl
from ktcore.builtin.archs.hf_names import EXPERTS, FUSED_KEYS
from ktcore.specs import ArchSpec

_DISK = "model.layers.{layer}.block_sparse_moe.experts"


@hookimpl
def ktcore_register_archs():
    return [
        ArchSpec(
            name="mixtral",
            hf_architectures=("MixtralForCausalLM",),
            model_types=("mixtral",),
            experts_module=EXPERTS,
            expert_keys={"gate": _DISK + ".{expert}.w1.weight", "up": _DISK + ".{expert}.w3.weight",
                         "down": _DISK + ".{expert}.w2.weight"},
            fused_expert_keys=FUSED_KEYS,
            default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
            checkpoint_renames=((r"\.block_sparse_moe\.", ".mlp."),),
            gguf_architecture="llama",
            gguf_config="ktcore.builtin.archs.gguf_configs:mixtral",
            gguf_rope_permuted=True,
        )
    ]
