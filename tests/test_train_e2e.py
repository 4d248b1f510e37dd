"""End-to-end LoRA SFT through ``ktcore train --frontend trl`` on a tiny Qwen3-MoE saved to disk.

Covers: the loss falls, a standard PEFT adapter is written, it reloads with plain ``PeftModel.from_pretrained``
onto a ktcore-loaded model and onto the plain transformers model with identical logits, prompt tokens are
masked from the loss, and bad dataset inputs are one-line ConfigErrors raised before any model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("trl", reason="the TRL frontend needs trl (pip install -e frontends/trl)")
pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

from click.testing import CliRunner  # noqa: E402

from ktcore_tiny import tiny_qwen3_moe  # noqa: E402
from ktcore.commands.cli import main  # noqa: E402
from ktcore.config import ConfigError, config_from_dict  # noqa: E402
from ktcore.commands.demo import build_byte_tokenizer, reverse_task  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Tiny random Qwen3-MoE (2 MoE layers + 1 dense) with the demo's byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny_moe")
    tokenizer = build_byte_tokenizer()
    model = tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def generated_data(tmp_path_factory):
    """The reversal task as alpaca JSON and as sharegpt JSON lines with custom columns and tags."""
    path = tmp_path_factory.mktemp("data")
    train, _ = reverse_task(64, 0, seed=1, length=4)
    (path / "rev_alpaca.json").write_text(json.dumps(train[:32]))
    chats = [{"chat": [{"who": "me", "text": t["instruction"]}, {"who": "bot", "text": t["output"]}]}
             for t in train[32:]]
    (path / "rev_sharegpt.jsonl").write_text("\n".join(json.dumps(c) for c in chats))
    (path / "dataset_info.json").write_text(json.dumps({
        "rev_alpaca": {"file_name": "rev_alpaca.json"},
        "rev_sharegpt": {"file_name": "rev_sharegpt.jsonl", "formatting": "sharegpt",
                         "columns": {"messages": "chat"},
                         "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"}},
    }))
    return path


def _config(tmp_path, model_dir, data_dir, **keys) -> Path:
    cfg = dict(model_name_or_path=str(model_dir), stage="sft", finetuning_type="lora", lora_target="all",
               lora_rank=8, dataset_dir=str(data_dir), dataset="rev_alpaca,rev_sharegpt", template="default",
               cutoff_len=96, output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
               learning_rate=3e-3, max_steps=25, lr_scheduler_type="constant", logging_steps=5, save_steps=1000,
               seed=0, use_kt=True, kt_config={"kt_backend": "torch"})
    cfg.update(keys)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config_path) -> dict:
    result = CliRunner().invoke(main, ["train", str(config_path), "--frontend", "trl"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


def _mean(xs):
    return sum(xs) / len(xs)


def _assert_loss_falls(summary, steps, margin=0.2):
    losses = summary["losses"]
    assert summary["steps"] == steps and len(losses) == steps
    k = max(1, steps // 5)
    assert _mean(losses[-k:]) < _mean(losses[:k]) - margin, losses


def _logits(model, ids):
    device = next(p.device for p in model.parameters() if p.device.type != "meta")
    with torch.no_grad():
        return model(input_ids=ids.to(device)).logits.float().cpu()


# fp32 on the CPU: the same math up to summation order; on a GPU the non-expert part runs on CUDA kernels
TOL = 1e-4 if torch.cuda.is_available() else 1e-5


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_sft_generated_data_adapter_reloads(tmp_path, model_dir, generated_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import ktcore

    config_path = _config(tmp_path, model_dir, generated_data, plot_loss=True)
    summary = _train(config_path)
    _assert_loss_falls(summary, 25)
    out = Path(summary["output_dir"])
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "training_loss.png").stat().st_size > 1000
    assert summary["expert_lora_params"] > 0 and summary["trainable_params"] > summary["expert_lora_params"]
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["target_parameters"], "expert LoRA must be saved in PEFT's target_parameters layout"

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    plain_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base_logits = _logits(plain_base, ids)
    plain = PeftModel.from_pretrained(plain_base, out).eval()
    kt_model = ktcore.load_model(model_dir, config_from_dict({"use_kt": True, "kt_config": {"kt_backend": "torch"}}),
                                 dtype=torch.float32, progress=False)
    kt = PeftModel.from_pretrained(kt_model, out).eval()
    plain_logits, kt_logits = _logits(plain, ids), _logits(kt, ids)
    assert _rel(plain_logits, base_logits) > 1e-3, "the trained adapter should change the logits"
    assert _rel(kt_logits, plain_logits) <= TOL
    with kt.disable_adapter():  # expert LoRA off too: back to the base model
        assert _rel(_logits(kt, ids), base_logits) <= TOL


def test_sft_shared_llamafactory_data(tmp_path, model_dir, shared_data):
    config_path = _config(tmp_path, model_dir, shared_data, dataset="identity,alpaca_en_demo", max_samples=16,
                          cutoff_len=128, per_device_train_batch_size=4, max_steps=20, gradient_accumulation_steps=2)
    summary = _train(config_path)
    _assert_loss_falls(summary, 20, margin=0.05)  # real text: a few steps move it less than the toy task
    assert summary["examples"] == 32
    assert (Path(summary["output_dir"]) / "adapter_model.safetensors").is_file()


def test_sft_without_kt_plain_transformers(tmp_path, model_dir, generated_data):
    config_path = _config(tmp_path, model_dir, generated_data, use_kt=False, max_steps=10, lora_target="q_proj,v_proj")
    summary = _train(config_path)
    assert summary["steps"] == 10 and summary["expert_lora_params"] == 0
    assert summary["last_loss"] < summary["first_loss"]


def test_prompt_tokens_are_masked(model_dir, generated_data):
    from ktcore_trl.data import IGNORE_INDEX, load_examples, tokenize_sft
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = config_from_dict({"dataset_dir": str(generated_data), "dataset": "rev_alpaca,rev_sharegpt",
                            "cutoff_len": 64, "max_samples": 3}, quiet=True)
    examples = load_examples(cfg, ranking=False)
    assert len(examples) == 6 and examples[3].messages[0]["role"] == "user"
    dataset = tokenize_sft(examples, tokenizer, cfg)
    for row, example in zip(dataset, examples):
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        answer = example.messages[-1]["content"]
        assert trained == list(answer.encode()) + [tokenizer.eos_token_id]
        prompt_len = row["labels"].index(trained[0])
        assert tokenizer.decode(row["input_ids"][:prompt_len]) == f"<|user|>{example.messages[0]['content']}<|assistant|>"
    short = tokenize_sft(examples, tokenizer, config_from_dict({**cfg.to_dict(), "cutoff_len": 8}, quiet=True))
    assert all(len(r["input_ids"]) <= 8 for r in short)
    assert all(any(t != IGNORE_INDEX for t in r["labels"]) for r in short)


# ---- bad input: one line, before any model is loaded ---------------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    import ktcore_trl.train as train

    def refuse(cfg):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(train, "load_base_model", refuse)


def _bad_data(tmp_path, info, files=None) -> Path:
    data = tmp_path / "bad_data"
    data.mkdir()
    if info is not None:
        (data / "dataset_info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    for name, text in (files or {}).items():
        (data / name).write_text(text)
    return data


GOOD = json.dumps([{"instruction": "abc", "input": "", "output": "cba"}])


@pytest.mark.parametrize("case, info, files, keys, expected", [
    ("no dataset_info.json", None, {}, {}, "no dataset_info.json in dataset_dir"),
    ("dataset_info.json bad JSON", "{oops", {}, {}, "dataset_info.json: not valid JSON"),
    ("name not defined", {"other": {"file_name": "a.json"}}, {"a.json": GOOD}, {},
     "dataset 'rev' is not defined; add it or choose one of other"),
    ("missing file", {"rev": {"file_name": "nope.json"}}, {}, {}, "nope.json: file of dataset 'rev' does not exist"),
    ("bad JSON", {"rev": {"file_name": "a.json"}}, {"a.json": "[{\"instruction\": "}, {},
     "a.json: dataset 'rev' is not valid JSON"),
    ("missing column", {"rev": {"file_name": "a.json"}}, {"a.json": json.dumps([{"instruction": "x", "answer": "y"}])},
     {}, "lack column 'output'"),
    ("sharegpt missing column", {"rev": {"file_name": "a.json", "formatting": "sharegpt"}},
     {"a.json": json.dumps([{"messages": []}])}, {}, "lack column 'conversations'"),
    ("empty file", {"rev": {"file_name": "a.json"}}, {"a.json": "[]"}, {}, "holds no examples"),
    ("empty after cutoff", {"rev": {"file_name": "a.json"}}, {"a.json": GOOD}, {"cutoff_len": 1},
     "no example keeps an answer token after cutoff_len=1"),
    ("preference data for sft", {"rev": {"file_name": "a.json", "ranking": True,
                                         "columns": {"chosen": "c", "rejected": "r"}}},
     {"a.json": json.dumps([{"instruction": "q", "c": "a", "r": "b"}])}, {}, "is a preference dataset but stage 'sft'"),
    ("unknown template", {"rev": {"file_name": "a.json"}}, {"a.json": GOOD}, {"template": "llama9"},
     "template 'llama9' is not known to the trl frontend; choose one of default, chatml, qwen"),
])
def test_bad_dataset_inputs(tmp_path, model_dir, no_model_load, case, info, files, keys, expected):
    from ktcore.frontends import run_frontend
    from ktcore.config import load_config

    data = _bad_data(tmp_path, info, files)
    config_path = _config(tmp_path, model_dir, data, dataset="rev", **keys)
    with pytest.raises(ConfigError) as err:
        run_frontend("trl", load_config(config_path, quiet=True))
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    result = CliRunner().invoke(main, ["train", str(config_path), "--frontend", "trl"])  # the CLI: one line, exit 2
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}", result.output


def test_output_dir_not_empty_is_refused(tmp_path, model_dir, generated_data, no_model_load):
    from ktcore.config import load_config
    from ktcore.frontends import run_frontend

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="overwrite_output_dir"):
        run_frontend("trl", load_config(_config(tmp_path, model_dir, generated_data), quiet=True))


def test_trained_adapter_carries_its_record_and_keeps_training(tmp_path, model_dir, generated_data):
    """`ktcore train` writes kt_integrity.json beside the adapter; `adapter verify` checks it; training on from
    the adapter (adapter_name_or_path) loads it through the same checks; a tampered one is refused up front."""
    for sub in "abc":
        (tmp_path / sub).mkdir()
    first = _train(_config(tmp_path / "a", model_dir, generated_data, max_steps=2))
    out = Path(first["output_dir"])
    record = json.loads((out / "kt_integrity.json").read_text())
    assert set(record["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    run = CliRunner().invoke(main, ["adapter", "verify", str(out), "--base", str(model_dir)])
    assert run.exit_code == 0 and "sizes and SHA-256 match" in run.output and "NOTE" not in run.output, run.output
    second = _train(_config(tmp_path / "b", model_dir, generated_data, max_steps=2, adapter_name_or_path=str(out)))
    assert second["steps"] == 2 and (Path(second["output_dir"]) / "kt_integrity.json").is_file()
    cfg = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": cfg["lora_alpha"] * 20}))
    result = CliRunner().invoke(main, ["train", str(_config(tmp_path / "c", model_dir, generated_data, max_steps=2,
                                                            adapter_name_or_path=str(out))), "--frontend", "trl"])
    assert result.exit_code == 2 and "adapter_config.json: size" in result.stderr, result.output


def test_training_goes_on_from_a_fused_expert_directory(tmp_path, model_dir, generated_data):
    """`adapter_name_or_path` may name the directory `adapter convert --to fused_expert` writes (PEFT files beside
    the fused ones): training goes on from it; with its fused file tampered, it is refused up front."""
    from ktcore import adapters

    for sub in "abc":
        (tmp_path / sub).mkdir()
    first = _train(_config(tmp_path / "a", model_dir, generated_data, max_steps=2))
    fused = tmp_path / "fused"
    adapters.convert(first["output_dir"], fused, "fused_expert", base=model_dir)
    second = _train(_config(tmp_path / "b", model_dir, generated_data, max_steps=2, adapter_name_or_path=str(fused)))
    assert second["steps"] == 2 and second["expert_lora_params"] > 0
    experts = fused / "fused_expert_lora.safetensors"
    experts.write_bytes(experts.read_bytes()[:-4] + b"\0\0\0\1")
    result = CliRunner().invoke(main, ["train", str(_config(tmp_path / "c", model_dir, generated_data, max_steps=2,
                                                            adapter_name_or_path=str(fused))), "--frontend", "trl"])
    assert result.exit_code == 2 and "fused_expert_lora.safetensors: SHA-256" in result.stderr, result.output


def test_sft_deepseek_v2_dense_and_shared_mlp_lora(tmp_path, generated_data):
    """On DeepSeek-V2 PEFT would move `gate_proj`/`up_proj`/`down_proj` onto the routed experts; named in
    lora_target they train at rank r on the dense MLP's and the shared experts' Linears (and `experts` on the
    routed experts), and the adapter reloads in plain PEFT to ktcore's logits."""
    from archs import tiny_model
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import ktcore

    model_dir = tmp_path / "deepseek_v2"
    tokenizer = build_byte_tokenizer()
    tiny_model("deepseek_v2", vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config_path = _config(tmp_path, model_dir, generated_data, dataset="rev_alpaca", max_steps=6,
                          lora_target="q_proj,gate_proj,up_proj,down_proj,experts")
    out = Path(_train(config_path)["output_dir"])
    state = load_file(out / "adapter_model.safetensors")
    for module in ("layers.0.mlp.gate_proj", "layers.0.mlp.down_proj", "layers.1.mlp.shared_experts.up_proj",
                   "layers.2.mlp.shared_experts.gate_proj"):
        a, b = (state[f"base_model.model.model.{module}.lora_{x}.weight"] for x in "AB")
        assert a.shape[0] == 8 and b.shape[1] == 8 and b.abs().sum() > 0, module  # rank r, trained
    experts_a = state["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]
    assert experts_a.shape[0] == 8 * 8  # rank r (not 2r) for each of the 8 experts' gate_up_proj
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), out)
    kt_model = ktcore.load_model(model_dir, config_from_dict({"use_kt": True, "kt_config": {"kt_backend": "torch"}}),
                                 dtype=torch.float32, progress=False)
    kt = PeftModel.from_pretrained(kt_model, out).eval()
    assert _rel(_logits(kt, ids), _logits(plain.eval(), ids)) <= TOL
