"""The built-in demo (``ktcore demo``): a short run completes and the loss falls."""

import json
import re
import subprocess
import sys
from pathlib import Path

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


def _run(args, cwd):
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def _run_on_a_terminal(args, cwd):
    """``args`` with stderr on a pseudo-terminal (as in an interactive shell), stdout a pipe: (stdout, stderr)."""
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    err = b""
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        err += data
    os.close(master)
    out = proc.stdout.read()
    assert proc.wait(timeout=600) == 0, (args, out, err)
    return out.decode(), err.decode(errors="replace").replace("\r\n", "\n")


def test_demo_hands_off_commands_that_work_and_prints_no_noise(tmp_path):
    """``ktcore demo`` ends with the chat and export commands for its adapter; pasted into a shell elsewhere
    they answer and export. None of the three prints the is_gradient_checkpointing FutureWarning, the training
    bar is drawn labelled from its first frame (no unlabelled "0%| 0/N" left behind in a log), and chatting
    with the demo model (its adapter or the random base) stays within its 64 positions, so transformers' max
    length reminder never shows."""
    from ktcore.commands.demo import TASK_LETTERS

    ktcore_exe = str(Path(sys.executable).parent / "ktcore")
    workdir = tmp_path / "demo"
    demo = _run([ktcore_exe, "demo", "--workdir", str(workdir), "--steps", "60"], cwd=tmp_path)
    lines = demo.stdout.splitlines()
    chat_cmd = lines[lines.index(next(l for l in lines if l.startswith("chat with it"))) + 1].strip()
    export_cmd = lines[lines.index(next(l for l in lines if l.startswith("merge it into"))) + 1].strip()
    assert f"adapter_name_or_path={workdir / 'adapter'}" in chat_cmd and " chat " in chat_cmd
    assert " export " in export_cmd and "--out" in export_cmd
    noise = "is_gradient_checkpointing"
    assert noise not in demo.stderr
    frames = re.split(r"[\r\n]", demo.stderr)
    bars = [f for f in frames if re.search(r"\| *\d+/60 \[", f)]
    assert bars and all(f.startswith("ktcore train") for f in bars), [f for f in bars if not f.startswith("ktcore")]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out, err = _run_on_a_terminal(["bash", "-c", chat_cmd], cwd=elsewhere)  # exactly as pasted into a shell
    answer = out.strip()
    # 60 steps teach the answer's form (test_demo_short_run): letters of the task, ended by the end token
    assert answer and set(answer) <= set(TASK_LETTERS), out
    assert noise not in err and "maximum length" not in err, err
    # on a terminal, one line per loading stage; nothing else
    assert [line.rsplit(" (", 1)[0] for line in err.splitlines()] == [
        f"ktcore chat: loading the tokenizer of {workdir / 'model'}",
        "ktcore chat: loading the model (routed experts into the CPU backend)",
        f"ktcore chat: loading the adapter {workdir / 'adapter'}", "ktcore chat: ready"], err

    base = _run([ktcore_exe, "chat", str(workdir / "demo.yaml"), "--prompt", "abcde"], cwd=elsewhere)
    assert base.stdout.strip()  # the random base model rambles until max_new_tokens
    assert base.stderr == "", base.stderr  # into a pipe: no stage lines, no max-length reminder

    export = _run(["bash", "-c", export_cmd], cwd=elsewhere)
    summary = json.loads(export.stdout)
    assert summary["tensors_merged"] > 0 and summary["out"] == str(workdir / "merged")
    assert (workdir / "merged" / "config.json").is_file() and noise not in export.stderr
