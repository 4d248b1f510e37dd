"""`llamafactory-cli` in the LLaMA-Factory environment: train/chat/eval of a config with use_kt run through ktcore
(real llamafactory-cli subprocesses), everything else is LLaMA-Factory's own; `ktcore eval` (loss, perplexity).

Runs in .venv-llamafactory (scripts/setup_llamafactory.sh); elsewhere every test skips with the reason.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import base_keys, write_yaml

CLI = Path(sys.executable).parent / "llamafactory-cli"


def _cli(*args, stdin="", **env):
    return subprocess.run([str(CLI), *map(str, args)], input=stdin, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env})


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{\n"):])


def test_ktcore_args_choose_by_use_kt(tmp_path):
    from ktcore_llamafactory.cli import ktcore_args

    on = write_yaml(tmp_path / "on.yaml", use_kt=True, model_name_or_path="m")
    off = write_yaml(tmp_path / "off.yaml", use_kt=False, model_name_or_path="m")
    (tmp_path / "on.json").write_text(json.dumps({"use_kt": "true"}))
    assert ktcore_args(["train", str(on), "max_steps=2"]) == ["train", str(on), "--frontend", "llamafactory",
                                                               "max_steps=2"]
    assert ktcore_args(["chat", str(on)]) == ["chat", str(on)]
    assert ktcore_args(["eval", str(tmp_path / "on.json")])[:3] == ["eval", str(tmp_path / "on.json"), "--frontend"]
    assert ktcore_args(["train", str(off)]) is None
    assert ktcore_args(["train", str(off), "use_kt=true"])[0] == "train"  # an override counts, the last one wins
    assert ktcore_args(["train", str(on), "use_kt=false"]) is None
    assert ktcore_args(["export", str(on)]) is None and ktcore_args(["version"]) is None
    assert ktcore_args(["train", str(tmp_path / "missing.yaml")]) is None  # LLaMA-Factory reports it


def test_the_installed_script_is_ktcores():
    assert "ktcore_llamafactory.cli" in CLI.read_text(), CLI.read_text()
    assert "ktcore_llamafactory.cli" in (CLI.parent / "lmf").read_text()


def test_without_use_kt_it_is_llamafactory(tmp_path, tiny_model_dir, shared_data):
    """LLaMA-Factory's own commands: `version` prints its banner; `eval` of a config without use_kt is its own
    (0.9.5: NotImplementedError), not ktcore's."""
    version = _cli("version")
    assert version.returncode == 0 and "Welcome to LLaMA Factory" in version.stdout, version.stderr
    cfg = write_yaml(tmp_path / "plain.yaml", **base_keys(tiny_model_dir, shared_data, tmp_path / "out",
                                                           use_kt=False))
    run = _cli("eval", cfg)
    assert run.returncode != 0 and "Evaluation will be deprecated" in run.stderr, run.stderr[-2000:]


def test_use_kt_train_chat_eval_run_through_ktcore(tmp_path, tiny_model_dir, shared_data):
    """USE_KT=1 llamafactory-cli train CFG.yaml trains through ktcore (its JSON summary, the adapter); chat and eval of the same YAML with the adapter run through ktcore too, and the
    trained adapter lowers the evaluation loss on its own data."""
    out = tmp_path / "out"
    keys = base_keys(tiny_model_dir, shared_data, out, max_steps=12, max_samples=8)
    cfg = write_yaml(tmp_path / "cfg.yaml", **keys)
    train = _cli("train", cfg, USE_KT="1")
    assert train.returncode == 0, train.stderr[-3000:]
    summary = _summary(train.stdout)
    assert summary["frontend"] == "llamafactory" and summary["steps"] == 12 and summary["kt_backend"]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()

    chat = _cli("chat", cfg, f"adapter_name_or_path={out}", "max_new_tokens=4", stdin="hello\n\n")
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "Welcome to LLaMA Factory" not in chat.stdout + chat.stderr

    evals = {}
    for name, extra in (("base", []), ("tuned", [f"adapter_name_or_path={out}"])):
        run = _cli("eval", cfg, "eval_dataset=identity", f"output_dir={tmp_path / ('eval_' + name)}", *extra)
        assert run.returncode == 0, run.stderr[-3000:]
        evals[name] = _summary(run.stdout)
    for result in evals.values():
        assert math.isfinite(result["eval_loss"]) and result["eval_dataset"] == "identity"
        assert result["perplexity"] == pytest.approx(math.exp(result["eval_loss"]))
    assert evals["tuned"]["eval_loss"] < 0.9 * evals["base"]["eval_loss"], evals
    assert (tmp_path / "eval_tuned" / "eval_results.json").is_file()  # LLaMA-Factory's own record
