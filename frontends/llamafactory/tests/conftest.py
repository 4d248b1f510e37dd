import json
from pathlib import Path

import pytest
import yaml

# under scripts/test.sh a skip for anything but missing hardware fails the run (ktcore/testing/skips.py)
from ktcore.testing.skips import pytest_sessionfinish, pytest_terminal_summary  # noqa: F401

try:
    import llamafactory  # noqa: F401

    LLAMAFACTORY = None
except Exception as exc:  # noqa: BLE001
    LLAMAFACTORY = (f"llamafactory is not importable here ({type(exc).__name__}: {exc}); these tests run in "
                    ".venv-llamafactory: bash scripts/setup_llamafactory.sh")


@pytest.fixture(autouse=True)
def _needs_llamafactory():
    if LLAMAFACTORY:
        pytest.skip(LLAMAFACTORY)


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ktcore import plugins

    plugins.reset_registry()
    yield
    plugins.reset_registry()


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory):
    """LLaMA-Factory's demo datasets: ../shared's (or $KTCORE_SHARED_DATA's) where present, else generated ones."""
    from ktcore.testing.data import demo_data

    return demo_data(tmp_path_factory.mktemp("llamafactory_demo"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (6 routed experts, top-2) and a byte-level tokenizer with a chat template."""
    from ktcore.testing.tiny import save_tiny_chat_moe

    return save_tiny_chat_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


def write_yaml(path: Path, **keys) -> Path:
    path.write_text(yaml.safe_dump(keys, sort_keys=False))
    return path


def base_keys(model_dir, data_dir, output_dir, **extra) -> dict:
    keys = dict(model_name_or_path=str(model_dir), stage="sft", do_train=True, finetuning_type="lora",
                lora_target="all", lora_rank=8, lora_alpha=16, lora_dropout=0.0, dataset_dir=str(data_dir),
                dataset="identity", template="default", cutoff_len=256, max_samples=16, output_dir=str(output_dir),
                overwrite_output_dir=True, logging_steps=1, save_steps=100000, report_to="none",
                per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=5e-3, max_steps=20,
                lr_scheduler_type="constant", warmup_steps=0, seed=42, use_kt=True,
                kt_config={"kt_backend": "torch"})
    keys.update(extra)
    return keys


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())
