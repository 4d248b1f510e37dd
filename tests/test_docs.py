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


def test_every_python_name_the_docs_call_exists():
    """A function the README or docs/ show being called (`ktcore.testing.upcycle.upcycle(...)`) resolves: the
    README once documented `ktcore.testing.upcycle(...)`, which is a module."""
    import importlib
    import re

    root = Path(__file__).resolve().parents[1]
    texts = [README, *(p.read_text() for p in sorted((root / "docs").glob("*.md")))]
    names = sorted({m for text in texts for m in re.findall(r"`(ktcore(?:\.\w+)+)\(", text)})
    assert "ktcore.testing.upcycle.upcycle" in names
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            assert obj is not None, f"{name}: no {attr!r}"
        assert callable(obj) and not isinstance(obj, type(importlib)), f"{name} is not a function"
