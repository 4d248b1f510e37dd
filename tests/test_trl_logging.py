"""What a user of the TRL frontend sees and keeps: progress bar and log lines, TensorBoard event files, loss and
DPO reward plots, the final summary (steps, tokens, tokens/s, memory, trainable parameters incl. expert LoRA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl", reason="the TRL frontend needs trl (pip install -e frontends/trl)")
pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

from click.testing import CliRunner  # noqa: E402

from ktcore_tiny import tiny_qwen3_moe  # noqa: E402
from ktcore.commands.cli import main  # noqa: E402
from ktcore.commands.demo import build_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe_logging")
    tokenizer = build_byte_tokenizer()
    model = tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _train_cli(tmp_path, **keys) -> tuple[dict, str]:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(keys))
    result = CliRunner().invoke(main, ["train", str(path), "--frontend", "trl"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:])), result.stderr


def _scalars(output_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((output_dir / "runs").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event files under {output_dir / 'runs'}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _common(model_dir, data_dir, out, **keys) -> dict:
    cfg = dict(model_name_or_path=str(model_dir), lora_target="all", lora_rank=8, dataset_dir=str(data_dir),
               template="default", cutoff_len=64, max_samples=8, output_dir=str(out), per_device_train_batch_size=2,
               learning_rate=3e-3, max_steps=6, lr_scheduler_type="constant", logging_steps=2, save_steps=1000,
               seed=0, use_kt=True, kt_config={"kt_backend": "torch"}, report_to="tensorboard", plot_loss=True)
    cfg.update(keys)
    return cfg


def test_sft_progress_tensorboard_plot_summary(tmp_path, model_dir, shared_data):
    out = tmp_path / "sft"
    summary, stderr = _train_cli(tmp_path, stage="sft", dataset="identity,alpaca_en_demo",
                                 **_common(model_dir, shared_data, out))
    # summary
    assert summary["steps"] == 6 and len(summary["losses"]) == 6
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0 and summary["train_seconds"] > 0
    assert summary["peak_host_mem_gb"] > 0
    assert 0 < summary["expert_lora_params"] < summary["trainable_params"] < summary["all_params"]
    assert "ktcore: trainable parameters" in stderr and f"(expert LoRA {summary['expert_lora_params']:,})" in stderr
    # progress bar (tqdm: ETA "<"), loss and tokens/s in it; one log line per logging_steps
    assert "ktcore train" in stderr and "tok/s=" in stderr and "loss=" in stderr and "<" in stderr
    assert [f"step {s}/6 | loss" in stderr for s in (1, 2, 4, 6)] == [True] * 4
    assert "step 3/6 | loss" not in stderr
    # TensorBoard: real event files holding the logged steps and their losses
    scalars = _scalars(out)
    logged = scalars["train/loss"]
    assert [step for step, _ in logged] == [1, 2, 4, 6]
    # the logged loss of step 6 is the mean of steps 5 and 6 (transformers averages since the last log)
    assert logged[-1][1] == pytest.approx(sum(summary["losses"][4:6]) / 2, rel=1e-3)
    assert "train/learning_rate" in scalars and "train/grad_norm" in scalars
    # the loss plot
    png = out / "training_loss.png"
    assert summary["loss_plot"] == str(png) and png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000


def test_dpo_reward_curves_and_tensorboard(tmp_path, model_dir, shared_data):
    out = tmp_path / "dpo"
    summary, stderr = _train_cli(tmp_path, stage="dpo", dataset="dpo_en_demo", **_common(model_dir, shared_data, out))
    assert summary["steps"] == 6 and len(summary["rewards_accuracies"]) == 6 and len(summary["rewards_margins"]) == 6
    assert "rewards/accuracies" in stderr and "rewards/margins" in stderr
    scalars = _scalars(out)
    for tag in ("train/loss", "train/rewards/accuracies", "train/rewards/margins", "train/rewards/chosen",
                "train/rewards/rejected"):
        assert [step for step, _ in scalars[tag]] == [1, 2, 4, 6], tag
    first_acc = scalars["train/rewards/accuracies"][0][1]
    assert first_acc == summary["rewards_accuracies"][0] == 0.0  # step one: policy == reference, no margin
    for name in ("training_loss.png", "training_rewards.png", "training_rewards_accuracies.png"):
        png = out / name
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000, name
    assert summary["rewards_plot"] == str(out / "training_rewards.png")
