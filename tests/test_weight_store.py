"""Weight stores (issue 22 items 2-3): ``ktcore convert MODEL_DIR`` into a store, and loading from it.

Oracles: the model loaded straight from its checkpoint (a bf16 store must give the same logits bit for bit),
a checkpoint holding ``ktcore.experts.int8``'s quantise-dequantise of the experts (an int8 store must give its
logits bit for bit), the dequantised FP8 weights (for an FP8 DeepSeek-V3 checkpoint); every broken store fails
with one line naming its file; a conversion SIGKILLed part way resumes without rewriting finished files and ends
with the same files as an uninterrupted one; an ephemeral store is gone after loading, after SIGTERM or SIGINT,
and leaves what it did not write.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from archs import save_fp8_checkpoint, tiny_model
from click.testing import CliRunner

import ktcore
from ktcore.commands.cli import main
from ktcore.config import ConfigError, config_from_dict
from ktcore.experts import ExpertWeights
from ktcore.testing.kills import run_ktcore
from ktcore.weights.convert import convert_model, pool_ranges
from ktcore.experts.int8 import Int8Experts
from ktcore.weights.safetensors_reader import SafetensorsCheckpoint, SafetensorsExpertSource
from ktcore.weights.store import JOURNAL_NAME, MANIFEST_NAME, StoreError, model_fingerprint, open_store

TORCH = {"kt_backend": "torch"}


def logits(model, seed=0):
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def load(path, dtype, **keys):
    return ktcore.load_model(path, {**TORCH, **keys}, device="cpu", dtype=dtype, progress=False)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    """A tiny Qwen3-MoE (MoE layers 0 and 2, odd intermediate size 20) saved in bf16, in shards with an index."""
    path = tmp_path_factory.mktemp("bf16") / "model"
    tiny_model("qwen3_moe", odd=True, seed=11).to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def stores(bf16_model, tmp_path_factory):
    """bf16 experts (3 thread-pool files a layer) and the non-expert store of ``bf16_model``."""
    root = tmp_path_factory.mktemp("stores")
    convert_model(bf16_model, root / "bf16", "bf16", threadpools=3, progress=False)
    convert_model(bf16_model, root / "non_expert", non_expert=True, progress=False)
    return root


# ---- equivalence -------------------------------------------------------------------------------------------


def test_bf16_store_loads_the_checkpoint_bit_exact_without_reading_it(bf16_model, stores, tmp_path):
    reference = logits(load(bf16_model, torch.bfloat16))
    experts_only = load(bf16_model, torch.bfloat16, kt_weight_path=str(stores / "bf16"))
    assert torch.equal(logits(experts_only), reference)
    # both stores: the checkpoint's shards are not read at all (only its config.json and index)
    bare = tmp_path / "bare"
    shutil.copytree(bf16_model, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    both = load(bare, torch.bfloat16, kt_weight_path=str(stores / "bf16"),
                kt_non_expert_weight_path=str(stores / "non_expert"))
    assert torch.equal(logits(both), reference)
    manifest = json.loads((stores / "bf16" / MANIFEST_NAME).read_text())
    assert manifest["pool_ranges"] == [[0, 7], [7, 14], [14, 20]] and manifest["layout"] == "bf16-dense-v1"
    assert len(manifest["files"]) == 6 and manifest["model_fingerprint"] == model_fingerprint(bf16_model)


@pytest.mark.parametrize("threadpools, chunk_bytes", [(1, 1 << 30), (2, 2 * 3 * 20 * 44 * 4)])
def test_int8_store_is_the_dequantised_codes(tmp_path, monkeypatch, threadpools, chunk_bytes):
    """An int8 store gives exactly int8-sym-channel-v1's codes of the fp32 experts (whole layers at once, or two
    experts at a time); loading it is the model whose experts are those codes dequantised (a checkpoint written
    here, read the ordinary way)."""
    monkeypatch.setattr("ktcore.weights.convert.CHUNK_BYTES", chunk_bytes)
    plain = tiny_model("qwen3_moe", odd=True, seed=12)
    plain.save_pretrained(tmp_path / "model")
    convert_model(tmp_path / "model", tmp_path / "int8", "int8", threadpools, progress=False)
    store = open_store(tmp_path / "int8", "experts", model_fingerprint(tmp_path / "model"), "kt_weight_path")
    truth = tiny_model("qwen3_moe", odd=True, seed=12)
    from ktcore.model.wrap import expert_modules, find_arch

    arch = find_arch(plain.config)
    with SafetensorsCheckpoint(tmp_path / "model") as ckpt:
        for (layer, name, module), (_, _, truth_module) in zip(expert_modules(plain, arch),
                                                               expert_modules(truth, arch)):
            want = Int8Experts.quantize(SafetensorsExpertSource(ckpt, arch, layer, module).read(torch.float32))
            from ktcore.weights.store_sources import Int8StoreExpertSource

            got = Int8StoreExpertSource(store, name, arch, module).read_int8()
            for (gc, gs), (wc, ws) in zip((got.gate, got.up, got.down), (want.gate, want.up, want.down)):
                assert torch.equal(gc, wc) and torch.equal(gs, ws)
            dense = want.dequantize(torch.float32)
            with torch.no_grad():
                truth_module.gate_up_proj.copy_(torch.cat([dense.gate, dense.up], 1))
                truth_module.down_proj.copy_(dense.down)
    truth.save_pretrained(tmp_path / "truth")
    expected = logits(load(tmp_path / "truth", torch.float32))
    assert torch.equal(logits(load(tmp_path / "model", torch.float32, kt_weight_path=str(tmp_path / "int8"))),
                       expected)
    assert not torch.equal(logits(load(tmp_path / "model", torch.float32)), expected)  # int8 is not a no-op


def test_fp8_deepseek_v3_converts_dequantised(tmp_path):
    """FP8 blocks are dequantised (fp32) before bf16 or int8; the non-expert store keeps no scale and no FP8
    tensor; int8 experts of an FP8 source are refused without a non-expert store."""
    model = tmp_path / "fp8"
    save_fp8_checkpoint(tiny_model("deepseek_v3", seed=13), model)
    for args in (["--format", "bf16"], ["--format", "int8", "--threadpools", "2"], ["--non-expert"]):
        out = tmp_path / (args[1] if args[0] == "--format" else "non_expert")
        result = CliRunner().invoke(main, ["convert", str(model), *args, "--out", str(out), "--quiet"])
        assert result.exit_code == 0, (result.output, result.exception)
    non_expert = open_store(tmp_path / "non_expert", "non_expert", model_fingerprint(model), "k")
    for header, _ in non_expert.headers.values():
        assert header and all(meta["dtype"] == "BF16" and not name.endswith("_scale_inv")
                              for name, meta in header.items())
    direct = logits(load(model, torch.bfloat16))
    stored = load(model, torch.bfloat16, kt_weight_path=str(tmp_path / "bf16"),
                  kt_non_expert_weight_path=str(tmp_path / "non_expert"))
    assert torch.equal(logits(stored), direct)
    with pytest.raises(StoreError, match=r"int8 experts of an FP8 checkpoint.*kt_non_expert_weight_path"):
        load(model, torch.bfloat16, kt_weight_path=str(tmp_path / "int8"))
    int8 = load(model, torch.bfloat16, kt_weight_path=str(tmp_path / "int8"),
                kt_non_expert_weight_path=str(tmp_path / "non_expert"))
    error = (logits(int8).float() - direct.float()).abs().max() / direct.float().abs().max()
    assert 0 < error < 0.05, error  # int8 of the dequantised FP8 weights: close, not equal


# ---- validation: one line naming the file, before any weight is used --------------------------------------


def _break(store: Path, how: str) -> str:
    """Break a copy of a bf16 store; returns the fragment the error must hold."""
    manifest = json.loads((store / MANIFEST_NAME).read_text())
    victim = store / "experts-layer002-pool1.safetensors"
    if how == "missing":
        victim.unlink()
    elif how == "extra":
        (store / "notes.txt").write_text("mine")
        return "notes.txt: not listed"
    elif how == "truncated":
        os.truncate(victim, victim.stat().st_size - 2)
    elif how == "tampered":
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0x40  # same size, one bit of the last weight
        victim.write_bytes(bytes(data))
        return f"{victim.name}: its SHA-256 differs"
    elif how == "symlink":
        shutil.move(victim, store.parent / "elsewhere.safetensors")
        victim.symlink_to(store.parent / "elsewhere.safetensors")
        return f"{victim.name}: a symlink"
    elif how == "layout":
        manifest["layout"] = "bf16-dense-v0"
        (store / MANIFEST_NAME).write_text(json.dumps(manifest))
        return "bf16-dense-v0"
    elif how == "unfinished":
        (store / MANIFEST_NAME).rename(store / JOURNAL_NAME)
        return "unfinished conversion"
    return victim.name


@pytest.mark.parametrize("how", ["missing", "extra", "truncated", "tampered", "symlink", "layout", "unfinished"])
def test_a_broken_expert_store_fails_naming_the_file(bf16_model, stores, tmp_path, how):
    store = tmp_path / "store"
    shutil.copytree(stores / "bf16", store)
    fragment = _break(store, how)
    with pytest.raises(StoreError) as info:
        load(bf16_model, torch.bfloat16, kt_weight_path=str(store))
    message = str(info.value)
    assert fragment in message and "\n" not in message, message


def test_a_store_of_another_model_is_refused(bf16_model, stores, tmp_path):
    """The same tensor names and shapes under another config (rope_theta): only the fingerprint can tell."""
    other = tmp_path / "other"
    shutil.copytree(bf16_model, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (other / "config.json").write_text(json.dumps(config))
    for key, kind in (("kt_weight_path", "bf16"), ("kt_non_expert_weight_path", "non_expert")):
        with pytest.raises(StoreError, match=rf"{MANIFEST_NAME}: converted from another model"):
            load(other, torch.bfloat16, **{key: str(stores / kind)})
    with pytest.raises(StoreError, match=r"a store of kind 'non_expert', kt_weight_path needs 'experts'"):
        load(bf16_model, torch.bfloat16, kt_weight_path=str(stores / "non_expert"))


@pytest.mark.parametrize("intruder", ["model.layers.0.mlp.experts.gate_up_proj",
                                      "model.layers.1.mlp.up_proj.weight_scale_inv"])
def test_a_non_expert_store_holding_experts_or_fp8_scales_is_refused(bf16_model, stores, tmp_path, intruder):
    """A store with one more tensor (an expert or a scale), manifest rewritten to match: refused by name."""
    from ktcore.weights.store import write_safetensors

    store = tmp_path / "store"
    shutil.copytree(stores / "non_expert", store)
    extra = write_safetensors(store / "more.safetensors", {intruder: torch.zeros(2, 2, dtype=torch.bfloat16)})
    manifest = json.loads((store / MANIFEST_NAME).read_text())
    manifest["files"]["more.safetensors"] = extra
    (store / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=rf"more.safetensors: tensor '{intruder}' is (a routed-expert|an FP8)"):
        load(bf16_model, torch.bfloat16, kt_non_expert_weight_path=str(store))


def test_ephemeral_with_kt_weight_path_is_a_config_error():
    with pytest.raises(ConfigError, match="ephemeral .* does not take kt_weight_path"):
        config_from_dict({"model_name_or_path": "m", "use_kt": True, "kt_weight_path": "s",
                          "kt_config": {"kt_weight_lifecycle": "ephemeral"}})


# ---- conversion: resume after a kill, refuse what it did not write ---------------------------------------------


@pytest.mark.parametrize("fault", ["atomic_file:written", "store:written:experts-layer000-pool0.safetensors"])
def test_a_killed_conversion_resumes_without_redoing_finished_files(bf16_model, stores, tmp_path, fault):
    out = tmp_path / "out"
    killed = run_ktcore("convert", bf16_model, "--format", "bf16", "--threadpools", 3, "--out", out, "--quiet",
                        fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / MANIFEST_NAME).exists()
    journal = json.loads((out / JOURNAL_NAME).read_text())["files"] if (out / JOURNAL_NAME).exists() else {}
    if fault.startswith("store:"):
        assert "experts-layer000-pool0.safetensors" in journal
    else:  # killed before the first rename: nothing finished, only a temp file the resumed run removes
        assert journal == {} and not list(out.glob("experts-*"))
    kept = {name: (out / name).stat().st_ino for name in journal}
    resumed = run_ktcore("convert", bf16_model, "--format", "bf16", "--threadpools", 3, "--out", out, "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert {name: (out / name).stat().st_ino for name in journal} == kept  # finished files kept, not rewritten
    assert json.loads(resumed.stdout)["bytes_written"] == \
        sum(f["size"] for name, f in manifest["files"].items() if name not in journal)
    assert sorted(os.listdir(out)) == sorted(os.listdir(stores / "bf16"))
    assert json.loads((out / MANIFEST_NAME).read_text())["files"] == \
        json.loads((stores / "bf16" / MANIFEST_NAME).read_text())["files"]
    again = run_ktcore("convert", bf16_model, "--format", "bf16", "--threadpools", 3, "--out", out, "--quiet")
    assert "already complete" in again.stdout


def test_convert_refuses_an_out_dir_it_did_not_write(bf16_model, stores, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_ktcore("convert", bf16_model, "--format", "int8", "--out", out, "--quiet")
    assert result.returncode == 2 and "keep.txt: not written by this conversion" in result.stderr
    assert (out / "keep.txt").read_text() == "mine" and sorted(os.listdir(out)) == ["keep.txt"]
    other_format = run_ktcore("convert", bf16_model, "--format", "int8", "--out", stores / "bf16", "--quiet")
    assert other_format.returncode == 2 and "conversion of another model, format or split" in other_format.stderr
    lines = other_format.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), other_format.stderr


def test_pool_ranges_cover_the_rows():
    assert pool_ranges(20, 3) == [(0, 7), (7, 14), (14, 20)]
    assert pool_ranges(8, 1) == [(0, 8)]
    with pytest.raises(ValueError, match="between 1 and"):
        pool_ranges(4, 5)


# ---- ephemeral: converted into a scratch store, deleted as it loads, cleaned up on signals ----------------


def test_ephemeral_loads_the_checkpoint_and_leaves_nothing(bf16_model, tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    (scratch / "ktcore-ephemeral-not-a-pid").mkdir()  # not ktcore's naming: kept
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (scratch / f"ktcore-ephemeral-{dead.pid}-left").mkdir()  # a SIGKILLed run's: removed
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    reference = logits(load(bf16_model, torch.bfloat16))
    model = load(bf16_model, torch.bfloat16, kt_weight_lifecycle="ephemeral")
    assert torch.equal(logits(model), reference)
    assert sorted(os.listdir(scratch)) == ["ktcore-ephemeral-not-a-pid"]


KILLER = """
import json, os, signal, sys, torch, ktcore
from pathlib import Path
from ktcore.builtin.torch_backend.backend import TorchExpertBackend
packs = []
original = TorchExpertBackend.pack
def pack(self, weights, activation="silu"):
    packs.append(1)
    if len(packs) == 2:  # layer 0 is loaded, layer 2 is being packed
        (scratch,) = Path(os.environ["TMPDIR"]).glob("ktcore-ephemeral-*")
        print(json.dumps(sorted(os.listdir(scratch))), flush=True)
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    return original(self, weights, activation)
TorchExpertBackend.pack = pack
ktcore.load_model(sys.argv[1], {"kt_backend": "torch", "kt_weight_lifecycle": "ephemeral"}, device="cpu",
                  dtype=torch.bfloat16, progress=False)
print("loaded")
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_ephemeral_deletes_each_layer_once_loaded_and_everything_on_a_signal(bf16_model, tmp_path, signame):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    (scratch / "mine.txt").write_text("not ktcore's")
    result = subprocess.run([sys.executable, "-c", KILLER, str(bf16_model), signame], capture_output=True,
                            text=True, env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode != 0 and "loaded" not in result.stdout, (result.stdout, result.stderr)
    listing = json.loads(result.stdout.splitlines()[0])
    assert listing == ["experts-layer002-pool0.safetensors", MANIFEST_NAME]  # layer 0's file already deleted
    assert sorted(os.listdir(scratch)) == ["mine.txt"]
    if signame == "SIGTERM":
        assert result.returncode == -signal.SIGTERM


def assert_store_holds_the_checkpoints_experts(store_dir, model_dir) -> None:
    """Every experts module read from the bf16 store at ``store_dir`` (its thread-pool files joined back into whole
    [E, I, H] / [E, H, I] tensors) equals the checkpoint's, bit for bit."""
    from ktcore.model.wrap import expert_modules, find_arch
    from ktcore.weights.loading import meta_model_of
    from ktcore.weights.store_sources import StoreExpertSource

    config, model = meta_model_of(model_dir)
    arch = find_arch(config)
    store = open_store(store_dir, "experts", model_fingerprint(model_dir), "kt_weight_path")
    assert not hasattr(StoreExpertSource, "read_int8")
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for layer, name, module in expert_modules(model, arch):
            want = SafetensorsExpertSource(ckpt, arch, layer, module).read(torch.bfloat16)
            got = StoreExpertSource(store, name, arch, module).read(torch.bfloat16)
            assert isinstance(got, ExpertWeights)
            for a, b in zip((got.gate, got.up, got.down), (want.gate, want.up, want.down)):
                assert torch.equal(a, b)


def test_expert_weights_of_a_store_are_those_of_the_checkpoint(bf16_model, stores):
    assert_store_holds_the_checkpoints_experts(stores / "bf16", bf16_model)


# ---- the seed's INT8 recipe through the TRL frontend ----------------------------------------------------------


@pytest.mark.slow
def test_seed_int8_yaml_trains_through_trl_as_the_dequantised_checkpoint(tmp_path, shared_data):
    """examples/deepseek_v3_int8.yaml (kt_weight_path, kt_non_expert_weight_path, kt_expert_weight_format: int8)
    with its paths pointed at a tiny chat MoE's stores: on the torch backend, the loss curve is the one of the same
    YAML on a checkpoint holding the dequantised int8 experts; as it is (amx_int8, where it runs), within 10%."""
    pytest.importorskip("ktcore_trl", reason="the TRL frontend is not installed (pip install -e frontends/trl)")
    import yaml
    from safetensors.torch import load_file, save_file

    from ktcore.testing.tiny import save_tiny_chat_moe
    from ktcore.weights.store_sources import Int8StoreExpertSource

    model = save_tiny_chat_moe(tmp_path / "model")
    for args, out in ((["--format", "int8"], "int8"), (["--non-expert"], "non_expert")):
        assert run_ktcore("convert", model, *args, "--out", tmp_path / out, "--quiet").returncode == 0
    # the truth: the same checkpoint with every expert replaced by its int8 codes dequantised (fp32)
    truth = tmp_path / "truth"
    shutil.copytree(model, truth)
    from ktcore.model.wrap import expert_modules, find_arch
    from ktcore.weights.loading import meta_model_of

    config, meta = meta_model_of(model)
    arch = find_arch(config)
    store = open_store(tmp_path / "int8", "experts", model_fingerprint(model), "kt_weight_path")
    state = load_file(truth / "model.safetensors")
    for layer, name, module in expert_modules(meta, arch):
        dense = Int8StoreExpertSource(store, name, arch, module).read(torch.float32)
        for e in range(dense.num_experts):
            for part, value in (("gate", dense.gate), ("up", dense.up), ("down", dense.down)):
                key = f"{name}.{e}.{part}_proj.weight"
                assert key in state, key
                state[key] = value[e].clone()
    save_file(state, truth / "model.safetensors", metadata={"format": "pt"})

    seed = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "deepseek_v3_int8.yaml").read_text())
    assert seed["kt_config"]["kt_expert_weight_format"] == "int8"
    stores = {"model_name_or_path": str(model), "kt_weight_path": str(tmp_path / "int8"),
              "kt_non_expert_weight_path": str(tmp_path / "non_expert")}
    torch_backend = {"kt_backend": "torch", "kt_expert_weight_format": "auto"}
    plans = [("stores", stores, torch_backend),
             ("truth", {"model_name_or_path": str(truth), "kt_weight_path": None, "kt_non_expert_weight_path": None},
              torch_backend)]
    try:  # the YAML as it is (kt_backend: auto picks amx_int8 for int8) where amx_int8 runs (AMX or AVX-512 VNNI)
        ktcore.get_backend("amx_int8", {"kt_backend": "amx_int8", "kt_expert_weight_format": "int8"})
        plans.append(("auto", stores, {}))
    except Exception:
        pass
    runs = {}
    for label, paths, backend in plans:
        cfg = {**seed, **paths, "dataset_dir": str(shared_data), "output_dir": str(tmp_path / f"out-{label}"),
               "max_steps": 3, "plot_loss": False, "gradient_accumulation_steps": 2, "cutoff_len": 128,
               "kt_config": {**seed["kt_config"], **backend, "kt_num_threads": 2}}
        (tmp_path / f"{label}.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
        result = CliRunner().invoke(main, ["train", str(tmp_path / f"{label}.yaml"), "--frontend", "trl"])
        assert result.exit_code == 0, (result.output, result.exception)
        start = 0 if result.stdout.startswith("{\n") else result.stdout.rindex("\n{\n")
        runs[label] = json.JSONDecoder().raw_decode(result.stdout[start:].lstrip())[0]
    assert runs["stores"]["steps"] == 3 and (tmp_path / "out-stores" / "adapter_model.safetensors").is_file()
    if "auto" in runs:  # int8 activations too: the curve within 10% of the dequantised-weights one
        assert runs["auto"]["kt_backend"] == "amx_int8"
        assert runs["auto"]["losses"] == pytest.approx(runs["truth"]["losses"], rel=0.1)
    assert runs["stores"]["losses"] == pytest.approx(runs["truth"]["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("args, fragment", [
    (["--format", "q4_k"], "a model directory converts to one of bf16, int8"),
    (["--non-expert", "--format", "int8"], "--non-expert writes bf16"),
    (["--threadpools", "21"], "must be between 1 and the experts' intermediate size 20"),
])
def test_convert_arguments_are_one_line_errors(bf16_model, tmp_path, args, fragment):
    result = CliRunner().invoke(main, ["convert", str(bf16_model), *args, "--out", str(tmp_path / "out"), "--quiet"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.stderr
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_amx_int8_computes_an_int8_store_as_it_quantises_the_checkpoint(tmp_path):
    """The int8 backend takes a store's codes as they are (``read_int8`` through ``pack_source``): the model
    loaded from the store gives the logits of the model it quantises itself."""
    from test_stream import int8_usable_or_skip

    int8_usable_or_skip()
    kt = {"kt_backend": "amx_int8", "kt_expert_weight_format": "int8"}
    tiny_model("qwen3_moe", odd=True, seed=14).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    convert_model(tmp_path / "model", tmp_path / "int8", "int8", threadpools=2, progress=False)
    direct = ktcore.load_model(tmp_path / "model", kt, device="cpu", dtype=torch.float32, progress=False)
    stored = ktcore.load_model(tmp_path / "model", {**kt, "kt_weight_path": str(tmp_path / "int8")}, device="cpu",
                               dtype=torch.float32, progress=False)
    assert torch.equal(logits(stored), logits(direct))
    plain = logits(load(tmp_path / "model", torch.float32))
    assert not torch.equal(logits(stored), plain)  # int8 experts, not the bf16 ones


# ---- the conversion's fast paths give the reference's bytes ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blockwise_quantising_in_place_is_int8_quantize_bit_for_bit(monkeypatch, dtype):
    """``quantize_experts`` (row blocks through ``quantize_into``, as ``ktcore convert`` quantises) gives exactly
    ``Int8Experts.quantize``'s codes and scales: random rows, a zero row, rows of tiny, huge and one-hot values,
    with blocks that cut the rows unevenly."""
    from ktcore.weights.convert import quantize_experts

    monkeypatch.setattr("ktcore.weights.convert.QUANTIZE_BLOCK_BYTES", 3 * 4 * 40)  # 3 rows of 40 float32
    g = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).tiny

    def weight(e, n, k):
        w = torch.randn(e, n, k, generator=g)
        w[0, 1] = 0
        w[0, 2] *= tiny * 4
        w[1, 0] *= torch.finfo(dtype).max / 8
        w[1, 3] = 0
        w[1, 3, 7] = -3.5
        return w.to(dtype)

    dense = ExpertWeights(weight(3, 10, 40), weight(3, 10, 40), weight(3, 40, 10))
    want = Int8Experts.quantize(dense)
    got = Int8Experts(*((torch.full(w.shape, 99, dtype=torch.int8), torch.full(w.shape[:-1], -1.0))
                        for w in (dense.gate, dense.up, dense.down)))
    quantize_experts(dense, got)
    for (gc, gs), (wc, ws) in zip((got.gate, got.up, got.down), (want.gate, want.up, want.down)):
        assert torch.equal(gc, wc) and torch.equal(gs, ws)


@pytest.mark.parametrize("how", ["direct", "no O_DIRECT", "refused alignment", "tmpfs"])
def test_a_staged_file_is_the_bytes_write_safetensors_writes(tmp_path, monkeypatch, how):
    """A file built in place and written by ``write_staged`` (O_DIRECT, or the page cache where O_DIRECT is
    missing, refused at open (tmpfs) or at the first write) has write_safetensors's bytes, size and SHA-256."""
    from ktcore.files import sha256_file
    from ktcore.weights.staged import StagedFile, write_staged
    from ktcore.weights.store import write_safetensors

    where = tmp_path
    if how == "tmpfs":
        if not os.access("/dev/shm", os.W_OK):
            pytest.skip("no writable /dev/shm")
        where = Path(__import__("tempfile").mkdtemp(prefix="ktcore-staged-", dir="/dev/shm"))
    if how == "no O_DIRECT":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    if how == "refused alignment":
        direct_fds, real_open, real_pwrite = set(), os.open, os.pwrite  # fds opened with O_DIRECT

        def open_(path, flags, *args):
            fd = real_open(path, flags, *args)
            if flags & os.O_DIRECT:
                direct_fds.add(fd)
            return fd

        def pwrite(fd, data, offset):
            if fd in direct_fds:
                raise OSError(22, "Invalid argument")
            return real_pwrite(fd, data, offset)

        def close(fd, real_close=os.close):
            direct_fds.discard(fd)
            real_close(fd)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.setattr(os, "close", close)
    g = torch.Generator().manual_seed(3)
    tensors = {"b": torch.randn(5, 7, generator=g).to(torch.bfloat16), "codes": torch.randint(-127, 128, (3, 1001),
               generator=g, dtype=torch.int8), "scales": torch.rand(3, generator=g), "empty": torch.zeros(0, 4)}
    try:
        entry = write_safetensors(where / "a.safetensors", tensors, {"format": "pt"})
        staged = StagedFile.make({k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, {"format": "pt"})
        for name, value in tensors.items():
            staged.tensors[name].copy_(value)
        assert write_staged(where / "b.safetensors", staged) == entry
        assert (where / "b.safetensors").read_bytes() == (where / "a.safetensors").read_bytes()
        assert sha256_file(where / "b.safetensors") == entry["sha256"]
        assert sorted(os.listdir(where)) == ["a.safetensors", "b.safetensors"]  # no temp file left
    finally:
        if how == "tmpfs":
            shutil.rmtree(where)


def _fused_copy(model_dir: Path, out: Path) -> None:
    """``model_dir``'s checkpoint with each layer's per-expert tensors stacked into transformers 5's fused
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, as one file."""
    from safetensors.torch import save_file

    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    tensors, experts = {}, {}
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for key in ckpt.keys():
            prefix, sep, rest = key.partition(".mlp.experts.")
            if sep:
                expert, part, _ = rest.split(".", 2)
                experts.setdefault(prefix, {}).setdefault(part, {})[int(expert)] = ckpt.get(key)
            else:
                tensors[key] = ckpt.get(key)
    for prefix, parts in experts.items():
        stack = {part: torch.stack([parts[part][e] for e in sorted(parts[part])]) for part in parts}
        tensors[prefix + ".mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], 1)
        tensors[prefix + ".mlp.experts.down_proj"] = stack["down_proj"]
    save_file(tensors, out / "model.safetensors", {"format": "pt"})


@pytest.mark.parametrize("fmt, threadpools", [("bf16", 1), ("bf16", 2), ("int8", 1), ("int8", 2)])
def test_a_fused_checkpoint_converts_to_the_files_of_its_per_expert_one(bf16_model, tmp_path, fmt, threadpools):
    """The per-expert checkpoint (read straight into the file, or a few experts at a time) and the fused one
    (read whole, then split) give store files with the same SHA-256; a one-file bf16 layer reads back as the
    checkpoint's experts."""
    _fused_copy(bf16_model, tmp_path / "fused")
    convert_model(bf16_model, tmp_path / "per_expert_store", fmt, threadpools, progress=False)
    convert_model(tmp_path / "fused", tmp_path / "fused_store", fmt, threadpools, progress=False)
    files = [json.loads((tmp_path / s / MANIFEST_NAME).read_text())["files"] for s in ("per_expert_store",
                                                                                         "fused_store")]
    assert files[0] == files[1] and len(files[0]) == 2 * threadpools
    if fmt == "bf16" and threadpools == 1:
        assert_store_holds_the_checkpoints_experts(tmp_path / "per_expert_store", bf16_model)
