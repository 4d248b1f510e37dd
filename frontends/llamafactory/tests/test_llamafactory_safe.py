"""The outputs of ``ktcore train --frontend llamafactory`` under kill -9, and its dataset paths (issue 20, items 2,
3, 5 and 6), on real LLaMA-Factory runs of the tiny model.

- The final adapter is published into output_dir as one unit: killed at every step of the save (after the old
  ``adapter_config.json`` is removed, after the first file is moved in), output_dir holds no adapter that
  ``ktcore adapter verify`` accepts -- never the new weights beside a previous run's config (alpha 32 where 64 was
  trained). The adapter carries ``kt_integrity.json`` (verify checks it, a flipped byte is refused) and ktcore's
  marker, with the usual file modes.
- ``resume_from_checkpoint: true`` on a finished run trains nothing and says so in one line; where the final save
  was cut short it writes the final adapter from the last checkpoint, the same bytes the final save wrote.
- A dataset ``file_name`` that leaves ``dataset_dir`` (``..``, an absolute path, a symlink, a folder holding a
  symlink) is refused in one line with exit 2, before LLaMA-Factory is imported.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from conftest import base_keys, write_yaml

from ktcore.files import sha256_file
from ktcore.testing.kills import previous_adapter, run_ktcore

pytestmark = pytest.mark.slow
ADAPTER = ("adapter_config.json", "adapter_model.safetensors")


def summary_of(result) -> dict:
    """The JSON summary ``ktcore train`` prints last (LLaMA-Factory's trainer prints its log dicts before it)."""
    starts = [i for i in range(len(result.stdout)) if result.stdout.startswith("{", i)
              and (i == 0 or result.stdout[i - 1] == "\n")]
    for start in reversed(starts):
        try:
            return json.loads(result.stdout[start:])
        except ValueError:
            continue
    raise AssertionError(f"no JSON summary on stdout: {result.stdout[-2000:]}")


def test_final_adapter_under_kill_integrity_and_resume_at_the_end(tmp_path, tiny_model_dir, shared_data):
    out = tmp_path / "run"
    previous_adapter(tiny_model_dir, out)
    config = write_yaml(tmp_path / "train.yaml", **base_keys(tiny_model_dir, shared_data, out, lora_alpha=64,
                                                             max_samples=8, max_steps=3, save_steps=3))

    killed = run_ktcore("train", config, "--frontend", "llamafactory", fault="save_adapter:old-config-removed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (out / "adapter_config.json").exists()  # the previous run's config is gone before any new file lands
    refused = run_ktcore("adapter", "verify", out)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    killed = run_ktcore("train", config, "--frontend", "llamafactory", fault="save_adapter:file-moved")  # first move
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (out / "adapter_config.json").exists() and run_ktcore("adapter", "verify", out).returncode == 2
    [staged] = [p for p in out.iterdir() if p.name.startswith(".adapter.ktcore-")]
    assert (staged / "adapter_config.json").exists() and (staged / "kt_integrity.json").exists()  # config last
    ckpt = out / "checkpoint-3"
    final = {n: staged / n if (staged / n).exists() else out / n for n in ADAPTER}
    # the final save writes the last checkpoint's adapter byte for byte: republishing it from there is exact
    assert all(sha256_file(final[n]) == sha256_file(ckpt / n) for n in ADAPTER)

    resumed = run_ktcore("train", config, "--frontend", "llamafactory", "resume_from_checkpoint=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = summary_of(resumed)
    assert summary["nothing_to_train"] and summary["steps"] == 3 and summary["frontend"] == "llamafactory"
    notes = [line for line in resumed.stderr.splitlines() if "nothing to train" in line]
    assert len(notes) == 1 and "written from checkpoint-3" in notes[0], resumed.stderr[-3000:]
    assert not staged.exists() and not (out / "checkpoint-4").exists()
    assert all(sha256_file(out / n) == sha256_file(ckpt / n) for n in ADAPTER)
    assert json.loads((out / "adapter_config.json").read_text())["lora_alpha"] == 64
    verified = run_ktcore("adapter", "verify", out)
    assert verified.returncode == 0 and "kt_integrity.json" in verified.stdout + verified.stderr, verified

    stamps = {n: (out / n).stat().st_mtime_ns for n in ADAPTER}
    again = run_ktcore("train", config, "--frontend", "llamafactory", "resume_from_checkpoint=true")
    assert again.returncode == 0, again.stderr[-3000:]
    notes = [line for line in again.stderr.splitlines() if "nothing to train" in line]
    assert len(notes) == 1 and "holds its final adapter" in notes[0], again.stderr[-3000:]
    assert {n: (out / n).stat().st_mtime_ns for n in ADAPTER} == stamps  # overwrites nothing

    # asking for more trains on, and that final save (LLaMA-Factory's save_model) is sealed and marked too
    more = run_ktcore("train", config, "--frontend", "llamafactory", "resume_from_checkpoint=true", "max_steps=4",
                  "save_steps=4")
    assert more.returncode == 0 and summary_of(more)["steps"] == 4, more.stderr[-3000:]
    marker = json.loads((out / ".ktcore-output.json").read_text())
    assert marker["command"] == "train" and {*ADAPTER, "kt_integrity.json"} <= set(marker["files"])
    assert all((out / n).stat().st_mode & 0o777 == 0o644 for n in marker["files"])
    record = json.loads((out / "kt_integrity.json").read_text())["files"]
    assert record["adapter_model.safetensors"]["sha256"] == sha256_file(out / "adapter_model.safetensors")
    assert not [p for p in out.iterdir() if p.name.startswith(".adapter.ktcore-")]
    assert run_ktcore("adapter", "verify", out).returncode == 0
    weights = out / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    tampered = run_ktcore("adapter", "verify", out)
    assert tampered.returncode == 2 and "kt_integrity.json" in tampered.stderr, tampered.stderr


@pytest.fixture
def data_dir(tmp_path, shared_data):
    """A copy of the demo datasets whose dataset_info.json the test may change."""
    return Path(shutil.copytree(shared_data, tmp_path / "data"))


def _with_file_name(data_dir: Path, file_name: str) -> None:
    info = json.loads((data_dir / "dataset_info.json").read_text())
    info["identity"]["file_name"] = file_name
    (data_dir / "dataset_info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "folder-with-symlink"])
def test_a_dataset_file_name_outside_dataset_dir_is_refused(tmp_path, tiny_model_dir, data_dir, how):
    from ktcore.config import ConfigError, load_config
    from ktcore_llamafactory.train import check_config

    config = write_yaml(tmp_path / "train.yaml", **base_keys(tiny_model_dir, data_dir, tmp_path / "out"))
    check_config(load_config(config))  # the demo data as it is passes
    outside = tmp_path / "secret.json"
    shutil.copy(data_dir / json.loads((data_dir / "dataset_info.json").read_text())["identity"]["file_name"], outside)
    if how == "dotdot":
        _with_file_name(data_dir, "../secret.json")
    elif how == "absolute":
        _with_file_name(data_dir, str(outside))
    elif how == "symlink":
        (data_dir / "link.json").symlink_to(outside)
        _with_file_name(data_dir, "link.json")
    else:
        (data_dir / "identity_parts").mkdir()
        (data_dir / "identity_parts" / "part.json").symlink_to(outside)
        _with_file_name(data_dir, "identity_parts")
    with pytest.raises(ConfigError, match="dataset 'identity': file_name"):
        check_config(load_config(config))
    refused = run_ktcore("train", config, "--frontend", "llamafactory")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "refusing" in lines[0], refused.stderr[-3000:]
    assert not (tmp_path / "out").exists()
