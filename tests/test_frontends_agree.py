"""Same YAML, both frontends: the first-step losses agree within 1e-4 (fp32, same seed and data).

The TRL frontend runs in this venv, the LLaMA-Factory frontend in .venv-llamafactory (its pins differ), each
through `ktcore train` in a subprocess; the summaries' exact first-step losses are compared.

Step one sees one batch holding every example (per_device_train_batch_size >= max_samples), so the result
does not depend on either trainer's shuffling; the LoRA B factors start at zero, so the LoRA init does not
matter either. What is compared is what matters: template rendering, tokenization, prompt masking, padding
and the loss normalisation of each frontend, on the same ktcore model. DPO's first step is log(2) in both
(policy == reference), which is checked too when the TRL frontend runs DPO.

Both objectives include the MoE load-balancing loss with the model config's router_aux_loss_coef (TRL's
trainers switch router logits on for every MoE model; the llamafactory frontend sets LLaMA-Factory's
moe_aux_loss_coef to match), also for this model, whose config does not ask for router logits.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LF_VENV = REPO / ".venv-llamafactory"
LF_KTCORE = LF_VENV / "bin" / "ktcore"


def _summary(stdout: str) -> dict:
    start = 0 if stdout.startswith("{\n") else stdout.rfind("\n{\n")
    assert start >= 0, f"no summary in the output:\n{stdout[-3000:]}"
    return json.JSONDecoder().raw_decode(stdout[start:].lstrip())[0]


def _train(ktcore_bin, cfg_path: Path, timeout=900) -> dict:
    proc = subprocess.run([str(ktcore_bin), "train", str(cfg_path), "--frontend", cfg_path.stem.split("-")[0]],
                          capture_output=True, text=True, timeout=timeout, cwd=cfg_path.parent)
    assert proc.returncode == 0, f"{cfg_path.stem} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return _summary(proc.stdout)


@pytest.fixture
def tiny_model_dir(tmp_path):
    from ktcore.testing.tiny import save_tiny_chat_moe

    return save_tiny_chat_moe(tmp_path / "model")


def _keys(model_dir, data_dir, out, **extra):
    keys = dict(model_name_or_path=str(model_dir), stage="sft", do_train=True, finetuning_type="lora",
                lora_target="all", lora_rank=8, lora_alpha=16, lora_dropout=0.0, dataset_dir=str(data_dir),
                dataset="identity", template="default", cutoff_len=1024, max_samples=8, output_dir=str(out),
                overwrite_output_dir=True, logging_steps=1, save_steps=100000, report_to="none",
                per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=1,
                lr_scheduler_type="constant", seed=42, use_kt=True, kt_config={"kt_backend": "torch"})
    keys.update(extra)
    return keys


def _both(tmp_path, keys) -> tuple[dict, dict]:
    results = {}
    for frontend, binary in (("trl", Path(sys.executable).with_name("ktcore")), ("llamafactory", LF_KTCORE)):
        cfg = tmp_path / f"{frontend}-{keys['stage']}.yaml"
        cfg.write_text(yaml.safe_dump({**keys, "output_dir": str(tmp_path / f"out-{frontend}-{keys['stage']}")}))
        results[frontend] = _train(binary, cfg)
    return results["trl"], results["llamafactory"]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["identity", "alpaca_en_demo"])
def test_sft_first_step_loss_agrees(tmp_path, tiny_model_dir, shared_data, dataset):
    if not LF_KTCORE.is_file():
        pytest.skip(f"{LF_VENV.name} does not exist: run bash scripts/setup_llamafactory.sh (bash scripts/test.sh builds it unless "
                    "KTCORE_LLAMAFACTORY=0) to compare the frontends")
    trl, lf = _both(tmp_path, _keys(tiny_model_dir, shared_data, tmp_path / "out", dataset=dataset))
    assert trl["steps"] == lf["steps"] == 1
    assert math.isfinite(trl["first_loss"]) and math.isfinite(lf["first_loss"])
    assert abs(trl["first_loss"] - lf["first_loss"]) <= 1e-4, (trl["first_loss"], lf["first_loss"])


@pytest.mark.slow
def test_dpo_first_step_loss_agrees(tmp_path, tiny_model_dir, shared_data):
    if not LF_KTCORE.is_file():
        pytest.skip(f"{LF_VENV.name} does not exist: run bash scripts/setup_llamafactory.sh")
    keys = _keys(tiny_model_dir, shared_data, tmp_path / "out", stage="dpo", dataset="dpo_en_demo", max_samples=4,
                 per_device_train_batch_size=4, cutoff_len=512)
    trl, lf = _both(tmp_path, keys)
    assert abs(trl["first_loss"] - lf["first_loss"]) <= 1e-4, (trl["first_loss"], lf["first_loss"])
    assert abs(lf["first_loss"] - math.log(2)) <= 1e-5
