"""The README documents every config key and every CLI command (the newcomer's path stays true)."""

from dataclasses import fields
from pathlib import Path

from ktcore.commands.cli import main
from ktcore.config import KT_SECTION_KEYS, KTConfig, TrainConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_config_key_is_documented():
    keys = [f.name for f in fields(TrainConfig) if not f.metadata.get("internal") and f.name != "kt_config"]
    keys += [f"kt_config.{f.name}" for f in fields(KTConfig) if f.name in KT_SECTION_KEYS]
    missing = [k for k in keys if f"`{k}`" not in README]
    assert not missing, f"README lacks config keys: {missing}"


def test_every_cli_command_is_documented():
    missing = [name for name in main.commands if name not in README]
    assert not missing, f"README lacks commands: {missing}"


def test_readme_commands_exist():
    root = Path(__file__).resolve().parents[1]
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/setup.sh"):
        assert script in README, script
        assert (root / script).is_file(), script
    assert "scripts/test.sh" in (root / ".ci" / "run").read_text()
