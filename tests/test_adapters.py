"""Adapter formats (peft, fused_expert, gguf), `ktcore adapter convert/verify`, `ktcore export`, `ktcore chat`.

Exactness: PEFT -> fused_expert -> PEFT and PEFT -> GGUF -> PEFT are bit-exact (tensors torch.equal, logits
identical); ktcore (experts on the CPU backend) vs plain PEFT on plain transformers and the merged export vs
base+adapter agree to <= 1e-5 relative error in fp32 (only the summation order differs).
"""

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from ktcore_tiny import tiny_qwen3_moe
from safetensors.torch import load_file, save_file

import ktcore
from ktcore import adapters as core
from ktcore.adapters import AdapterError
from ktcore.adapters.canonical import fuse_gate_up
from ktcore.errors import KtcoreError
from ktcore.files import sha256_file
from ktcore.commands.cli import main
from ktcore.testing import relative_error

FE = "fused_expert_lora.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
MANIFEST = "kt_adapter_manifest.json"


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (2, 11), generator=g)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Qwen3-MoE base dir and a PEFT adapter trained a few steps (attention + routed-expert LoRA)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    base = tiny_qwen3_moe(seed=0)
    base.save_pretrained(root / "base")
    other = tiny_qwen3_moe(seed=1)  # same shapes, other weights
    other.save_pretrained(root / "other_base")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(base, cfg)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(4):
        ids = _ids(step)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.peft_config["default"].base_model_name_or_path = str(root / "base")
    model.save_pretrained(root / "peft")
    state = load_file(root / "peft" / "adapter_model.safetensors")
    assert all(v.abs().sum() > 0 for k, v in state.items() if "lora_B" in k)  # trained, non-zero
    return root


def plain_logits(base, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        if adapter_dir is None:
            return model(ids).logits
        return PeftModel.from_pretrained(model, str(adapter_dir)).eval()(ids).logits


def assert_same_adapter_files(a, b):
    sa, sb = load_file(Path(a) / PEFT_WEIGHTS), load_file(Path(b) / PEFT_WEIGHTS)
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_formats_registered():
    assert {"peft", "fused_expert", "gguf"} <= set(core.format_names())


def test_peft_fused_expert_peft_round_trip(trained, tmp_path):
    run = CliRunner().invoke(main, ["adapter", "convert", str(trained / "peft"), str(tmp_path / "fe"),
                                    "--to", "fused_expert"])
    assert run.exit_code == 0, run.output
    assert core.sniff(tmp_path / "fe") == "fused_expert"
    names = load_file(tmp_path / "fe" / FE)
    # gate, up and down separate; gate/up of rank r each sharing PEFT's fused A
    assert names["layers.0.experts.gate_lora_a"].shape == (6, 4, 48)
    assert names["layers.0.experts.gate_lora_b"].shape == (6, 24, 4)
    assert names["layers.2.experts.down_lora_b"].shape == (6, 48, 4)
    assert torch.equal(names["layers.0.experts.gate_lora_a"], names["layers.0.experts.up_lora_a"])
    manifest = json.loads((tmp_path / "fe" / MANIFEST).read_text())
    assert manifest["status"] == "complete" and manifest["lora"] == {"r": 4, "alpha": 8.0, "scaling": 2.0}
    assert manifest["base_model"]["fingerprint"].startswith("sha256:")
    assert set(manifest["files"]) == {FE, "non_expert_lora.safetensors"}
    run = CliRunner().invoke(main, ["adapter", "convert", str(tmp_path / "fe"), str(tmp_path / "back")])
    assert run.exit_code == 0, run.output
    assert_same_adapter_files(trained / "peft", tmp_path / "back")  # bit-exact
    ids = _ids(9)
    ref = plain_logits(trained / "base", trained / "peft", ids)
    got = plain_logits(trained / "base", tmp_path / "back", ids)
    assert relative_error(got, ref) <= 1e-5
    assert relative_error(ref, plain_logits(trained / "base", None, ids)) > 1e-3  # the adapter matters


def test_fused_expert_dir_is_a_peft_dir_too(trained, tmp_path):
    """`convert --to fused_expert` writes the PEFT files beside the fused ones: plain PeftModel on plain transformers
    reads the directory, ktcore reads it (as fused_expert, verifying both halves), and both give the same logits."""
    fe = tmp_path / "fe"
    run = CliRunner().invoke(main, ["adapter", "convert", str(trained / "peft"), str(fe), "--to", "fused_expert"])
    assert run.exit_code == 0, run.output
    assert {FE, MANIFEST, PEFT_WEIGHTS, "adapter_config.json", "kt_integrity.json"} <= {p.name for p in fe.iterdir()}
    assert core.sniff(fe) == "fused_expert"
    assert set(json.loads((fe / MANIFEST).read_text())["peft_files"]) == {
        PEFT_WEIGHTS, "adapter_config.json", "kt_integrity.json"}
    assert_same_adapter_files(trained / "peft", fe)  # the PEFT half is the source adapter, bit for bit
    run = CliRunner().invoke(main, ["adapter", "verify", str(fe), "--base", str(trained / "base")])
    assert run.exit_code == 0 and "the same LoRA tensors as the fused files" in run.output, run.output
    ids = _ids(4)
    plain = plain_logits(trained / "base", fe, ids)
    model = ktcore.load_model(trained / "base", {"kt_backend": "torch"}, progress=False)
    model = core.load_adapter_into(model, fe, base=trained / "base").eval()
    with torch.no_grad():
        ours = model(ids).logits
    assert relative_error(ours, plain) <= 1e-5
    assert relative_error(plain, plain_logits(trained / "base", None, ids)) > 1e-3  # the adapter matters


def test_fused_expert_halves_that_differ_are_refused(good_fe, other_peft, tmp_path):
    """PEFT files swapped for another adapter's, the manifest's hashes made to match: `adapter verify` refuses."""
    d = tmp_path / "fe"
    shutil.copytree(good_fe, d)
    shutil.copy(other_peft / PEFT_WEIGHTS, d / PEFT_WEIGHTS)
    from ktcore.adapters.integrity import write_sidecar

    write_sidecar(d, ("adapter_config.json", PEFT_WEIGHTS))
    manifest = json.loads((d / MANIFEST).read_text())
    for name in manifest["peft_files"]:
        manifest["peft_files"][name] = {"size": (d / name).stat().st_size, "sha256": sha256_file(d / name)}
    (d / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(AdapterError, match="different LoRA tensors"):
        core.verify(d)


def test_peft_gguf_peft_round_trip(trained, tmp_path):
    import gguf

    out = tmp_path / "adapter.gguf"
    run = CliRunner().invoke(main, ["adapter", "convert", str(trained / "peft"), str(out), "--to", "gguf"])
    assert run.exit_code == 0, run.output
    reader = gguf.GGUFReader(str(out))

    def field(key):
        f = reader.get_field(key)
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else float(v[0])

    assert field("general.type") == "adapter" and field("adapter.type") == "lora"
    assert field("adapter.lora.alpha") == 8.0 and field("general.architecture") == "qwen3moe"
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml ne order
    assert shapes["blk.0.attn_q.weight.lora_a"] == (48, 4)        # [in, r]
    assert shapes["blk.0.attn_q.weight.lora_b"] == (4, 48)        # [r, out]
    assert shapes["blk.0.ffn_gate_exps.weight.lora_a"] == (48, 4, 6)   # [H, r, E] vs base ne [H, I, E]
    assert shapes["blk.0.ffn_up_exps.weight.lora_b"] == (4, 24, 6)     # [r, I, E]
    assert shapes["blk.2.ffn_down_exps.weight.lora_a"] == (24, 4, 6)   # [I, r, E] vs base ne [I, H, E]
    assert core.sniff(out) == "gguf"
    run = CliRunner().invoke(main, ["adapter", "convert", str(out), str(tmp_path / "back"), "--to", "peft"])
    assert run.exit_code == 0, run.output
    assert_same_adapter_files(trained / "peft", tmp_path / "back")
    ids = _ids(3)
    assert relative_error(plain_logits(trained / "base", tmp_path / "back", ids),
                          plain_logits(trained / "base", trained / "peft", ids)) <= 1e-5


def test_separate_gate_up_fuse_to_rank_2r_exactly():
    g = torch.Generator().manual_seed(0)
    ga, gb, ua, ub = (torch.randn(s, generator=g) for s in [(3, 2, 8), (3, 5, 2), (3, 2, 8), (3, 5, 2)])
    a, b, rank = fuse_gate_up((ga, gb), (ua, ub))
    assert rank == 4 and a.shape == (3, 4, 8) and b.shape == (3, 10, 4)
    assert torch.allclose(torch.bmm(b, a), torch.cat([gb @ ga, ub @ ua], 1), atol=1e-6)
    a, b, rank = fuse_gate_up((ga, gb), (ga.clone(), ub))
    assert rank == 2 and torch.equal(b, torch.cat([gb, ub], 1))


def test_ktcore_adapter_matches_plain_peft(trained, tmp_path):
    """An adapter dir written by ktcore loads in plain PeftModel on plain transformers; ktcore gives the same logits."""
    core.convert(trained / "peft", tmp_path / "fe", "fused_expert")
    core.convert(tmp_path / "fe", tmp_path / "peft", "peft")  # written by ktcore
    ids = _ids(5)
    ref = plain_logits(trained / "base", tmp_path / "peft", ids)
    model = ktcore.load_model(trained / "base", {"kt_backend": "torch"}, progress=False)
    model = core.load_adapter_into(model, tmp_path / "fe", base=trained / "base").eval()
    with torch.no_grad():
        got = model(ids).logits
    assert relative_error(got, ref) <= 1e-5


def test_export_merged_loads_in_plain_transformers(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "export.yaml"
    cfg.write_text(f"model_name_or_path: {trained / 'base'}\nadapter_name_or_path: {trained / 'peft'}\n"
                   "use_kt: true\nkt_config:\n  kt_backend: torch\n")
    out = tmp_path / "merged"
    run = CliRunner().invoke(main, ["export", str(cfg), "--out", str(out), "--shard-size", "0.0001"])
    assert run.exit_code == 0, run.output
    summary = json.loads(run.output[run.output.index("{"):])
    assert summary["shards"] > 1 and summary["tensors_merged"] > 0
    assert (out / "model.safetensors.index.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]  # no temp dir left
    ids = _ids(7)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out)(ids).logits
    model = ktcore.load_model(trained / "base", {"kt_backend": "torch"}, progress=False)
    model = core.load_adapter_into(model, trained / "peft", base=trained / "base").eval()
    with torch.no_grad():
        ours = model(ids).logits
    assert relative_error(merged, ours) <= 1e-5


# ---- fail closed -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_fe(trained):
    core.convert(trained / "peft", trained / "fe_good", "fused_expert")
    return trained / "fe_good"


def _rehash(d: Path, name: str):
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["files"][name] = {"size": (d / name).stat().st_size, "sha256": sha256_file(d / name)}
    (d / MANIFEST).write_text(json.dumps(manifest))


def _edit_manifest(d: Path, **changes):
    manifest = json.loads((d / MANIFEST).read_text())
    manifest.update(changes)
    (d / MANIFEST).write_text(json.dumps(manifest))


def _retensor(d: Path, change):
    state = load_file(d / FE)
    key = "layers.0.experts.down_lora_a"
    state[key] = change(state[key])
    save_file(state, str(d / FE))
    _rehash(d, FE)


def _layer99(d: Path):
    """layers.99 expert LoRA added and the manifest rewritten to match: only the base model tells."""
    from ktcore.adapters.locate import safetensors_header

    state = load_file(d / FE)
    state.update({k.replace("layers.0.", "layers.99."): v.clone() for k, v in state.items() if k.startswith("layers.0.")})
    save_file(state, str(d / FE))
    _rehash(d, FE)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["tensors"][FE] = safetensors_header(d / FE)
    (d / MANIFEST).write_text(json.dumps(manifest))


def strip_offsets(f: Path):
    """A safetensors file whose header entries lose data_offsets (its size kept)."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for meta in header.values():
        if isinstance(meta, dict):
            meta.pop("data_offsets", None)
    f.write_bytes(raw[:8] + json.dumps(header).encode().ljust(n) + raw[8 + n:])


def _strip_offsets(d: Path):
    strip_offsets(d / FE)
    _rehash(d, FE)  # the manifest agrees: only the header check can tell


def _nan_fe(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


CASES = {
    "nan, manifest rehashed": (lambda d: _retensor(d, _nan_fe), "NaN or Inf"),
    "layers.99, manifest rewritten": (lambda d: _layer99(d), "layers.99.mlp.experts.*no such module"),
    "experts_module not a module path": (lambda d: _edit_manifest(d, experts_module="../../etc.layers.{layer}.experts"),
                                         "not a module path"),
    "manifest is a list": (lambda d: (d / MANIFEST).write_text("[1, 2]"), "must be a JSON object"),
    "files is a list": (lambda d: _edit_manifest(d, files=[FE]), "files must be an object"),
    "header without data_offsets": (lambda d: _strip_offsets(d), "data_offsets"),
    "missing manifest": (lambda d: (d / MANIFEST).unlink(), "missing kt_adapter_manifest.json"),
    "missing file": (lambda d: (d / "non_expert_lora.safetensors").unlink(), "missing"),
    "extra file": (lambda d: (d / "notes.txt").write_text("x"), "extra file"),
    "tampered": (lambda d: (d / FE).write_bytes((d / FE).read_bytes()[:-4] + b"\0\0\0\1"), "SHA-256"),
    "truncated": (lambda d: (d / FE).write_bytes((d / FE).read_bytes()[:-8]), "size"),
    "shape": (lambda d: _retensor(d, lambda t: t[:, :, :-1].contiguous()), "has shape"),
    "dtype": (lambda d: _retensor(d, lambda t: t.half()), "has dtype"),
    "status": (lambda d: _edit_manifest(d, status="writing"), "status"),
    "version": (lambda d: _edit_manifest(d, version=99), "version"),
    "rank in manifest": (lambda d: _edit_manifest(d, lora={"r": 8, "alpha": 8.0}), "rank-8"),
    "alpha in manifest": (lambda d: _edit_manifest(d, lora={"r": 4, "alpha": 16.0}), "disagree"),
    "folder escapes": (lambda d: _edit_manifest(d, adapter_folder="../elsewhere"), "leaves the adapter root"),
    "absolute folder": (lambda d: _edit_manifest(d, adapter_folder="/tmp"), "relative path"),
    "tampered PEFT weights": (lambda d: (d / PEFT_WEIGHTS).write_bytes((d / PEFT_WEIGHTS).read_bytes()[:-4] + b"\0\0\0\1"),
                              "adapter_model.safetensors: SHA-256"),
    "PEFT config edited": (lambda d: (d / "adapter_config.json").write_text(
        (d / "adapter_config.json").read_text().replace('"r": 4', '"r": 4 ')), "adapter_config.json: size"),
    "PEFT files not in the manifest": (lambda d: _edit_manifest(d, peft_files={}), "extra file"),
    "PEFT file missing": (lambda d: (d / "kt_integrity.json").unlink(), "kt_integrity.json: missing"),
    "symlinked file": (lambda d: ((d / "real.bin").write_bytes((d / FE).read_bytes()), (d / FE).unlink(),
                                  (d / FE).symlink_to(d / "real.bin")), "symlink"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_expert_fails_closed(good_fe, tmp_path, case):
    d = tmp_path / "fe"
    shutil.copytree(good_fe, d)
    breaker, message = CASES[case]
    breaker(d)
    with pytest.raises(AdapterError, match=message):
        core.load(d)
    run = CliRunner().invoke(main, ["adapter", "verify", str(d)])
    assert run.exit_code == 2 and "error:" in run.output


def test_sha256_file_reads_every_byte_of_a_multi_mib_file(tmp_path):
    """Adapter files are hashed whole: a one-bit change far past the first MiB of a 3 MiB file shows."""
    data = bytearray(random.Random(0).randbytes(3 * 2**20 + 12345))
    path = tmp_path / "big.safetensors"
    path.write_bytes(data)
    before = sha256_file(path)
    assert before == hashlib.sha256(data).hexdigest()
    data[2 * 2**20 + 777] ^= 1
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest() != before


def test_fused_expert_other_base_rank_alpha(good_fe, trained):
    fmt = core.get_format("fused_expert")
    assert len(fmt.verify(good_fe, base=trained / "base")) >= 5
    with pytest.raises(AdapterError, match="other base model"):
        core.load(good_fe, base=trained / "other_base")
    with pytest.raises(AdapterError, match="r=8 was asked"):
        fmt.load(good_fe, expect_r=8)
    with pytest.raises(AdapterError, match="alpha=16 was asked"):
        fmt.load(good_fe, expect_alpha=16)


def test_symlinked_adapter_dir_and_hub_id(good_fe, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(good_fe)
    with pytest.raises(AdapterError, match="symlink"):
        core.load(link)
    with pytest.raises(AdapterError, match="Hub ID.*download it first"):
        core.load("some-org/some-adapter")
    run = CliRunner().invoke(main, ["adapter", "verify", "some-org/some-adapter"])
    assert run.exit_code == 2 and "download it first" in run.output


@pytest.mark.parametrize("command", [["chat", "--prompt", "hi"], ["train", "--frontend", "trl"]])
def test_hub_adapter_id_is_refused_before_the_model(trained, tmp_path, command):
    """`ktcore chat` and `ktcore train` refuse a Hub adapter ID in one line (exit 2) before the model is read;
    chat before it even looks for the model (its path here does not exist, the error is still the adapter's)."""
    cfg = tmp_path / "cfg.yaml"
    model = tmp_path / "no-model" if command[0] == "chat" else trained / "base"
    cfg.write_text(f"model_name_or_path: {model}\nadapter_name_or_path: some-org/some-adapter\n"
                   f"use_kt: true\noutput_dir: {tmp_path / 'out'}\ndataset: identity\nkt_config:\n  kt_backend: torch\n")
    run = CliRunner().invoke(main, [command[0], str(cfg), *command[1:]])
    lines = run.stderr.strip().splitlines()
    assert run.exit_code == 2 and len(lines) == 1, run.output
    assert "some-org/some-adapter" in lines[0] and "download it first" in lines[0], lines[0]


def test_adapter_verify_prints_checks(good_fe, trained):
    run = CliRunner().invoke(main, ["adapter", "verify", str(good_fe), "--base", str(trained / "base")])
    assert run.exit_code == 0, run.output
    assert "fused_expert adapter OK" in run.output
    for word in ("SHA-256", "shapes and dtypes", "r=4, alpha=8", "fingerprint matches"):
        assert word in run.output
    run = CliRunner().invoke(main, ["adapter", "verify", str(trained / "peft")])  # saved by plain PEFT
    assert run.exit_code == 0 and "peft adapter OK" in run.output and "matches a module and weight shape" in run.output
    assert "NOTE" in run.output and "no integrity record" in run.output


def test_gguf_fails_closed(trained, tmp_path):
    import gguf

    good = core.convert(trained / "peft", tmp_path / "a.gguf", "gguf")["dst"]
    with pytest.raises(AdapterError, match="other base model"):
        core.load(good, base=trained / "other_base")
    # a GGUF that is not an adapter, and one with half a pair
    for name, kind, tensors, message in [
            ("model.gguf", "model", {"blk.0.attn_q.weight.lora_a": (4, 48)}, "not 'adapter'"),
            ("half.gguf", "adapter", {"blk.0.attn_q.weight.lora_a": (4, 48)}, "missing one component")]:
        w = gguf.GGUFWriter(str(tmp_path / name), "qwen3moe")
        w.add_string("general.type", kind)
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", 8.0)
        for t, shape in tensors.items():
            w.add_tensor(t, torch.zeros(shape).numpy())
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        with pytest.raises(AdapterError, match=message):
            core.load(tmp_path / name, base=trained / "base")


def test_unsupported_peft_config_refused(trained, tmp_path):
    shutil.copytree(trained / "peft", tmp_path / "dora")
    cfg = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="use_dora"):
        core.load(tmp_path / "dora")


# ---- ktcore chat -------------------------------------------------------------------------------------------

IDENTITY_PROMPTS = ("hi", "Who are you?")


@pytest.fixture(scope="module")
def identity_run(tmp_path_factory, shared_data):
    """The demo's tiny model trained through `ktcore train` on two identity examples (name: KTBot).

    Both examples are in every batch and the learning rate warms up, then decays to zero (cosine), so the run
    settles: loss 0.157 at step 80 on the LLaMA-Factory demo data, 0.140 on the generated data, the same on
    every run. (At a constant 1e-2 it reached 0.14 by step 52, then bounced up to 0.70 by step 120.)
    """
    from ktcore.commands.demo import build_demo_files

    root = tmp_path_factory.mktemp("identity")
    records = {d["instruction"]: d for d in json.loads((shared_data / "identity.json").read_text())}
    data = [{**records[p], "output": records[p]["output"].replace("{{name}}", "KTBot").replace("{{author}}", "KT Lab")}
            for p in IDENTITY_PROMPTS]
    (root / "data").mkdir()
    (root / "data" / "identity_kt.json").write_text(json.dumps(data))
    (root / "data" / "dataset_info.json").write_text(json.dumps({"identity_kt": {"file_name": "identity_kt.json"}}))
    files = build_demo_files(root / "run", steps=80, n_train=8, dataset="identity_kt", dataset_dir=str(root / "data"),
                             cutoff_len=128, per_device_train_batch_size=2, learning_rate=5e-3, warmup_steps=8,
                             lr_scheduler_type="cosine", plot_loss=False, max_samples=8,
                             kt_config={"kt_backend": "torch"})
    run = CliRunner().invoke(main, ["train", str(files["config"])])
    assert run.exit_code == 0, run.output
    adapter = Path(json.loads(run.output[run.output.index("{"):])["output_dir"])
    return {**files, "adapter": adapter, "answers": {d["instruction"]: d["output"] for d in data}}


def answer_log_probs(model, tokenizer, prompt: str, answer: str):
    """Teacher-forced: the log-probability of each token of ``answer`` (its end-of-turn token included) after
    the chat prompt and the answer's earlier tokens, and whether each is the model's most likely token there."""
    turn = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids = tokenizer.apply_chat_template(turn + [{"role": "assistant", "content": answer}],
                                        return_dict=True)["input_ids"]
    assert ids[:len(head)] == head
    ids = torch.tensor([ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, len(head) - 1:-1].float(), dim=-1)
    target = ids[0, len(head):]
    return log_probs.gather(1, target[:, None])[:, 0], log_probs.argmax(-1) == target


def test_chat_prints_the_base_models_greedy_answer(identity_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ktcore.commands.demo import generate_answers

    run = CliRunner().invoke(main, ["chat", str(identity_run["config"]), "--prompt", "abcde", "max_new_tokens=6"])
    assert run.exit_code == 0, run.output
    model_dir = identity_run["model_dir"]
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # the experts computed by transformers
    (want,) = generate_answers(plain, AutoTokenizer.from_pretrained(model_dir), ["abcde"], max_new_tokens=6)
    assert want.strip() and run.output.strip() == want.strip()


@pytest.mark.parametrize("fmt", ["peft", "fused_expert"])
def test_identity_adapter_makes_the_trained_answers_likely(identity_run, tmp_path, fmt):
    """Loaded as `ktcore chat` loads it (a fused-expert artifact sniffed and validated against the base), the
    adapter gives each trained answer a high teacher-forced probability, token by token the most likely one.
    Measured: mean log-probability per answer token -0.157 / -0.153 (demo data; -0.141 / -0.140 generated),
    untrained model -6.1; the least likely answer token has p = 0.58 (0.67 generated)."""
    from ktcore.commands.chat import load_for_chat
    from ktcore.config import load_config

    adapter = identity_run["adapter"]
    if fmt == "fused_expert":
        adapter = core.convert(adapter, tmp_path / "fe", "fused_expert")["dst"]
    config = identity_run["config"]
    base, tokenizer = load_for_chat(load_config(config, quiet=True))
    tuned, _ = load_for_chat(load_config(config, [f"adapter_name_or_path={adapter}"], quiet=True))
    for prompt, answer in identity_run["answers"].items():
        untrained, _ = answer_log_probs(base, tokenizer, prompt, answer)
        trained, top = answer_log_probs(tuned, tokenizer, prompt, answer)
        assert untrained.mean() < -4.0, (prompt, untrained.mean())
        assert trained.mean() > -0.5, (prompt, trained.mean())
        assert top.all(), (prompt, trained.exp())


def test_chat_with_identity_adapter_answers_with_the_name(identity_run):
    """Every token of the trained answer is the most likely one (the test above), so greedy chat prints it whole."""
    answer = identity_run["answers"]["hi"]
    assert "KTBot" in answer
    run = CliRunner().invoke(main, ["chat", str(identity_run["config"]), "--prompt", "hi",
                                    f"adapter_name_or_path={identity_run['adapter']}", "max_new_tokens=120"])
    assert run.exit_code == 0, run.output
    assert run.output.strip() == answer


def test_convert_never_replaces_an_unrelated_directory(trained, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("precious")
    with pytest.raises(KtcoreError, match="was not written by `ktcore adapter convert`"):
        core.convert(trained / "peft", tmp_path / "docs", "fused_expert")
    assert (tmp_path / "docs" / "thesis.tex").read_text() == "precious"


# ---- tamper suites: peft and gguf adapters written by ktcore, and the same files without their record -------


def _verify_refuses(path, message, base=None):
    """`ktcore adapter verify` and every load refuse ``path`` with one line (exit 2) matching ``message``."""
    with pytest.raises(AdapterError, match=message):
        core.load(path, base=base)
    run = CliRunner().invoke(main, ["adapter", "verify", str(path)] + (["--base", str(base)] if base else []))
    assert run.exit_code == 2, run.output
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), run.stderr
    assert __import__("re").search(message, lines[0]), lines[0]


@pytest.fixture(scope="module")
def ktcore_peft(trained):
    """A PEFT adapter directory written by ktcore (with its kt_integrity.json)."""
    return Path(core.convert(trained / "peft", trained / "peft_by_ktcore", "peft")["dst"])


def _restate(d: Path, change):
    state = load_file(d / PEFT_WEIGHTS)
    change(state)
    save_file(state, str(d / PEFT_WEIGHTS), metadata={"format": "pt"})


def _reconfig(d: Path, **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q0B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _flip_byte(f: Path, offset_from_end=5):
    data = bytearray(f.read_bytes())
    data[-offset_from_end] ^= 0x40
    f.write_bytes(bytes(data))


def _extra_layer(state):
    state[Q0A.replace("layers.0.", "layers.99.")] = state[Q0A].clone()
    state[Q0B.replace("layers.0.", "layers.99.")] = state[Q0B].clone()


def _cut_rank(d: Path):
    _restate(d, lambda s: s.update({k: (v[:2] if ".lora_A." in k else v[:, :2]).contiguous()
                                    for k, v in s.items() if "experts" not in k}))
    _reconfig(d, r=2)


def _swap_in(d: Path, other: Path):
    mine, theirs = load_file(d / PEFT_WEIGHTS), load_file(other / PEFT_WEIGHTS)
    mine[Q0B] = theirs[Q0B]
    save_file(mine, str(d / PEFT_WEIGHTS), metadata={"format": "pt"})


PEFT_TAMPER = {  # case -> (change, message); every change leaves a file plain PEFT would read
    "flipped byte": (lambda d, o: _flip_byte(d / PEFT_WEIGHTS), "SHA-256"),
    "alpha 8 -> 160": (lambda d, o: _reconfig(d, lora_alpha=160), "adapter_config.json: size .* kt_integrity.json"),
    "cut rank": (lambda d, o: _cut_rank(d), "kt_integrity.json"),
    "nan tensor": (lambda d, o: _restate(d, lambda s: s[Q0B].view(-1).__setitem__(0, float("nan"))), "SHA-256"),
    "swapped tensor": (lambda d, o: _swap_in(d, o), "SHA-256"),
    "extra layer 99": (lambda d, o: _restate(d, _extra_layer), "adapter_model.safetensors: size .* kt_integrity"),
    "record not json": (lambda d, o: (d / "kt_integrity.json").write_text("{"), "not valid JSON"),
    "record drops a file": (lambda d, o: (d / "kt_integrity.json").write_text(json.dumps(
        {**json.loads((d / "kt_integrity.json").read_text()), "files": {}})), "does not list"),
    "pickle only": (lambda d, o: ((d / PEFT_WEIGHTS).rename(d / "adapter_model.bin")), "pickle"),
}
# without the record (what another tool writes): the content checks alone refuse these
FOREIGN_PEFT_TAMPER = {
    "nan tensor": (lambda d, o: _restate(d, lambda s: s[Q0B].view(-1).__setitem__(0, float("nan"))), "NaN"),
    "inf tensor": (lambda d, o: _restate(d, lambda s: s[Q0A].view(-1).__setitem__(3, float("inf"))), "NaN or Inf"),
    "extra layer 99": (lambda d, o: _restate(d, _extra_layer), "layers.99.self_attn.q_proj.*no such module"),
    "not a module path": (lambda d, o: _restate(d, lambda s: s.update(
        {"base_model.model.../../etc/passwd.lora_A.weight": s.pop(Q0A),
         "base_model.model.../../etc/passwd.lora_B.weight": s.pop(Q0B)})), "not a module path"),
    "cut rank in config only": (lambda d, o: _reconfig(d, r=2), "does not match the base weight"),
    "alpha negative": (lambda d, o: _reconfig(d, lora_alpha=-16), "lora_alpha must be a number > 0"),
    "rank not a number": (lambda d, o: _reconfig(d, r="sixteen"), "r must be an integer > 0"),
    "config not json": (lambda d, o: (d / "adapter_config.json").write_text("{r: 4"), "not valid JSON"),
    "truncated weights": (lambda d, o: (d / PEFT_WEIGHTS).write_bytes((d / PEFT_WEIGHTS).read_bytes()[:-100]),
                          "truncated"),
    "base is a file": (lambda d, o: _reconfig(d, base_model_name_or_path=str(d / "adapter_config.json")), None),
}


@pytest.mark.parametrize("case", sorted(PEFT_TAMPER))
def test_peft_written_by_ktcore_refuses_tampering(ktcore_peft, other_peft, tmp_path, case):
    d = tmp_path / "peft"
    shutil.copytree(ktcore_peft, d)
    change, message = PEFT_TAMPER[case]
    change(d, other_peft)
    _verify_refuses(d, message)


@pytest.fixture(scope="module")
def other_peft(trained):
    """A second adapter of the same shapes (other values), to swap tensors in from."""
    state = load_file(trained / "peft" / PEFT_WEIGHTS)
    shutil.copytree(trained / "peft", trained / "peft_other")
    save_file({k: v + 1 for k, v in state.items()}, str(trained / "peft_other" / PEFT_WEIGHTS),
              metadata={"format": "pt"})
    return trained / "peft_other"


@pytest.mark.parametrize("case", sorted(FOREIGN_PEFT_TAMPER))
def test_peft_without_record_is_checked_before_use(trained, other_peft, tmp_path, case):
    d = tmp_path / "peft"
    shutil.copytree(trained / "peft", d)  # saved by plain PEFT: no kt_integrity.json
    change, message = FOREIGN_PEFT_TAMPER[case]
    change(d, other_peft)
    if message is None:  # base_model_name_or_path names a file: never read as a config, the adapter still loads
        assert core.load(d).r == 4
        return
    _verify_refuses(d, message)


def test_ktcore_peft_record_verifies_and_plain_peft_ignores_it(ktcore_peft, trained):
    assert (ktcore_peft / "kt_integrity.json").is_file()
    run = CliRunner().invoke(main, ["adapter", "verify", str(ktcore_peft)])
    assert run.exit_code == 0, run.output
    assert "kt_integrity.json: adapter_config.json, adapter_model.safetensors sizes and SHA-256 match" in run.output
    assert "NOTE" not in run.output
    ids = _ids(4)
    assert relative_error(plain_logits(trained / "base", ktcore_peft, ids),
                          plain_logits(trained / "base", trained / "peft", ids)) <= 1e-5


# gguf: rewritten with the gguf package the way an editor would (every key and tensor copied, some changed)

def _rewrite_gguf(src: Path, dst: Path, *, meta=None, tensors=None, drop=()):
    import gguf

    reader = gguf.GGUFReader(str(src))
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("GGUF.")}
    fields.update(meta or {})
    arrays = {t.name: torch.from_numpy(t.data.copy()).reshape([int(x) for x in reversed(list(t.shape))])
              for t in reader.tensors}
    if tensors:
        tensors(arrays)
    w = gguf.GGUFWriter(str(dst), fields.pop("general.architecture"))
    for key, value in fields.items():
        if key in drop:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, float(value))
    for name, t in arrays.items():
        w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


@pytest.fixture(scope="module")
def ktcore_gguf(trained):
    return Path(core.convert(trained / "peft", trained / "by_ktcore.gguf", "gguf")["dst"])


def _tmap_edit(path, change):
    import gguf

    reader = gguf.GGUFReader(str(path))
    tmap = json.loads(reader.get_field("ktcore.adapter.tensor_map").contents())
    change(tmap)
    return {"ktcore.adapter.tensor_map": json.dumps(tmap)}


def _remap_layer(tmap):
    tmap["blk.0.attn_q.weight"], tmap["blk.1.attn_q.weight"] = tmap["blk.1.attn_q.weight"], tmap["blk.0.attn_q.weight"]


def _nan(arrays):
    arrays["blk.0.attn_q.weight.lora_b"].view(-1)[0] = float("nan")


def _extra_blk(arrays):
    arrays["blk.99.attn_q.weight.lora_a"] = arrays["blk.0.attn_q.weight.lora_a"].clone()
    arrays["blk.99.attn_q.weight.lora_b"] = arrays["blk.0.attn_q.weight.lora_b"].clone()


def _cut_gguf_rank(arrays):
    for k in list(arrays):
        arrays[k] = (arrays[k][..., :2, :] if k.endswith("lora_a") else arrays[k][..., :2]).contiguous()


PASSWD = {"ktcore.adapter.tensor_map": None}  # filled per file: one module renamed ../../etc/passwd
GGUF_TAMPER = {  # case -> (rewrite kwargs builder, message with the record, message without it)
    "alpha 8 -> 160": (lambda p: {"meta": {"adapter.lora.alpha": 160.0}}, "metadata", None),
    "layer remap in tensor_map": (lambda p: {"meta": _tmap_edit(p, _remap_layer)}, "metadata", None),
    "tensor_map ../../etc/passwd": (lambda p: {"meta": _tmap_edit(p, lambda t: t.update(
        {"blk.0.attn_q.weight": "../../etc/passwd"}))}, "metadata", "not a module path"),
    "tensor_map not json": (lambda p: {"meta": {"ktcore.adapter.tensor_map": "{blk"}}, "metadata",
                            "tensor_map is not valid JSON"),
    "nan tensor": (lambda p: {"tensors": _nan}, "blk.0.attn_q.weight.lora_b.*differs", "NaN"),
    "extra blk.99": (lambda p: {"tensors": _extra_blk}, "blk.99.*not recorded", "match no module"),
    "cut rank": (lambda p: {"tensors": _cut_gguf_rank}, "differs", None),
    "swapped tensor": (lambda p: {"tensors": lambda a: a.update(
        {"blk.0.attn_q.weight.lora_b": a["blk.0.attn_q.weight.lora_b"] + 1})}, "differs", None),
}


@pytest.mark.parametrize("case", sorted(GGUF_TAMPER))
def test_gguf_written_by_ktcore_refuses_tampering(ktcore_gguf, trained, tmp_path, case):
    build, with_record, without_record = GGUF_TAMPER[case]
    _verify_refuses(_rewrite_gguf(ktcore_gguf, tmp_path / "t.gguf", **build(ktcore_gguf)), with_record)
    foreign = _rewrite_gguf(ktcore_gguf, tmp_path / "f.gguf", **build(ktcore_gguf),
                            drop=("ktcore.adapter.integrity",))
    if without_record is not None:
        _verify_refuses(foreign, without_record)
    else:  # nothing tells these from a real adapter once the record is gone: loaded after the content checks
        run = CliRunner().invoke(main, ["adapter", "verify", str(foreign)])
        assert run.exit_code == 0 and "NOTE" in run.output and "no integrity record" in run.output, run.output


def test_gguf_record_verifies_and_partial_file_is_one_line(ktcore_gguf, tmp_path):
    run = CliRunner().invoke(main, ["adapter", "verify", str(ktcore_gguf)])
    assert run.exit_code == 0, run.output
    assert "ktcore.adapter.integrity matches" in run.output and "NOTE" not in run.output
    untouched = _rewrite_gguf(ktcore_gguf, tmp_path / "same.gguf")  # a faithful copy keeps verifying
    assert CliRunner().invoke(main, ["adapter", "verify", str(untouched)]).exit_code == 0
    part = tmp_path / "part.gguf"
    part.write_bytes(ktcore_gguf.read_bytes()[: ktcore_gguf.stat().st_size // 2])
    _verify_refuses(part, "not a readable GGUF")
    _flipped = tmp_path / "flip.gguf"
    shutil.copy(ktcore_gguf, _flipped)
    _flip_byte(_flipped, 9)
    _verify_refuses(_flipped, "differs")


@pytest.fixture(scope="module")
def dense_mlp_peft(tmp_path_factory):
    """A tiny DeepSeek-V2 (layer 0 a dense MLP, layers 1-2 MoE with shared experts) base dir and a PEFT adapter
    with LoRA on every Linear ktcore's `lora_target` names, the dense and shared-expert gate/up/down_proj included
    (target_parameters `gate_proj.weight`, ...: PEFT would move those names onto the routed experts), and on the
    routed experts: random non-zero factors, as trained ones would be."""
    from archs import tiny_model
    from peft import LoraConfig, get_peft_model

    from ktcore.model.peft_expert_lora import lora_targets
    from ktcore.model.wrap import find_arch

    root = tmp_path_factory.mktemp("dense_mlp")
    base = tiny_model("deepseek_v2")
    base.save_pretrained(root / "base")
    modules, params = lora_targets(base, find_arch(base.config), "q_proj,o_proj,gate_proj,up_proj,down_proj,experts")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=params,
                                            init_lora_weights=False))
    model.peft_config["default"].base_model_name_or_path = str(root / "base")
    model.save_pretrained(root / "peft")
    return root


def test_dense_and_shared_mlp_lora_converts_exactly(dense_mlp_peft, tmp_path):
    """The dense and shared-expert MLP LoRA goes through every format bit-exactly (fused_expert's non-expert
    half, GGUF's blk.L.ffn_{gate,up,down}.weight and ffn_*_shexp.weight pairs) and back to a PEFT directory that
    plain PEFT loads to the same logits; ktcore computes them too."""
    import gguf

    root = dense_mlp_peft
    state = load_file(root / "peft" / PEFT_WEIGHTS)
    for key in ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj"):
        assert state[f"base_model.model.{key}.lora_A.weight"].shape[0] == 4
    ids = _ids(4)
    ref = plain_logits(root / "base", root / "peft", ids)
    assert relative_error(ref, plain_logits(root / "base", None, ids)) > 1e-3
    core.convert(root / "peft", tmp_path / "fe", "fused_expert")
    core.convert(tmp_path / "fe", tmp_path / "from_fe", "peft")
    core.convert(root / "peft", tmp_path / "adapter.gguf", "gguf")
    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "adapter.gguf")).tensors}
    assert {"blk.0.ffn_gate.weight.lora_a", "blk.0.ffn_down.weight.lora_b", "blk.1.ffn_gate_shexp.weight.lora_a",
            "blk.2.ffn_down_shexp.weight.lora_b", "blk.1.ffn_gate_exps.weight.lora_a"} <= names
    core.convert(tmp_path / "adapter.gguf", tmp_path / "from_gguf", "peft")
    for back in ("from_fe", "from_gguf"):
        assert_same_adapter_files(root / "peft", tmp_path / back)
        assert relative_error(plain_logits(root / "base", tmp_path / back, ids), ref) <= 1e-6, back
    model = ktcore.load_model(root / "base", {"kt_backend": "torch"}, progress=False)
    model = core.load_adapter_into(model, tmp_path / "fe", base=root / "base").eval()
    with torch.no_grad():
        assert relative_error(model(ids).logits, ref) <= 1e-5
