"""A tiny Qwen3-MoE (real transformers model, real PEFT expert LoRA, autograd through the backend) trained a few
AdamW steps with int8 experts reduces its loss as it does with bf16 experts: the two loss curves stay within 10%
of each other at every step, and both fall by a fifth. Only the expert LoRA trains, so a wrong gradient from the
backend shows as a curve that does not fall, or falls differently."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import ktcore
from ktcore.plugins.select import resolve_backend

INT8 = {"kt_backend": "amx_int8", "kt_expert_weight_format": "int8"}
BF16 = {"kt_backend": "torch", "kt_expert_weight_format": "bf16"}


def tiny_model(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                            tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():  # experts that matter (HF's std 0.02 leaves them nearly silent)
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    return model


def train(model, steps=12):
    """Expert LoRA only: every step's progress rests on the gradients the backend computes."""
    torch.manual_seed(7)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    params = [p for p in model.parameters() if p.requires_grad]
    assert all("experts" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(params, lr=5e-2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (4, 24), generator=g)  # one fixed batch: the loss must fall as it is memorised
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_int8_experts_train_like_bf16_experts():
    why = resolve_backend("amx_int8", weight_format="int8", need_backward=True, need_lora=True).reasons["amx_int8"]
    if why:
        pytest.skip(f"amx_int8 cannot train here: {why}")
    base = tiny_model()
    bf16 = train(ktcore.wrap_model(copy.deepcopy(base), BF16))
    int8_model = ktcore.wrap_model(copy.deepcopy(base), INT8)
    assert next(iter(int8_model.ktcore.layers.values())).backend.name == "amx_int8"
    int8 = train(int8_model)
    assert bf16[-1] < 0.8 * bf16[0] and int8[-1] < 0.8 * int8[0], (bf16, int8)
    for step, (a, b) in enumerate(zip(int8, bf16)):
        assert abs(a - b) <= 0.1 * b, (step, int8, bf16)
