"""Every built-in architecture against the unmodified transformers model (fp32): wrapped, and loaded back."""

import copy
import json

import pytest
import torch
from archs import FAMILIES, MOE_LAYERS, save_fp8_checkpoint, tiny_model
from peft import LoraConfig, get_peft_model

import ktcore
from ktcore.model.peft_expert_lora import lora_targets
from ktcore.testing import relative_error
from ktcore.weights.safetensors_reader import CheckpointError
from ktcore.model.wrap import find_arch

TORCH = {"kt_backend": "torch"}


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def peft_config(model):
    modules, params = lora_targets(model, find_arch(model.config), "all")
    return LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=params or None,
                      init_lora_weights=False)


def run(model, ids, mask):
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_equivalent(plain, ours, seed=0):
    ids, mask = batch(seed)
    cfg = peft_config(plain)
    torch.manual_seed(11)
    b = get_peft_model(ours, copy.deepcopy(cfg))
    torch.manual_seed(11)
    a = get_peft_model(plain, cfg)
    ref, ref_grads = run(a, ids, mask)
    got, got_grads = run(b, ids, mask)
    assert relative_error(got.logits, ref.logits) <= 1e-5
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-5 * ref.loss.item()
    assert set(got_grads) == set(ref_grads) and ref_grads
    for name, grad in ref_grads.items():
        assert relative_error(got_grads[name], grad) <= 1e-4, name
    return ref_grads


@pytest.mark.parametrize("odd", [False, True], ids=["regular", "odd-shapes"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wrapped_matches_transformers(family, odd):
    plain = tiny_model(family, odd)
    ours = ktcore.wrap_model(copy.deepcopy(plain), TORCH)
    assert sorted(ours.ktcore.layers) == [f"model.layers.{i}.mlp" + ("" if family == "llama" else ".experts")
                                          for i in MOE_LAYERS[family]]
    grads = assert_equivalent(plain, ours)
    if family != "llama":
        assert any("experts" in n for n in grads), "expert LoRA must be trained"
    else:
        assert any("mlp.gate_proj" in n for n in grads)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_load_model_from_safetensors_matches(tmp_path, family):
    plain = tiny_model(family, seed=1)
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", TORCH, device="cpu", progress=False)
    assert_equivalent(plain, ours, seed=1)


def test_list_archs_names_hf_classes():
    from click.testing import CliRunner

    from ktcore.commands.cli import main

    out = CliRunner().invoke(main, ["list-archs"]).output
    for cls in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                "MixtralForCausalLM", "LlamaForCausalLM"):
        assert cls in out


def test_deepseek_v3_group_ties():
    """Experts with identical router rows put groups in exact ties; routing (HF's) and math must still agree."""
    plain = tiny_model("deepseek_v3", seed=2)
    with torch.no_grad():
        for layer in MOE_LAYERS["deepseek_v3"]:
            gate = plain.model.layers[layer].mlp.gate
            half = gate.weight.shape[0] // 2
            gate.weight[half:] = gate.weight[:half]
            gate.e_score_correction_bias.zero_()
    assert_equivalent(plain, ktcore.wrap_model(copy.deepcopy(plain), TORCH), seed=2)


def test_fused_layout_on_disk(tmp_path):
    """transformers 5's fused gate_up_proj/down_proj tensors on disk load as well as per-expert ones."""
    from safetensors.torch import save_file

    plain = tiny_model("qwen3_moe", seed=3)
    plain.save_pretrained(tmp_path / "model")
    state = {k: v.contiguous() for k, v in plain.state_dict().items()}
    save_file(state, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    ours = ktcore.load_model(tmp_path / "model", TORCH, device="cpu", progress=False)
    assert_equivalent(plain, ours, seed=3)


def test_deepseek_v3_fp8_checkpoint_is_dequantised_while_streaming(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    plain = tiny_model("deepseek_v3", seed=4)
    state = save_fp8_checkpoint(plain, tmp_path / "model")
    plain.save_pretrained(tmp_path / "truth")
    save_file(state, tmp_path / "truth" / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "truth", dtype=torch.float32)  # dequantised truth
    ours = ktcore.load_model(tmp_path / "model", TORCH, device="cpu", progress=False)
    assert_equivalent(reference, ours, seed=4)


# ---- broken checkpoints: the intended error, before any model is returned ----------------------------


@pytest.fixture
def saved_sharded(tmp_path):
    plain = tiny_model("qwen3_moe", seed=5)
    plain.save_pretrained(tmp_path / "model", max_shard_size="50KB")
    index = tmp_path / "model" / "model.safetensors.index.json"
    assert index.is_file()
    return tmp_path / "model"


def _rewrite_index(path, fn):
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    fn(data["weight_map"])
    index.write_text(json.dumps(data))


def test_missing_tensor(saved_sharded):
    from safetensors.torch import load_file, save_file

    index = json.loads((saved_sharded / "model.safetensors.index.json").read_text())["weight_map"]
    file = saved_sharded / index["model.layers.0.self_attn.q_proj.weight"]
    tensors = load_file(file)
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    _rewrite_index(saved_sharded, lambda wm: wm.pop("model.layers.0.self_attn.q_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*missing"):
        ktcore.load_model(saved_sharded, TORCH, device="cpu", progress=False)


def test_missing_expert_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3_moe", seed=6).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.5\.down_proj\.weight.*layer 2.*missing"):
        ktcore.load_model(tmp_path / "m", TORCH, device="cpu", progress=False)


def test_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("mixtral", seed=7).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .*experts\.2\.w1\.weight.* has shape"):
        ktcore.load_model(tmp_path / "m", TORCH, device="cpu", progress=False)


def test_truncated_shard(saved_sharded):
    shard = sorted(saved_sharded.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*(truncated|unreadable)"):
        ktcore.load_model(saved_sharded, TORCH, device="cpu", progress=False)


def test_bad_index_json(saved_sharded):
    (saved_sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json: bad index JSON"):
        ktcore.load_model(saved_sharded, TORCH, device="cpu", progress=False)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_upcycled_tiny_llama_equals_dense(arch):
    from ktcore.testing.upcycle import upcycle

    dense = tiny_model("llama", seed=8)
    moe = upcycle(dense, arch, num_experts=3, top_k=2)
    ids, mask = batch(8)
    with torch.no_grad():
        want = dense(ids, attention_mask=mask).logits
        assert relative_error(moe(ids, attention_mask=mask).logits, want) <= 1e-5
        ours = ktcore.wrap_model(moe, TORCH)
        assert relative_error(ours(ids, attention_mask=mask).logits, want) <= 1e-5
    with pytest.raises(ValueError, match="upcycle supports"):
        upcycle(dense, "deepseek_v3", 4, 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_placement_rules_keep_some_layers_on_the_model_device(family):
    """kt_placement: the first MoE layer stays a plain transformers module, the other goes to a backend."""
    first, second = MOE_LAYERS[family]
    plain = tiny_model(family, seed=9)
    kt = {"kt_backend": "torch", "kt_placement": [{"match": rf"^model\.layers\.{first}\.", "device": "gpu"},
                                                  {"match": ".", "backend": "torch"}]}
    ours = ktcore.wrap_model(copy.deepcopy(plain), kt)
    suffix = "" if family == "llama" else ".experts"
    assert ours.ktcore.on_gpu == (f"model.layers.{first}.mlp{suffix}",)
    assert sorted(ours.ktcore.layers) == [f"model.layers.{second}.mlp{suffix}"]
    assert_equivalent(plain, ours, seed=9)


def test_placement_with_an_unknown_backend_names_the_choices():
    from ktcore.plugins import UnknownPluginError

    with pytest.raises(UnknownPluginError, match="Choose one of: .*torch"):
        ktcore.wrap_model(tiny_model("mixtral"), {"kt_backend": "torch",
                                                  "kt_placement": [{"match": "layers.1", "backend": "nope"}]})


def test_load_model_honours_placement(tmp_path):
    plain = tiny_model("deepseek_v2", seed=10)
    plain.save_pretrained(tmp_path / "model")
    kt = {"kt_backend": "torch", "kt_placement": [{"match": r"layers\.1\.mlp\.experts$", "device": "gpu"}]}
    ours = ktcore.load_model(tmp_path / "model", kt, device="cpu", progress=False)
    assert ours.ktcore.on_gpu == ("model.layers.1.mlp.experts",)
    assert sorted(ours.ktcore.layers) == ["model.layers.2.mlp.experts"]
    assert not ours.model.layers[1].mlp.experts.gate_up_proj.is_meta
    assert_equivalent(plain, ours, seed=10)



@pytest.mark.parametrize("family, renamed", [("deepseek_v2", True), ("deepseek_v3", True), ("qwen3_moe", True),
                                             ("qwen2_moe", False), ("llama", False)])
def test_a_linear_that_peft_would_rename_goes_by_its_weight(family, renamed):
    """PEFT 0.21 rewrites ``gate_proj``/``up_proj``/``down_proj`` in target_modules into the routed experts'
    parameters for the families it maps onto Qwen2-MoE's transformers-4 layout (DeepSeek-V2/V3, Qwen3-MoE; not
    Qwen2-MoE itself, nor dense Llama), in every form: the bare name, a full module path, a regex string. ktcore
    hands those names to PEFT as ``<name>.weight`` target_parameters, which its conversion leaves alone; where
    PEFT keeps the names, they stay target_modules."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    model = tiny_model(family)
    arch = find_arch(model.config)
    mlp = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith("gate_proj")]
    forms = [["gate_proj", "up_proj"], [p for n in mlp for p in (n, n.removesuffix("gate_proj") + "up_proj")],
             r".*\.(gate|up)_proj"]
    for form in forms:  # what the conversion does with each form of target_modules
        config = LoraConfig(target_modules=form)
        convert_peft_config_for_transformers(config, model=model, conversions=None)
        assert ("gate_up_proj" in (config.target_parameters or ())) == renamed, form  # moved onto the experts
    modules, params = lora_targets(model, arch, "o_proj,gate_proj,up_proj,experts")
    if renamed:
        assert (modules, params[-2:]) == (["o_proj"], ["gate_proj.weight", "up_proj.weight"])
        assert lora_targets(model, arch, "gate_proj") == ([], ["gate_proj.weight"])  # without up_proj too
    else:
        assert modules == ["o_proj", "gate_proj", "up_proj"]
    config = LoraConfig(target_modules=modules, target_parameters=params)
    convert_peft_config_for_transformers(config, model=model, conversions=None)
    assert (set(config.target_modules), set(config.target_parameters)) == (set(modules), set(params))


def _adapted(peft_model):
    """{path: r} of every LoRA PEFT made: a Linear's module path, or an experts module's parameter path."""
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, m in peft_model.named_modules():
        if not (hasattr(m, "lora_A") and "default" in m.lora_A):
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(m, ParamWrapper) and m.parameter_name != "weight":
            out[f"{name}.{m.parameter_name}"] = m.r["default"]
        else:
            assert isinstance(m.get_base_layer(), torch.nn.Linear)
            out[name] = m.r["default"]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_lands_where_lora_target_says_at_rank_r(family):
    """Every Linear name (attention, dense MLPs, shared experts) with the routed experts gets a LoRA of rank r
    from PEFT on exactly the modules of that name, and the experts on exactly their two parameters: what PEFT's
    transformers-4 conversion would change behind ktcore's back (the dense and shared-expert gate_proj/up_proj/
    down_proj moved onto the experts at rank 2r)."""
    model = tiny_model(family)
    arch = find_arch(model.config)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    names = sorted({n.rsplit(".", 1)[-1] for n in linears})
    experts = {arch.experts_module.format(layer=i) + "." + p for i in MOE_LAYERS[family]
               for p in arch.expert_lora_parameters}
    cases = [(",".join(names), linears | {e for e in experts if e.endswith(".down_proj") and "down_proj" in names})]
    if experts:  # dense Llama has none
        cases += [(",".join(names + ["experts"]), linears | experts), ("experts", experts),
                  ("gate_up_proj", {e for e in experts if e.endswith(".gate_up_proj")})]
    for target, want in cases:
        modules, params = lora_targets(model, arch, target)
        peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=modules or None,
                                                                     target_parameters=params or None))
        adapted = _adapted(peft_model)
        assert set(adapted) == want, target
        assert set(adapted.values()) == {4}, target


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_dense_and_shared_mlp_lora_reloads_in_plain_peft(family, tmp_path):
    """An adapter with LoRA on the dense and shared-expert MLP Linears (target_parameters ``gate_proj.weight``,
    ...) saves as plain Linear LoRA tensors, reloads in plain ``PeftModel.from_pretrained`` to identical logits,
    and merges into each Linear as ``W + (alpha / r) * B @ A``: a plain rank-r Linear LoRA."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model = tiny_model(family)
    arch = find_arch(model.config)
    modules, params = lora_targets(model, arch, "gate_proj,up_proj,down_proj,experts")
    assert "gate_proj.weight" in params
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=modules or None,
                                                  target_parameters=params, init_lora_weights=False))
    ids = torch.arange(12)[None]
    with torch.no_grad():
        want = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "adapter_model.safetensors")
    mlp = [n for n, m in tiny_model(family).named_modules() if isinstance(m, torch.nn.Linear) and
           n.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")]
    assert mlp
    for n in mlp:
        a, b = state[f"base_model.model.{n}.lora_A.weight"], state[f"base_model.model.{n}.lora_B.weight"]
        assert a.shape[0] == 4 and b.shape[1] == 4
    reloaded = PeftModel.from_pretrained(tiny_model(family), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, want, rtol=0, atol=0)
        # the same factors by hand: W + (alpha / r) * B @ A on each Linear, routed experts' LoRA merged as PEFT does
        merged = reloaded.merge_and_unload()
        base = tiny_model(family)
        for n in mlp:
            a, b = state[f"base_model.model.{n}.lora_A.weight"], state[f"base_model.model.{n}.lora_B.weight"]
            torch.testing.assert_close(merged.get_submodule(n).weight,
                                       base.get_submodule(n).weight + 2.0 * b @ a)
        assert relative_error(merged(ids).logits, want) < 1e-5


def test_one_config_object_loads_twice(tmp_path):
    """Issue 21 point 9 in this environment too (the LLaMA-Factory suite checks transformers 5.6): a frontend may
    build twice from one config object; the first load must leave it as it was (transformers 5.6 once failed the
    second with `experts_implementation="ktcore" is not supported`)."""
    from transformers import AutoConfig

    from ktcore.testing.tiny import save_tiny_chat_moe

    path = save_tiny_chat_moe(tmp_path / "model")
    config = AutoConfig.from_pretrained(path)
    before = dict(vars(config))  # with the internal attributes (_experts_implementation_internal) to_dict leaves out
    first = ktcore.load_model(path, TORCH, device="cpu", progress=False, hf_config=config)
    second = ktcore.load_model(path, TORCH, device="cpu", progress=False, hf_config=config)
    assert vars(config) == before
    ids = torch.arange(8)[None]
    with torch.no_grad():
        torch.testing.assert_close(first(ids).logits, second(ids).logits, rtol=0, atol=0)
