"""An int8 store (`ktcore convert MODEL --format int8`, `kt_weight_path`) feeds amx_int8 its codes and scales as they
are (``pack_source``): the same logits, bit for bit, as amx_int8 quantising the bf16 checkpoint itself (the store's
Python quantiser and the backend's native one give the same codes), and no dense expert weights are read."""

import pytest
import torch

import ktcore
from ktcore.weights.convert import convert_model

from ktcore_amx_int8 import _ext
from ktcore_amx_int8.backend import AMXInt8Backend

INT8 = {"kt_backend": "amx_int8", "kt_expert_weight_format": "int8"}


def tiny_bf16_model(path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
                            tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def logits(model):
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


def test_int8_store_gives_amx_int8_its_codes(tmp_path, monkeypatch):
    if _ext.amx_unavailable_reason() and _ext.vnni_unavailable_reason():
        pytest.skip("neither AMX INT8 nor AVX-512 VNNI here")
    model = tiny_bf16_model(tmp_path / "model")
    convert_model(model, tmp_path / "int8", "int8", progress=False)
    quantised_here = ktcore.load_model(model, INT8, device="cpu", dtype=torch.bfloat16, progress=False)

    def no_dense_pack(self, weights, activation="silu"):
        raise AssertionError("an int8 store must reach amx_int8 through pack_source, not as dense weights")

    monkeypatch.setattr(AMXInt8Backend, "pack", no_dense_pack)
    from_store = ktcore.load_model(model, {**INT8, "kt_weight_path": str(tmp_path / "int8")}, device="cpu",
                                   dtype=torch.bfloat16, progress=False)
    assert torch.equal(logits(from_store), logits(quantised_here))
