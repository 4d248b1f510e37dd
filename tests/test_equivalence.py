"""ktcore-wrapped Qwen3-MoE against the unmodified transformers model (fp32): logits, loss, LoRA gradients."""

import copy

import pytest
import torch
from ktcore_tiny import backend_unusable, tiny_qwen3_moe
from peft import LoraConfig, PeftModel, get_peft_model

import ktcore
from ktcore.model.placeholder import ExpertWeightsUnavailable, is_placeholder
from ktcore.testing import relative_error

TORCH = {"kt_backend": "torch"}


def batch(seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      init_lora_weights=False)


def peft_pair(plain, wrapped):
    torch.manual_seed(7)
    a = get_peft_model(plain, lora_config())
    torch.manual_seed(7)
    b = get_peft_model(wrapped, lora_config())
    return a, b


def lora_grads(model, ids, mask):
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_as_close_as_plain_bf16(truth, plain_bf16, ours, ids, mask) -> dict:
    """``ours`` in bf16 is as close to the fp32 ``truth`` as plain transformers in bf16 is (logits and every LoRA
    gradient, relative); returns the truth's gradients."""
    results = {name: lora_grads(m, ids, mask) for name, m in
               (("truth", truth), ("plain_bf16", plain_bf16), ("ours", ours))}
    ref_out, ref_grads = results["truth"]

    def err(name):
        out, grads = results[name]
        return (relative_error(out.logits.float(), ref_out.logits),
                max(relative_error(grads[n].float(), ref_grads[n]) for n in ref_grads))

    (plain_logits, plain_grads), (our_logits, our_grads) = err("plain_bf16"), err("ours")
    assert our_logits <= max(2 * plain_logits, 1e-2), (our_logits, plain_logits)
    assert our_grads <= max(2 * plain_grads, 5e-2), (our_grads, plain_grads)
    return ref_grads


def assert_same_training_signal(plain, ours, ids, mask):
    ref, ref_grads = lora_grads(plain, ids, mask)
    got, got_grads = lora_grads(ours, ids, mask)
    assert relative_error(got.logits, ref.logits) <= 1e-5
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-5 * abs(ref.loss.item())
    assert set(got_grads) == set(ref_grads)
    expert_grads = [n for n in ref_grads if "experts" in n]
    assert len(expert_grads) == 2 * 2 * 2  # 2 MoE layers x (gate_up, down) x (A, B)
    for name in ref_grads:
        assert ref_grads[name].norm() > 0, name
        assert relative_error(got_grads[name], ref_grads[name]) <= 1e-4, name


def test_wrapped_forward_matches_transformers(qwen3_pair):
    plain, ours = qwen3_pair
    ktcore.wrap_model(ours, TORCH)
    ids, mask = batch()
    ref = plain(ids, attention_mask=mask, labels=ids)
    got = ours(ids, attention_mask=mask, labels=ids)
    assert relative_error(got.logits, ref.logits) <= 1e-5
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item()
    # the experts really moved: placeholders in the model, weights in the backend
    experts = ours.model.layers[0].mlp.experts
    assert is_placeholder(experts.gate_up_proj) and is_placeholder(experts.down_proj)
    assert ours.get_experts_implementation() in ("ktcore", {"": "ktcore"}) or "ktcore" in str(
        ours.get_experts_implementation())
    assert ours.num_parameters() == plain.num_parameters()
    assert ours.ktcore.packed_bytes > 0


def test_expert_lora_gradients_match_peft_on_transformers(qwen3_pair):
    plain, ours = qwen3_pair
    ktcore.wrap_model(ours, TORCH)
    a, b = peft_pair(plain, ours)
    assert_same_training_signal(a, b, *batch(1))


@pytest.mark.parametrize("kt", [{"kt_cpu_activation": "recompute"}, {"kt_config": {"kt_max_cache_depth": 1}}],
                         ids=["recompute", "cache-depth-1"])
def test_saved_activation_policies_give_the_same_gradients(qwen3_pair, kt):
    plain, ours = qwen3_pair
    cfg = {**kt, "kt_config": {**TORCH, **kt.get("kt_config", {})}}
    ktcore.wrap_model(ours, cfg)
    assert_same_training_signal(*peft_pair(plain, ours), *batch(2))
    budget = next(iter(ours.ktcore.layers.values())).budget
    assert budget.in_use == 0  # every saved context was consumed by backward


def test_disable_adapter_disables_expert_lora(qwen3_pair):
    plain, ours = qwen3_pair
    base_logits = plain(batch()[0]).logits
    ktcore.wrap_model(ours, TORCH)
    _, model = peft_pair(copy.deepcopy(plain), ours)
    ids, _ = batch()
    with torch.no_grad():
        with_lora = model(ids).logits
        with model.disable_adapter():
            without = model(ids).logits
    assert relative_error(without, base_logits) <= 1e-5
    assert relative_error(with_lora, base_logits) > 1e-3  # the (non-zero) LoRA did change the output


def test_load_model_from_checkpoint_matches(tmp_path):
    plain = tiny_qwen3_moe(seed=3)
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", TORCH, device="cpu", progress=False)
    assert set(ours.ktcore.layers) == {"model.layers.0.mlp.experts", "model.layers.2.mlp.experts"}
    assert_same_training_signal(*peft_pair(plain, ours), *batch(3))


def test_load_model_with_tied_embeddings(tmp_path):
    plain = tiny_qwen3_moe(seed=4, tie_word_embeddings=True)
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", TORCH, device="cpu", progress=False)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids, mask = batch()
    assert relative_error(ours(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits) <= 1e-5


def test_adapter_interop_both_ways(tmp_path, qwen3_pair):
    plain, ours = qwen3_pair
    ktcore.wrap_model(ours, TORCH)
    pristine = copy.deepcopy(plain)
    a, b = peft_pair(copy.deepcopy(plain), ours)
    ids, mask = batch(5)
    # ktcore-trained adapter -> plain PEFT on plain transformers
    b.save_pretrained(tmp_path / "from_ktcore")
    loaded = PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path / "from_ktcore")
    with torch.no_grad():
        assert relative_error(loaded(ids, attention_mask=mask).logits,
                              b(ids, attention_mask=mask).logits) <= 1e-5
    # plain PEFT adapter -> ktcore
    a.save_pretrained(tmp_path / "from_peft")
    ours2 = ktcore.wrap_model(copy.deepcopy(pristine), TORCH)
    loaded2 = PeftModel.from_pretrained(ours2, tmp_path / "from_peft")
    with torch.no_grad():
        assert relative_error(loaded2(ids, attention_mask=mask).logits,
                              a(ids, attention_mask=mask).logits) <= 1e-5


def test_generate_matches(qwen3_pair):
    plain, ours = qwen3_pair
    ktcore.wrap_model(ours, TORCH)
    ids = batch()[0][:1, :5]
    ref = plain.generate(ids, max_new_tokens=6, do_sample=False)
    got = ours.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ref, got)


def test_placeholders_refuse_to_be_read(qwen3_pair):
    _, ours = qwen3_pair
    ktcore.wrap_model(ours, TORCH)
    experts = ours.model.layers[0].mlp.experts
    with pytest.raises(ExpertWeightsUnavailable, match="CPU expert backend"):
        experts.gate_up_proj + 1
    with pytest.raises(ExpertWeightsUnavailable, match="ktcore export"):
        torch.save(ours.state_dict(), "/dev/null")
    with pytest.raises(ValueError, match="already wrapped"):
        ktcore.wrap_model(ours, TORCH)


def tiny_model_of(family):
    from archs import tiny_model

    return tiny_qwen3_moe(seed=6) if family == "qwen3_moe" else tiny_model(family, seed=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("backend", ["torch", "amx_bf16", "llamafile"])
def test_gpu_attention_cpu_experts_bf16(tmp_path, backend, family):
    """Attention, router, shared experts and LM head on CUDA, routed experts on a CPU backend, in bf16, with the
    copies on the side stream and (DeepSeek: shared experts after the routed ones) the backend running while
    the GPU computes the shared experts.

    bf16 tolerance: ktcore in bf16 must be about as close to the fp32 truth as plain transformers in bf16.
    """
    why = backend_unusable(backend)
    if why:
        pytest.skip(f"{backend} cannot run here: {why}")
    plain = tiny_model_of(family)
    plain.save_pretrained(tmp_path / "model")
    truth = copy.deepcopy(plain).to("cuda")
    plain_bf16 = copy.deepcopy(plain).to("cuda", torch.bfloat16)
    ours = ktcore.load_model(tmp_path / "model", {"kt_backend": backend}, device="cuda", dtype=torch.bfloat16,
                             progress=False)
    assert ours.lm_head.weight.device.type == "cuda"
    experts = next(iter(ours.ktcore.layers))
    assert ours.get_submodule(experts).gate_up_proj.device.type == "cuda"  # placeholder only
    assert all((layer.overlap is not None) == (family == "deepseek_v2") for layer in ours.ktcore.layers.values())
    truth, plain_bf16 = peft_pair(truth, plain_bf16)
    torch.manual_seed(7)
    ours = get_peft_model(ours, lora_config())
    ids, mask = (t.cuda() for t in batch(8))
    ref_grads = assert_as_close_as_plain_bf16(truth, plain_bf16, ours, ids, mask)
    assert sum("experts" in n for n in ref_grads) == 2 * 2 * 2  # expert LoRA gradients are compared too


@pytest.mark.parametrize("backend", ["torch", "amx_bf16"])
def test_bf16_backend_is_as_close_as_transformers_bf16(backend):
    """The equivalence test at bf16 tolerance (for amx_bf16: the core issue's test with kt_backend amx_bf16):
    ktcore in bf16 must be about as close to the fp32 truth as plain transformers in bf16 is."""
    why = backend_unusable(backend)
    if why:
        pytest.skip(f"{backend} cannot run here: {why}")
    plain = tiny_qwen3_moe(seed=12)
    truth = copy.deepcopy(plain)
    plain_bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    ours = ktcore.wrap_model(copy.deepcopy(plain).to(torch.bfloat16), {"kt_backend": backend})
    truth, plain_bf16 = peft_pair(truth, plain_bf16)
    torch.manual_seed(7)
    ours = get_peft_model(ours, lora_config())
    ids, mask = batch(12)
    ref_out, ref_grads = lora_grads(truth, ids, mask)
    errors = {}
    for name, model in (("plain_bf16", plain_bf16), ("ours", ours)):
        out, grads = lora_grads(model, ids, mask)
        errors[name] = (relative_error(out.logits.float(), ref_out.logits),
                        max(relative_error(grads[n].float(), ref_grads[n]) for n in ref_grads))
    assert errors["ours"][0] <= max(2 * errors["plain_bf16"][0], 1e-2), errors
    assert errors["ours"][1] <= max(2 * errors["plain_bf16"][1], 5e-2), errors
