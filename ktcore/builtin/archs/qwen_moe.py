"""Built-in plugin: the Qwen MoE family (Qwen2-MoE with its gated shared expert, Qwen3-MoE).

The router (``mlp.gate``: softmax top-k, ``norm_topk_prob``) and Qwen2-MoE's shared expert
(``mlp.shared_expert``, scaled by ``sigmoid(mlp.shared_expert_gate)``) stay on the GPU, as do the plain MLPs of
the dense layers (``decoder_sparse_step``, ``mlp_only_layers``). PEFT maps v4-style gate_proj/up_proj/down_proj
targets onto the fused experts.
"""

from ktcore import hookimpl
from ktcore.builtin.archs.hf_names import EXPERTS, FUSED_KEYS, GGUF_DENSE_MLP, PER_EXPERT_KEYS
from ktcore.specs import ArchSpec


def _qwen_moe(name: str, hf_class: str, gguf_architecture: str) -> ArchSpec:
    return ArchSpec(name=name, hf_architectures=(hf_class,), model_types=(name,), experts_module=EXPERTS,
                    expert_keys=PER_EXPERT_KEYS, fused_expert_keys=FUSED_KEYS,
                    default_lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                    gguf_architecture=gguf_architecture, gguf_config="ktcore.builtin.archs.gguf_configs:qwen_moe",
                    gguf_extra_names=(GGUF_DENSE_MLP,))


@hookimpl
def ktcore_register_archs():
    return [_qwen_moe("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2moe"),
            _qwen_moe("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe")]
