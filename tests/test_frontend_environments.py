"""A frontend installed in an environment of its own (``ktcore.frontends.environments``): ``ktcore train --frontend
NAME`` hands over to that environment's interpreter, ``list-frontends`` shows it, and a frontend with a setup
script but no environment yet says in one line how to build one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from fakedist import FakeDists  # noqa: E402

from ktcore.frontends.environments import setup_script  # noqa: E402
from ktcore.plugins import get_registry  # noqa: E402

PLUGIN = '''
from ktcore import hookimpl
from ktcore.specs import FrontendSpec


@hookimpl
def ktcore_register_frontends():
    return [FrontendSpec(name="elsewhere", run="{runner}:run", evaluate="{runner}:evaluate", stages=("sft",),
                         description="in its own venv")]
'''

RUNNER = '''
import sys


def run(cfg):
    return {"ran_in": sys.prefix, "lora_rank": cfg.lora_rank}


def evaluate(cfg):
    return {"evaluated_in": sys.prefix, "eval_dataset": cfg.eval_dataset}
'''


def ktcore_cli(*args, envs: Path):
    env = {**os.environ, "KTCORE_FRONTEND_ENVS": str(envs)}
    env.pop("KTCORE_FRONTEND_HANDED_OVER", None)
    return subprocess.run([sys.executable, "-m", "ktcore", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def make_env(envs: Path, name: str, ready: bool = True) -> Path:
    """A virtual environment ``.venv-NAME`` whose python is this one with a distribution registering the frontend
    'elsewhere' on its path (and ktcore's dist-info, as an installed ktcore leaves, unless not ready)."""
    env = envs / f".venv-{name}"
    dists = FakeDists(env / "dists")
    runner = dists.write_module("elsewhere_runner", RUNNER)
    dists.add("ktcore-elsewhere", {"elsewhere": "elsewhere_plugin"},
              {"elsewhere_plugin": PLUGIN.replace("{runner}", runner)})
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={env / 'dists'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    if ready:
        (env / "lib" / "python3" / "site-packages" / "ktcore-0.1.0.dist-info").mkdir(parents=True)
    return env


def config(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: {tmp_path / 'model'}\noutput_dir: {tmp_path / 'out'}\nlora_rank: 4\n")
    return cfg


def test_train_runs_a_frontend_of_another_environment_there(tmp_path):
    envs = tmp_path / "envs"
    env = make_env(envs, "elsewhere")
    proc = ktcore_cli("train", str(config(tmp_path)), "--frontend", "elsewhere", "lora_rank=6", envs=envs)
    assert proc.returncode == 0, proc.stderr
    assert f"ktcore: frontend 'elsewhere' is installed in {env}: running there" in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["lora_rank"] == 6  # the override travelled with the command

    listing = ktcore_cli("list-frontends", "--json", envs=envs)
    (row,) = [r for r in json.loads(listing.stdout) if r["name"] == "elsewhere"]
    assert str(env) in row["description"]


def test_eval_runs_a_frontend_of_another_environment_there(tmp_path):
    """`ktcore eval --frontend NAME` hands over as `train` does (the overrides travel with it)."""
    envs = tmp_path / "envs"
    env = make_env(envs, "elsewhere")
    proc = ktcore_cli("eval", str(config(tmp_path)), "--frontend", "elsewhere", "eval_dataset=identity", envs=envs)
    assert proc.returncode == 0, proc.stderr
    assert f"ktcore: frontend 'elsewhere' is installed in {env}: running there" in proc.stderr
    assert json.loads(proc.stdout)["eval_dataset"] == "identity"


def test_a_half_built_environment_is_not_used(tmp_path):
    envs = tmp_path / "envs"
    make_env(envs, "elsewhere", ready=False)
    proc = ktcore_cli("train", str(config(tmp_path)), "--frontend", "elsewhere", envs=envs)
    assert proc.returncode == 2 and "running there" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "frontend 'elsewhere' is not available" in proc.stderr


@pytest.mark.skipif("llamafactory" in get_registry().specs("frontend"), reason="the llamafactory frontend is "
                    "installed in this environment")
@pytest.mark.skipif(setup_script("llamafactory") is None, reason="not run from ktcore's source tree")
def test_a_frontend_with_a_setup_script_but_no_environment_says_how_to_build_it(tmp_path):
    envs = tmp_path / "no-envs"
    envs.mkdir()
    proc = ktcore_cli("train", str(config(tmp_path)), "--frontend", "llamafactory", envs=envs)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: frontend 'llamafactory' runs in an environment of its own")
    assert f"`bash {setup_script('llamafactory')}` builds .venv-llamafactory" in line
    listing = json.loads(ktcore_cli("list-frontends", "--json", envs=envs).stdout)
    assert any(r["name"] == "llamafactory" and "not set up" in r["description"] for r in listing)
