"""``llamafactory-cli`` (and ``lmf``) in the LLaMA-Factory environment ktcore builds.

This package installs these console scripts over LLaMA-Factory's own (scripts/setup_llamafactory.sh installs it
after llamafactory). ``train``, ``chat`` and ``eval`` of a YAML or JSON config whose ``use_kt`` is true (in the
file, or as a ``use_kt=true`` override after it) run through ktcore: ``ktcore train CFG --frontend llamafactory``,
``ktcore chat CFG`` and ``ktcore eval CFG --frontend llamafactory``, the overrides passed on. Every other call,
and these without ``use_kt``, is LLaMA-Factory's own ``llamafactory.cli.main`` unchanged (``USE_KT=1`` alone is
LLaMA-Factory's launcher switch and changes nothing here). Kept import-light: LLaMA-Factory or ktcore's commands
are imported only once the choice is made.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

TRUE = ("1", "true", "yes", "y", "on")
KT_COMMANDS = {"train": ["--frontend", "llamafactory"], "chat": [], "eval": ["--frontend", "llamafactory"]}


def _truthy(value) -> bool:
    return value is True or (isinstance(value, (str, int)) and str(value).strip().lower() in TRUE)


def use_kt(config: str, overrides: list[str]) -> bool:
    """Whether ``config`` (YAML or JSON) with LLaMA-Factory's ``key=value`` ``overrides`` sets ``use_kt``; a file
    that cannot be read is left to LLaMA-Factory, which reports it its own way."""
    for item in reversed(overrides):
        key, sep, value = item.partition("=")
        if sep and key.strip().lstrip("-") == "use_kt":
            return _truthy(value)
    import yaml

    path = Path(config)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):  # ValueError covers JSON and decoding errors
        return False
    return isinstance(data, dict) and _truthy(data.get("use_kt"))


def ktcore_args(argv: list[str]) -> Optional[list[str]]:
    """The ``ktcore`` command line for ``llamafactory-cli`` arguments ``argv``, or None: LLaMA-Factory's own."""
    if len(argv) < 2 or argv[0] not in KT_COMMANDS or not argv[1].endswith((".yaml", ".yml", ".json")):
        return None
    if not use_kt(argv[1], argv[2:]):
        return None
    return [argv[0], argv[1], *KT_COMMANDS[argv[0]], *argv[2:]]


def main() -> None:
    args = ktcore_args(sys.argv[1:])
    if args is None:
        from llamafactory.cli import main as llamafactory_main

        llamafactory_main()
        return
    from ktcore.commands.cli import main as ktcore_main

    ktcore_main(args, prog_name="ktcore")
