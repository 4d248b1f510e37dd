"""The built-in demo (``ktcore demo``): a short run completes and the loss falls."""

import json

import pytest

pytest.importorskip("ktcore_trl", reason="the demo trains through the TRL frontend (pip install -e frontends/trl)")

pytestmark = pytest.mark.slow


def test_demo_short_run(tmp_path):
    from transformers import AutoTokenizer

    from ktcore.commands.demo import TASK_LETTERS, run_demo

    result = run_demo(tmp_path / "demo", steps=60, quiet=True)
    assert result["steps"] == 60 and len(result["losses"]) == 60
    assert result["last_loss"] < result["first_loss"] - 1.0, result["losses"]
    assert result["accuracy_before"] == 0.0  # a random model answers with arbitrary bytes
    # 60 steps teach the answer's form (measured: all 16 held-out answers letters of the task, ended by the end
    # token), not yet the reversal itself
    assert all(answer and set(answer) <= set(TASK_LETTERS) for answer in result["after"]), result["after"]
    assert not any(answer and set(answer) <= set(TASK_LETTERS) for answer in result["before"]), result["before"]
    assert len(result["before"]) == len(result["after"]) == len(result["expected"]) > 0
    assert result["expert_lora_params"] > 0
    demo = tmp_path / "demo"
    assert (demo / "adapter" / "adapter_model.safetensors").is_file()
    assert (demo / "adapter" / "training_loss.png").is_file()
    info = json.loads((demo / "data" / "dataset_info.json").read_text())
    assert "reverse" in info
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")  # the byte-level tokenizer loads back
    assert tokenizer.decode(tokenizer("héllo", add_special_tokens=False)["input_ids"]) == "héllo"
    assert len(tokenizer) == 260


def test_demo_cli_rebuild_is_reused(tmp_path):
    """A second build into the same workdir keeps the model and rewrites data and YAML."""
    from ktcore.config import load_config
    from ktcore.commands.demo import build_demo_files

    first = build_demo_files(tmp_path, steps=5)
    stamp = (first["model_dir"] / "config.json").stat().st_mtime_ns
    second = build_demo_files(tmp_path, steps=7)
    assert (second["model_dir"] / "config.json").stat().st_mtime_ns == stamp
    cfg = load_config(second["config"], quiet=True)
    assert cfg.max_steps == 7 and cfg.use_kt and cfg.model_name_or_path == str(first["model_dir"])


def test_demo_never_replaces_a_model_directory_it_did_not_write(tmp_path):
    """`ktcore demo --workdir W` with a user's W/model (no config.json, so not a finished demo model): refused in
    one line, the directory untouched (it used to be deleted and rebuilt)."""
    from click.testing import CliRunner

    from ktcore.commands.cli import main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "notes.md").write_text("mine")
    run = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])
    assert run.exit_code == 2 and "not written by `ktcore demo`" in run.output, run.output
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["notes.md"]
