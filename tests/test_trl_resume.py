"""Crash-safe checkpoints and resume in the TRL frontend (fp32, tiny Qwen3-MoE, ktcore torch backend).

A training run in a subprocess is SIGKILLed in the middle of writing its third checkpoint (files written,
manifest not yet): the half-written checkpoint is never published as ``checkpoint-N``, ``resume_from_checkpoint:
true`` picks the last complete one, and the resumed loss trajectory (and final adapter) match an uninterrupted
run. Truncated or unfinished checkpoint directories are refused with one line, before any model is loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl", reason="the TRL frontend needs trl (pip install -e frontends/trl)")
pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

from ktcore_tiny import tiny_qwen3_moe  # noqa: E402
from ktcore.config import ConfigError, load_config  # noqa: E402
from ktcore.commands.demo import build_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import os, sys, time

    import ktcore_trl.checkpoints as checkpoints
    from ktcore.config import load_config
    from ktcore_trl.train import run

    config, hang_step, reached = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    real_seal = checkpoints.seal

    def seal(staging, step):  # every file of the checkpoint is written; say where, then hang before its manifest
        if step == hang_step:
            os.write(reached, f"{staging}\\n".encode())
            time.sleep(600)
        return real_seal(staging, step)

    checkpoints.seal = seal
    run(load_config(config, quiet=True))
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe_resume")
    tokenizer = build_byte_tokenizer()
    model = tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _write_config(path: Path, model_dir, data_dir, output_dir, **keys) -> Path:
    cfg = dict(model_name_or_path=str(model_dir), stage="sft", lora_target="all", lora_rank=8,
               dataset_dir=str(data_dir), dataset="identity", max_samples=16, template="default", cutoff_len=64,
               output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
               learning_rate=3e-3, max_steps=10, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1,
               save_steps=3, seed=0, use_kt=True, kt_config={"kt_backend": "torch"})
    cfg.update(keys)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _adapter(directory):
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "adapter_model.safetensors"))


def test_sigkill_mid_save_then_resume_matches_uninterrupted(tmp_path, model_dir, shared_data):
    from ktcore_trl.checkpoints import MANIFEST
    from ktcore_trl.train import run

    full = run(load_config(_write_config(tmp_path / "full.yaml", model_dir, shared_data, tmp_path / "full"), quiet=True))
    assert full["steps"] == 10 and len(full["losses"]) == 10

    out = tmp_path / "killed"
    config = _write_config(tmp_path / "killed.yaml", model_dir, shared_data, out)
    # the child writes the staging directory to a pipe when it hangs in the save: reading it waits for exactly
    # that moment, or for the end of the pipe if the child exits without reaching it (no polling, no deadline)
    reached_r, reached_w = os.pipe()
    log = tmp_path / "child.log"
    with open(log, "wb") as stderr:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(config), "9", str(reached_w)],
                                 pass_fds=(reached_w,), stdout=subprocess.DEVNULL, stderr=stderr, cwd=str(tmp_path))
    os.close(reached_w)
    with os.fdopen(reached_r) as reached:
        line = reached.readline()
    if not line:
        pytest.fail(f"training exited ({child.wait()}) without reaching the save: {log.read_text()[-2000:]}")
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL

    # the killed save left its files in a staging directory, never a checkpoint-9 that resume would load
    staging = Path(line.strip())
    assert staging.is_dir() and (staging / "adapter_model.safetensors").is_file() and not (staging / MANIFEST).exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-6"]
    assert all((out / name / MANIFEST).is_file() for name in ("checkpoint-3", "checkpoint-6"))

    # a truncated copy of a real checkpoint is refused, naming the file
    broken = out / "checkpoint-7"
    shutil.copytree(out / "checkpoint-6", broken)
    with open(broken / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"checkpoint-7' is incomplete: file optimizer.pt is truncated \(100 of"):
        run(load_config(config, [f"resume_from_checkpoint={broken}"], quiet=True))

    # resume_from_checkpoint: true -> the newest complete checkpoint (checkpoint-7 is skipped: truncated)
    resumed = run(load_config(config, ["resume_from_checkpoint=true"], quiet=True))
    assert resumed["resumed_from"] == str(out / "checkpoint-6")
    assert resumed["steps"] == 10 and resumed["first_logged_step"] == 7
    after = resumed["losses"]
    print("uninterrupted steps 7-10:", [round(x, 6) for x in full["losses"][6:]])
    print("resumed       steps 7-10:", [round(x, 6) for x in after])
    assert len(after) == 4
    assert max(abs(a - b) for a, b in zip(after, full["losses"][6:])) <= 1e-4
    assert not staging.parent.exists(), "leftovers of the killed save are cleaned up"
    assert (out / "checkpoint-9").is_dir() and (out / "checkpoint-9" / MANIFEST).is_file()
    final_full, final_resumed = _adapter(tmp_path / "full"), _adapter(out)
    assert final_full.keys() == final_resumed.keys() and any("experts" in k for k in final_full)
    for key in final_full:
        assert (final_full[key] - final_resumed[key]).abs().max() <= 1e-5, key
    state = json.loads((out / "checkpoint-9" / "trainer_state.json").read_text())
    assert state["global_step"] == 9


# ---- refusing incomplete checkpoints, before any model is loaded ---------------------------------------------


FAKE_SIZES = {"adapter_model.safetensors": 300, "optimizer.pt": 3 * 2**20 + 500, "trainer_state.json": 50}


def _fake_checkpoint(out: Path, step: int, seal: bool = True) -> Path:
    from ktcore_trl import checkpoints

    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    rng = random.Random(step)
    for name, size in FAKE_SIZES.items():
        (path / name).write_bytes(rng.randbytes(size))
    if seal:
        checkpoints.seal(path, step)
    return path


@pytest.fixture
def no_model_load(monkeypatch):
    import ktcore_trl.train as train

    def refuse(cfg):
        raise AssertionError("the model was loaded before the bad checkpoint was reported")

    monkeypatch.setattr(train, "load_base_model", refuse)


def test_incomplete_checkpoints_are_refused(tmp_path, model_dir, shared_data, no_model_load):
    from ktcore.frontends import run_frontend
    from ktcore_trl.checkpoints import resolve_resume

    out = tmp_path / "out"
    good = _fake_checkpoint(out, 4)
    truncated = _fake_checkpoint(out, 8)
    with open(truncated / "adapter_model.safetensors", "r+b") as f:
        f.truncate(10)
    unsealed = _fake_checkpoint(out, 12, seal=False)  # what a plain transformers save killed half way leaves
    altered = _fake_checkpoint(out, 16)
    data = bytearray((altered / "optimizer.pt").read_bytes())
    data[2 * 2**20 + 7] ^= 1  # one bit, far past the first MiB of the file
    (altered / "optimizer.pt").write_bytes(data)
    config = _write_config(tmp_path / "c.yaml", model_dir, shared_data, out)

    cases = [(truncated, "file adapter_model.safetensors is truncated (10 of 300 bytes)"),
             (unsealed, "has no ktcore_checkpoint.json, so it was never completed"),
             (altered, "file optimizer.pt does not match its checksum")]
    for path, why in cases:
        with pytest.raises(ConfigError) as err:
            run_frontend("trl", load_config(config, [f"resume_from_checkpoint={path}"], quiet=True))
        message = str(err.value)
        assert why in message and f"resume from {good} instead" in message and "\n" not in message, message
    assert resolve_resume(True, out, "c.yaml") == str(good)  # true: the newest complete one
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_resume(str(out / "checkpoint-99"), out, "c.yaml")
    shutil.rmtree(good)
    with pytest.raises(ConfigError, match=r"has no complete checkpoint-N directory \(3 found, none complete\)"):
        run_frontend("trl", load_config(config, ["resume_from_checkpoint=true"], quiet=True))
