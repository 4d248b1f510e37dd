"""Every example YAML is valid and names an architecture ktcore handles."""

from pathlib import Path

import pytest

from ktcore.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path):
    cfg = load_config(path, quiet=True)
    assert cfg.model_name_or_path
    assert cfg.use_kt


def test_examples_cover_the_families():
    names = {p.stem for p in EXAMPLES}
    assert {"demo", "smollm2", "deepseek_v2_lite", "deepseek_v3", "qwen3_moe_30b", "mixtral_8x7b"} <= names
