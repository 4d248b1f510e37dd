"""The outputs of ``ktcore train --frontend trl`` under kill -9 (issue 20, items 2, 5 and 8).

- The final adapter is published into output_dir as one unit: killed at every step of ``save_adapter`` (after
  the old ``adapter_config.json`` is removed, after the first file is moved in), output_dir holds no adapter
  that ``ktcore adapter verify`` accepts -- never the new weights beside a previous run's config (alpha 32 where
  64 was trained).
- ``resume_from_checkpoint: true`` on a finished run trains nothing and says so in one line; where the final
  save was cut short it writes the final adapter from the last checkpoint, the same bytes the final save wrote.
- A kill inside ``publish`` (between its two renames, on a system without an atomic swap) never costs the
  checkpoint: ``clean_staging`` puts the complete copy back.
- ``kt_num_threads`` above the usable cores is capped with one note.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml

pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

from ktcore_tiny import tiny_qwen3_moe  # noqa: E402
from ktcore.commands.demo import build_byte_tokenizer  # noqa: E402
from ktcore.files import FAULT_ENV, sha256_file  # noqa: E402
from ktcore.testing.kills import previous_adapter, run_ktcore  # noqa: E402
from ktcore.plugins.threads import usable_cores  # noqa: E402

pytestmark = pytest.mark.slow
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe_final")
    tokenizer = build_byte_tokenizer()
    tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_final_adapter_under_kill_and_resume_at_the_end(tmp_path, model_dir, shared_data):
    out = tmp_path / "run"
    previous_adapter(model_dir, out)
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(dict(
        model_name_or_path=str(model_dir), stage="sft", lora_target="all", lora_rank=8, lora_alpha=64,
        dataset_dir=str(shared_data), dataset="identity", max_samples=8, template="default", cutoff_len=64,
        output_dir=str(out), overwrite_output_dir=True, per_device_train_batch_size=2, learning_rate=3e-3,
        max_steps=4, save_steps=2, logging_steps=1, seed=0, use_kt=True,
        kt_config={"kt_backend": "torch", "kt_num_threads": usable_cores() + 94})))

    killed = run_ktcore("train", config, "--frontend", "trl", fault="save_adapter:old-config-removed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # item 8: more threads than cores -> capped, said once
    assert killed.stderr.count(f"kt_num_threads {usable_cores() + 94} is more than the {usable_cores()} cores") == 1
    assert not (out / "adapter_config.json").exists()  # the previous run's config is gone before any new file lands
    refused = run_ktcore("adapter", "verify", out)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    killed = run_ktcore("train", config, "--frontend", "trl", fault="save_adapter:file-moved")  # after the first move
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (out / "adapter_config.json").exists() and run_ktcore("adapter", "verify", out).returncode == 2
    [staged] = [p for p in out.iterdir() if p.name.startswith(".adapter.ktcore-")]
    ckpt = out / "checkpoint-4"
    final = {n: staged / n if (staged / n).exists() else out / n for n in ADAPTER}
    assert (staged / "adapter_config.json").exists()  # moved in last
    # the final save writes the last checkpoint's adapter byte for byte: republishing it from there is exact
    assert all(sha256_file(final[n]) == sha256_file(ckpt / n) for n in ADAPTER)

    resumed = run_ktcore("train", config, "--frontend", "trl", "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout[resumed.stdout.index("{"):])
    assert summary["nothing_to_train"] and summary["steps"] == 4
    notes = [line for line in resumed.stderr.splitlines() if "nothing to train" in line]
    assert len(notes) == 1 and "written from checkpoint-4" in notes[0], resumed.stderr[-3000:]
    assert not staged.exists() and not (out / "checkpoint-5").exists() and not (out / "checkpoint-6").exists()
    assert all(sha256_file(out / n) == sha256_file(ckpt / n) for n in ADAPTER)
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 64
    assert run_ktcore("adapter", "verify", out).returncode == 0

    stamps = {n: (out / n).stat().st_mtime_ns for n in ADAPTER}
    again = run_ktcore("train", config, "--frontend", "trl", "resume_from_checkpoint=true")
    assert again.returncode == 0, again.stderr[-3000:]
    notes = [line for line in again.stderr.splitlines() if "nothing to train" in line]
    assert len(notes) == 1 and "holds its final adapter" in notes[0], again.stderr[-3000:]
    assert {n: (out / n).stat().st_mtime_ns for n in ADAPTER} == stamps  # overwrites nothing
    more = run_ktcore("train", config, "--frontend", "trl", "resume_from_checkpoint=true", "max_steps=5",
                      "save_steps=5")
    assert more.returncode == 0 and json.loads(more.stdout[more.stdout.index("{"):])["steps"] == 5, more.stderr[-3000:]


PUBLISH = textwrap.dedent("""
    import sys
    from pathlib import Path

    import ktcore.files
    from ktcore_trl.checkpoints import publish, seal

    if sys.argv[2] == "no-swap":
        ktcore.files.exchange = lambda a, b: False  # a system without renameat2: publish's two renames
    out = Path(sys.argv[1])
    staging = out / ".tmp-checkpoint-3" / "checkpoint-3"
    staging.mkdir(parents=True)
    (staging / "adapter_model.safetensors").write_bytes(b"new")
    seal(staging, 3)
    publish(staging, out / "checkpoint-3")
""")


@pytest.mark.parametrize("swap,step", [("swap", "replace:swapped"), ("no-swap", "replace:moved-old")])
def test_a_kill_inside_publish_never_costs_the_checkpoint(tmp_path, swap, step):
    from ktcore_trl.checkpoints import clean_staging, problem, seal

    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "adapter_model.safetensors").write_bytes(b"old")
    seal(out / "checkpoint-3", 3)
    env = {**os.environ, FAULT_ENV: step}
    child = subprocess.run([sys.executable, "-c", PUBLISH, str(out), swap], env=env, capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert (out / "checkpoint-3").exists() == (swap == "swap")  # without a swap: killed between the renames
    clean_staging(out)
    assert problem(out / "checkpoint-3") is None
    assert (out / "checkpoint-3" / "adapter_model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]


def test_resume_at_the_end_of_an_epoch_run_trains_nothing(tmp_path, model_dir, shared_data):
    """Without max_steps the run's end is its epochs: a resume from the last checkpoint trains nothing, one asking
    for more epochs trains on."""
    out = tmp_path / "run"
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(dict(
        model_name_or_path=str(model_dir), stage="sft", lora_target="all", lora_rank=8, dataset_dir=str(shared_data),
        dataset="identity", max_samples=4, template="default", cutoff_len=64, output_dir=str(out),
        per_device_train_batch_size=2, num_train_epochs=1.5, save_steps=1, logging_steps=1, seed=0, use_kt=True,
        kt_config={"kt_backend": "torch"})))
    first = run_ktcore("train", config, "--frontend", "trl")
    assert first.returncode == 0, first.stderr[-3000:]
    steps = json.loads(first.stdout[first.stdout.index("{"):])["steps"]
    resumed = run_ktcore("train", config, "--frontend", "trl", "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout[resumed.stdout.index("{"):]).get("nothing_to_train"), resumed.stderr[-3000:]
    more = run_ktcore("train", config, "--frontend", "trl", "resume_from_checkpoint=true",
                  "num_train_epochs=3")
    assert more.returncode == 0, more.stderr[-3000:]
    assert json.loads(more.stdout[more.stdout.index("{"):])["steps"] > steps


def test_a_new_final_save_removes_only_the_files_the_last_one_wrote(tmp_path, model_dir):
    """A second save_adapter into output_dir: files of the first save it does not write again (here the chat
    template: left behind it would change how ``ktcore chat`` formats prompts) go, a user's file stays."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ktcore_trl.final import save_adapter

    out = tmp_path / "run"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    save_adapter(model, tokenizer, out)
    templates = [p.name for p in out.iterdir() if "chat_template" in p.name]
    assert templates, sorted(p.name for p in out.iterdir())  # the tokenizer wrote its template as a file
    (out / "notes.md").write_text("mine")
    tokenizer.chat_template = None
    save_adapter(model, tokenizer, out)
    assert not [p.name for p in out.iterdir() if "chat_template" in p.name]
    assert (out / "notes.md").read_text() == "mine" and (out / "adapter_config.json").is_file()
    assert not [p.name for p in out.iterdir() if ".ktcore-" in p.name and p.name != ".ktcore-output.json"]
