"""Frontends that live in an environment of their own.

A frontend whose pins clash with this environment's (LLaMA-Factory's do with TRL's) is installed in a virtual
environment named ``.venv-NAME``, by ``scripts/setup_NAME.sh`` where the source tree has one. ``ktcore train
--frontend NAME`` in an environment without NAME runs the same command with that environment's interpreter. The
environments are looked for in ``$KTCORE_FRONTEND_ENVS`` (a directory) or else in ktcore's source tree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

ENVS_VARIABLE = "KTCORE_FRONTEND_ENVS"
_HANDED_OVER = "KTCORE_FRONTEND_HANDED_OVER"  # set in the other environment: never hand over twice


def source_tree() -> Optional[Path]:
    """ktcore's source tree when it runs from one (an editable install), else None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir() else None


def _envs_dir() -> Optional[Path]:
    given = os.environ.get(ENVS_VARIABLE)
    return Path(given) if given else source_tree()


def _ready(env: Path) -> bool:
    """The environment has an interpreter and ktcore installed (a half-built one has not)."""
    return (env / "bin" / "python").exists() and any(env.glob("lib/python*/site-packages/ktcore-*.dist-info"))


def environments() -> dict[str, Path]:
    """Frontend name -> the python of the ready environment ``.venv-NAME`` that holds it."""
    where = _envs_dir()
    if where is None or not where.is_dir():
        return {}
    return {env.name[len(".venv-"):]: env / "bin" / "python" for env in sorted(where.glob(".venv-*")) if _ready(env)}


def setup_script(name: str) -> Optional[Path]:
    tree = source_tree()
    script = tree / "scripts" / f"setup_{name}.sh" if tree else None
    return script if script and script.is_file() else None


def not_set_up(name: str) -> Optional[str]:
    """For a frontend that has a setup script but no ready environment: how to make one."""
    script = setup_script(name)
    if script is None or name in environments():
        return None
    return (f"frontend {name!r} runs in an environment of its own, which is not set up (or not finished): `bash "
            f"{script}` builds .venv-{name}, and ktcore train --frontend {name} then runs there")


def hand_over(name: str, argv: list[str]) -> None:
    """Run ``python -m ktcore *argv`` in the environment holding frontend ``name`` (replaces this process); return
    where there is none, or where this process was handed over already."""
    python = environments().get(name)
    if python is None or os.environ.get(_HANDED_OVER):
        return
    print(f"ktcore: frontend {name!r} is installed in {python.parent.parent}: running there", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os.environ[_HANDED_OVER] = name
    os.execv(str(python), [str(python), "-m", "ktcore", *argv])
