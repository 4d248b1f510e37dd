"""Outputs appear whole or not at all, and never over what ktcore did not write (issue 20, items 1 and 2).

Kill tests run the real CLI in a subprocess with ``KTCORE_FAULT_AT`` naming a step of the write (``ktcore.files``):
the process SIGKILLs itself there, and the destination must then hold the old output or the new one, file for
file (SHA-256), never a mix and never neither; the next run to the same destination cleans what the killed one
left. The steps: ``export:shard-renamed`` and ``atomic_file:written`` (inside the staged directory),
``atomic_dir:written`` (a format plugin's own directory), ``output:written`` (before the swap), ``replace:swapped``
(after it, before the old copy is removed) and, on a system without an atomic swap (forced in the child),
``replace:moved-old`` (between the two renames).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from ktcore_tiny import tiny_qwen3_moe

from ktcore.adapters import get_format, load
from ktcore.commands.cli import main
from ktcore.errors import KtcoreError
from ktcore.files import FAULT_ENV, sha256_file
from ktcore.outputs import MARKER

pytestmark = pytest.mark.slow
NO_SWAP = "import ktcore.files as f; f.exchange = lambda a, b: False; from ktcore.commands.cli import main; main()"


def ktcore(*args, fault=None, no_swap=False):
    """The real CLI in a fresh process; ``fault`` names the step at which it kills itself."""
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    head = ["-c", NO_SWAP] if no_swap else ["-m", "ktcore.commands.cli"]
    return subprocess.run([sys.executable, *head, *map(str, args)], env=env, capture_output=True, text=True)


def tree(d) -> dict:
    """relative path -> SHA-256 of every file under ``d`` (a file: its own)."""
    d = Path(d)
    if d.is_file():
        return {d.name: sha256_file(d)}
    return {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def temp_siblings(d) -> list[str]:
    return sorted(p.name for p in Path(d).parent.iterdir() if ".ktcore-" in p.name)


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    """A tiny Qwen3-MoE base and two different (random, non-zero) PEFT adapters A and B for it."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("safe_outputs")
    tiny_qwen3_moe(seed=0).save_pretrained(root / "base")
    for name, seed in (("A", 1), ("B", 2)):
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        base = tiny_qwen3_moe(seed=0)
        torch.manual_seed(seed)  # after building the base, which seeds itself
        model = get_peft_model(base, cfg)
        model.peft_config["default"].base_model_name_or_path = str(root / "base")
        model.save_pretrained(root / name)
        (root / f"{name}.yaml").write_text(f"model_name_or_path: {root / 'base'}\nadapter_name_or_path: {root / name}\n"
                                           "use_kt: true\nkt_config:\n  kt_backend: torch\n")
    return root


def users_directory(d: Path) -> dict:
    """A user's project: a config.json (what used to mark a directory as replaceable), src/ and notes."""
    (d / "src").mkdir(parents=True)
    (d / "config.json").write_text('{"my": "settings"}')
    (d / "src" / "main.py").write_text("print('mine')\n")
    (d / "notes.md").write_text("two years of notes\n")
    return tree(d)


def one_error_line(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---- never over what ktcore did not write -------------------------------------------------------------------


def test_a_users_directory_survives_export_and_adapter_convert(base_and_adapters, tmp_path):
    root = base_and_adapters
    mine = tmp_path / "project"
    before = users_directory(mine)
    one_error_line(ktcore("export", root / "A.yaml", "--out", mine, "--overwrite"), str(mine), "not written by")
    for to in ("peft", "fused_expert"):
        one_error_line(ktcore("adapter", "convert", root / "A", mine, "--to", to, "--overwrite"), str(mine))
    with pytest.raises(KtcoreError):  # nor does a format's save called from Python (config.json is no adapter)
        get_format("peft").save(load(root / "A"), mine)
    assert tree(mine) == before
    # a single-file output: a user's file of that name (even a GGUF) is not replaced either
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"GGUF" + b"\0" * 60)
    one_error_line(ktcore("adapter", "convert", root / "A", model_file, "--to", "gguf", "--overwrite"), str(model_file))
    assert model_file.read_bytes() == b"GGUF" + b"\0" * 60


def test_an_earlier_output_is_replaced_only_with_overwrite_and_by_the_same_command(base_and_adapters, tmp_path):
    root = base_and_adapters
    out = tmp_path / "merged"
    assert CliRunner().invoke(main, ["export", str(root / "A.yaml"), "--out", str(out)]).exit_code == 0
    assert json.loads((out / MARKER).read_text())["command"] == "export"
    first = tree(out)
    run = CliRunner().invoke(main, ["export", str(root / "B.yaml"), "--out", str(out)])
    assert run.exit_code == 2 and "pass --overwrite" in run.output and tree(out) == first
    run = CliRunner().invoke(main, ["adapter", "convert", str(root / "A"), str(out), "--overwrite"])
    assert run.exit_code == 2 and "holds the output of `ktcore export`" in run.output and tree(out) == first
    run = CliRunner().invoke(main, ["export", str(root / "B.yaml"), "--out", str(out), "--overwrite"])
    assert run.exit_code == 0, run.output
    assert tree(out) != first and not temp_siblings(out)
    gguf_out = tmp_path / "a.gguf"
    for args, code in ((["--to", "gguf"], 0), (["--to", "gguf"], 2), (["--to", "gguf", "--overwrite"], 0)):
        run = CliRunner().invoke(main, ["adapter", "convert", str(root / "A"), str(gguf_out), *args])
        assert run.exit_code == code, run.output


# ---- a kill at every rename ---------------------------------------------------------------------------------


def kill_at_every_step(make, dst, refs: dict, steps, no_swap=False):
    """For each step: run ``make(name, fault)`` (writing refs[name], the one ``dst`` does not hold now) killed at
    that step; ``dst`` must then hold one of the outputs whole. A last run without a fault completes and leaves
    no temp files."""
    for step in steps:
        holds = next(n for n, t in refs.items() if tree(dst) == t)
        other = next(n for n in refs if n != holds)
        result = make(other, step, no_swap)
        assert result.returncode == -signal.SIGKILL, (step, result.returncode, result.stderr[-2000:])
        if no_swap and step == "replace:moved-old":
            assert not dst.exists()  # between the two renames: the next run to dst puts the old copy back first
            result = make(other, None, no_swap, overwrite=False)  # ... and then refuses: it is an earlier output
            assert result.returncode == 2 and tree(dst) == refs[holds], result.stderr[-2000:]
        assert tree(dst) in refs.values(), step
    result = make(next(n for n, t in refs.items() if tree(dst) != t), None, no_swap)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not temp_siblings(dst), temp_siblings(dst)


def test_kills_during_export_leave_the_old_or_the_new_model(base_and_adapters, tmp_path):
    root = base_and_adapters

    def make(name, fault, no_swap=False, out=tmp_path / "merged", overwrite=True):
        return ktcore("export", root / f"{name}.yaml", "--out", out, "--shard-size", "0.0001",
                      *(["--overwrite"] if overwrite else []), fault=fault, no_swap=no_swap)

    refs = {}
    for name in "AB":
        assert make(name, None, out=tmp_path / f"ref{name}").returncode == 0
        refs[name] = tree(tmp_path / f"ref{name}")
    assert len(refs["A"]) > 3 and refs["A"] != refs["B"]  # several shards, an index; A and B differ
    assert make("A", None).returncode == 0
    steps = ["export:shard-renamed", "atomic_file:written", "output:written", "replace:swapped"]
    kill_at_every_step(make, tmp_path / "merged", refs, steps)
    kill_at_every_step(make, tmp_path / "merged", refs, ["output:written", "replace:moved-old"], no_swap=True)


@pytest.mark.parametrize("to,steps", [
    ("fused_expert", ["atomic_file:written", "atomic_dir:written", "output:written", "replace:swapped"]),
    ("gguf", ["atomic_file:written", "output:written", "replace:swapped"]),
])
def test_kills_during_adapter_convert_leave_the_old_or_the_new_adapter(base_and_adapters, tmp_path, to, steps):
    root = base_and_adapters
    dst = tmp_path / ("out.gguf" if to == "gguf" else "out")

    def make(name, fault, no_swap=False, out=dst, overwrite=True):
        return ktcore("adapter", "convert", root / name, out, "--to", to, *(["--overwrite"] if overwrite else []),
                      fault=fault, no_swap=no_swap)

    refs = {}
    for name in "AB":
        ref = tmp_path / (f"ref{name}.gguf" if to == "gguf" else f"ref{name}")
        assert make(name, None, out=ref).returncode == 0
        refs[name] = {k.replace(ref.name, dst.name): v for k, v in tree(ref).items()}
    assert refs["A"] != refs["B"]
    assert make("A", None).returncode == 0
    kill_at_every_step(make, dst, refs, steps)
    kill_at_every_step(make, dst, refs, ["replace:moved-old"], no_swap=True)
    assert ktcore("adapter", "verify", dst).returncode == 0


def gguf_to_convert(tmp_path):
    """(a tiny Mixtral GGUF, the --out folder, the Q8_0 file ``ktcore convert`` writes there); skips where the
    llamafile backend's converter is missing."""
    pytest.importorskip("gguf")
    from archs import tiny_model
    from test_gguf import write_gguf

    from ktcore.plugins.select import resolve_backend

    why = resolve_backend("llamafile").reasons.get("llamafile", "not installed")
    if why is not None and not why.startswith("usable"):
        pytest.skip(f"ktcore convert needs the llamafile backend's converter: {why}")
    src = tmp_path / "m.gguf"
    write_gguf(tiny_model("mixtral", seed=4), "mixtral", src)
    return src, tmp_path / "out", tmp_path / "out" / "m.q8_0.gguf"


def test_kills_during_convert_leave_no_partial_gguf(tmp_path):
    """``ktcore convert``: killed before its rename, the output is absent (or the earlier one intact), never a
    partial GGUF; the next run removes the killed run's temp file and writes it whole."""
    from ktcore.weights.gguf_reader import GGUFFile

    src, out, dst = gguf_to_convert(tmp_path)
    killed = ktcore("convert", src, "--format", "q8_0", "--out", out, fault="output:written")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not dst.exists() and len(temp_siblings(dst)) == 1  # the whole temp file, under ktcore's temp name
    done = ktcore("convert", src, "--format", "q8_0", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not temp_siblings(dst)
    experts = json.loads(done.stdout)["experts"]
    with GGUFFile(dst) as f:  # whole: every converted tensor is there, in the type the converter chose
        assert experts and all(f.type_name(name) == kind.upper() for name, kind in experts.items())
    whole = tree(dst)
    for fault in ("output:written", "replace:swapped"):
        killed = ktcore("convert", src, "--format", "q8_0", "--out", out, "--overwrite", fault=fault)
        assert killed.returncode == -signal.SIGKILL and tree(dst) == whole  # the old copy, or the same new one


def test_convert_of_a_gguf_replaces_only_its_own_output_and_only_with_overwrite(tmp_path):
    """An existing output file is refused in one line naming it, before anything is read, unless it is an earlier
    output of ``ktcore convert`` and --overwrite is given; a file ktcore did not write is never replaced."""
    src, out, dst = gguf_to_convert(tmp_path)
    out.mkdir()
    dst.write_bytes(b"someone else's file")
    for args in ([], ["--overwrite"]):
        one_error_line(ktcore("convert", src, "--format", "q8_0", "--out", out, *args), str(dst))
        assert dst.read_bytes() == b"someone else's file" and not temp_siblings(dst)
    dst.unlink()
    assert ktcore("convert", src, "--format", "q8_0", "--out", out).returncode == 0
    first = tree(dst)
    refused = ktcore("convert", src, "--format", "q8_0", "--out", out)
    one_error_line(refused, "pass --overwrite")
    assert tree(dst) == first
    again = ktcore("convert", dst, "--format", "q8_0", "--out", tmp_path / "again")  # an output as the source
    assert again.returncode == 0, again.stderr[-2000:]
    assert ktcore("convert", src, "--format", "q8_0", "--out", out, "--overwrite").returncode == 0
    assert tree(dst) == first and not temp_siblings(dst)
    usage = CliRunner().invoke(main, ["convert", str(tmp_path), "--out", str(tmp_path / "store"), "--overwrite"])
    assert usage.exit_code == 2 and "--overwrite takes a .gguf MODEL" in usage.output
