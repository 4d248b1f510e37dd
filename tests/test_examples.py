"""Every example training YAML is valid and names an architecture ktcore handles; the accelerate config
(``*_accelerate.yaml``) is accelerate's, FSDP2 settings only."""

from pathlib import Path

import pytest

from ktcore.config import load_config

ALL = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
ACCELERATE = [p for p in ALL if p.stem.endswith("_accelerate")]  # accelerate launch --config_file, not ktcore's
EXAMPLES = [p for p in ALL if p not in ACCELERATE]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    cfg = load_config(path, quiet=True)
    assert cfg.model_name_or_path
    assert cfg.use_kt


def test_examples_cover_the_families():
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "smollm2", "deepseek_v2_lite", "deepseek_v3", "qwen3_moe_30b", "mixtral_8x7b"} <= names


def test_fsdp2_accelerate_config_is_accelerates():
    """accelerate reads it as an FSDP2 launch; it holds no training or KT key (the training YAML holds those)."""
    import yaml

    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    path = next(p for p in ACCELERATE if p.stem == "fsdp2_accelerate")
    config = load_config_from_file(str(path))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    keys = set(yaml.safe_load(path.read_text()))
    assert not keys & {"use_kt", "kt_config", "model_name_or_path", "output_dir"}, keys
