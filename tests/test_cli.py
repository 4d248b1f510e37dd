"""The ``ktcore`` command line through click's runner: listings, doctor, and ``train``'s one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

from fakedist import clean_plugin_env, fake_dists  # noqa: E402,F401  (pytest fixtures)

import ktcore  # noqa: E402
from ktcore.commands.cli import main  # noqa: E402

# A frontend, an adapter format and a backend from one third-party distribution. The frontend's run records
# what it was given instead of training.
EXTRAS = """
from ktcore import hookimpl
from ktcore.specs import AdapterFormatSpec, FrontendSpec


@hookimpl
def ktcore_register_frontends():
    return [FrontendSpec(name="fakefront", run="{runner}:run", stages=("sft",), description="records its config"),
            FrontendSpec(name="needs_pkg", run="{runner}:run", required_packages=("ktcore_no_such_pkg_xyz",))]


@hookimpl
def ktcore_register_adapter_formats():
    return [AdapterFormatSpec(name="fakefmt", factory="{runner}:Format", description="a format for tests")]
"""

RUNNER = """
def run(cfg):
    return {"frontend": "fakefront", "lora_rank": cfg.lora_rank, "backend": cfg.kt.kt_backend,
            "output_dir": cfg.output_dir}
"""

GOOD = """
model_name_or_path: some/model
output_dir: out
stage: sft
lora_rank: 8
use_kt: true
kt_config:
  kt_backend: torch
"""


@pytest.fixture
def extras(fake_dists):
    runner = fake_dists.write_module("cli_runner", RUNNER)
    fake_dists.add("ktcore-fake-extras", {"extras": "cli_extras"}, {"cli_extras": EXTRAS.replace("{runner}", runner)})
    return runner


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def ok(*args):
    result = invoke(*args)
    assert result.exit_code == 0, result.output + result.stderr
    return result.stdout


def one_line_error(result, *fragments):
    """exit code 2, a single ``error: ...`` line on stderr, no traceback anywhere."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert isinstance(result.exception, SystemExit)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def write(tmp_path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


# ---- basics ---------------------------------------------------------------------------------------------


def test_help_lists_the_commands(clean_plugin_env):
    out = ok("--help")
    for command in ("plugins", "list-backends", "list-archs", "list-frontends", "list-adapter-formats", "doctor",
                    "train"):
        assert command in out


def test_version(clean_plugin_env):
    assert ok("--version").strip() == f"ktcore, version {ktcore.__version__}"


# ---- plugins ----------------------------------------------------------------------------------------------


def test_plugins_table(extras):
    out = ok("plugins")
    assert out.splitlines()[0].split() == ["NAME", "KIND", "DIST", "VERSION", "STATUS", "REASON"]
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[1:]}
    assert rows["torch"][:5] == ["torch", "expert_backend", "ktcore", ktcore.__version__, "ok"]
    assert rows["fakefront"][:5] == ["fakefront", "frontend", "ktcore-fake-extras", "1.0", "ok"]
    assert rows["fakefmt"][1] == "adapter_format"


def test_plugins_all_shows_broken_and_disabled(extras, fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": "raise ImportError('nope.so')"})
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "extras")
    with pytest.warns(Warning, match="nope.so"):
        plain = ok("plugins")
    assert "brokenmod" not in plain and "fakefront" not in plain
    full = ok("plugins", "--all")
    assert "ImportError: nope.so" in full and "listed in KTCORE_DISABLE_PLUGINS" in full
    (broken,) = [ln for ln in full.splitlines() if ln.startswith("brokenmod")]
    assert broken.split()[1:5] == ["module", "ktcore-fake-broken", "1.0", "broken"]


def test_plugins_json(extras, fake_dists):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": "raise ImportError('nope.so')"})
    with pytest.warns(Warning):
        rows = json.loads(ok("plugins", "--json"))
    assert all(set(r) == {"name", "kind", "entry_point", "dist", "version", "status", "reason"} for r in rows)
    assert {r["status"] for r in rows} == {"ok"}
    rows = json.loads(ok("plugins", "--all", "--json"))
    (broken,) = [r for r in rows if r["status"] == "broken"]
    assert broken["name"] == "brokenmod" and broken["reason"] == "ImportError: nope.so"


def test_plugin_conflict_is_a_one_line_error(fake_dists):
    fake_dists.backend("ktcore-fake-one", "dup", ep="one")
    fake_dists.backend("ktcore-fake-two", "dup", ep="two")
    one_line_error(invoke("plugins"), "two plugins register the expert_backend 'dup'", "ktcore-fake-one",
                   "ktcore-fake-two")


def test_strict_plugins_is_a_one_line_error(fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": "raise ImportError('nope.so')"})
    monkeypatch.setenv("KTCORE_STRICT_PLUGINS", "1")
    one_line_error(invoke("list-backends"), "plugin 'brokenmod' from ktcore-fake-broken 1.0 failed to load")


# ---- list-* ---------------------------------------------------------------------------------------------


def test_list_backends(clean_plugin_env):
    clean_plugin_env.setenv("KTCORE_CPU_FLAGS", "avx2")
    out = ok("list-backends")
    assert out.splitlines()[0].split() == ["NAME", "PRIORITY", "FEATURES", "FORMATS", "BACKWARD"]
    assert any(ln.startswith("* torch") for ln in out.splitlines())
    data = json.loads(ok("list-backends", "--json"))
    torch_row = next(r for r in data["backends"] if r["name"] == "torch")
    assert torch_row["auto"] and torch_row["usable"] and torch_row["reason"] == "chosen by auto"
    assert "chosen by auto" in ok("list-backends", "--explain")


def test_list_archs(clean_plugin_env):
    out = ok("list-archs")
    assert out.splitlines()[0].split() == ["NAME", "HF_ARCHITECTURES", "EXPERTS_MODULE"]
    assert "Qwen3MoeForCausalLM" in out
    rows = json.loads(ok("list-archs", "--json"))
    assert any("Qwen3MoeForCausalLM" in r["hf_architectures"] for r in rows)


def test_list_frontends(extras):
    out = ok("list-frontends")
    assert out.splitlines()[0].split() == ["NAME", "STAGES", "REQUIRES", "DESCRIPTION"]
    (row,) = [ln for ln in out.splitlines() if ln.startswith("fakefront")]
    assert row.split()[:3] == ["fakefront", "sft", "-"]
    rows = {r["name"]: r for r in json.loads(ok("list-frontends", "--json"))}
    assert rows["needs_pkg"]["requires"] == "ktcore_no_such_pkg_xyz"


def test_list_adapter_formats(extras):
    assert "a format for tests" in ok("list-adapter-formats")
    rows = json.loads(ok("list-adapter-formats", "--json"))
    assert {"name": "fakefmt", "description": "a format for tests"} in rows


def test_listing_imports_no_plugin_code(extras):
    for args in (["plugins", "--all"], ["list-frontends"], ["list-adapter-formats"]):
        ok(*args)
    assert extras not in sys.modules


# ---- train ------------------------------------------------------------------------------------------------


def test_train_runs_the_frontend_with_overrides(extras, tmp_path):
    cfg = write(tmp_path, GOOD)
    summary = json.loads(ok("train", cfg, "--frontend", "fakefront", "lora_rank=4", "kt_config.kt_backend=auto"))
    assert summary == {"frontend": "fakefront", "lora_rank": 4, "backend": "auto", "output_dir": "out"}


def test_train_unknown_key_names_the_nearest(extras, tmp_path):
    cfg = write(tmp_path, GOOD + "lora_rnak: 4\n")
    line = one_line_error(invoke("train", cfg, "--frontend", "fakefront"))
    assert line == f"error: {cfg}: unknown key 'lora_rnak'; did you mean 'lora_rank'?"


def test_train_unknown_kt_config_key(extras, tmp_path):
    cfg = write(tmp_path, GOOD + "  kt_backnd: torch\n")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), "unknown key 'kt_config.kt_backnd'",
                   "did you mean 'kt_backend'?")


def test_train_wrong_type(extras, tmp_path):
    cfg = write(tmp_path, GOOD.replace("lora_rank: 8", "lora_rank: eight"))
    line = one_line_error(invoke("train", cfg, "--frontend", "fakefront"))
    assert line == f"error: {cfg}: lora_rank must be int, got 'eight' (str)"


def test_train_bad_choice(extras, tmp_path):
    cfg = write(tmp_path, GOOD + "kt_cpu_activation: recompte\n")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"),
                   "kt_cpu_activation: 'recompte' is not one of retain, recompute", "did you mean 'recompute'?")


def test_train_missing_file(extras, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    line = one_line_error(invoke("train", missing, "--frontend", "fakefront"))
    assert line.startswith(f"error: {missing}: no such config file")


def test_train_bad_yaml_syntax(extras, tmp_path):
    cfg = write(tmp_path, "model_name_or_path: m\nkt_config:\n  kt_backend: [torch\n")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), f"{cfg}: not valid YAML at line")


def test_train_top_level_not_a_mapping(extras, tmp_path):
    cfg = write(tmp_path, "- a\n- b\n")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), "the top level must be a mapping")


def test_train_stage_unknown_to_ktcore(extras, tmp_path):
    cfg = write(tmp_path, GOOD.replace("stage: sft", "stage: ppo"))
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), "stage: 'ppo' is not one of sft, dpo")


def test_train_stage_unsupported_by_the_frontend(extras, tmp_path):
    cfg = write(tmp_path, GOOD.replace("stage: sft", "stage: dpo"))
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"),
                   "stage 'dpo' is not supported by the fakefront frontend (it runs: sft)")


def test_train_missing_required_keys(extras, tmp_path):
    cfg = write(tmp_path, "stage: sft\n")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), "model_name_or_path is required")
    cfg = write(tmp_path, "model_name_or_path: m\n", "two.yaml")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront"), "output_dir is required")


def test_train_bad_override(extras, tmp_path):
    cfg = write(tmp_path, GOOD)
    one_line_error(invoke("train", cfg, "--frontend", "fakefront", "lora_rank"), "must look like key=value")
    one_line_error(invoke("train", cfg, "--frontend", "fakefront", "lora_rnak=3"), "did you mean 'lora_rank'?")


def test_train_unknown_frontend_lists_the_available(extras, tmp_path):
    cfg = write(tmp_path, GOOD)
    result = invoke("train", cfg, "--frontend", "nosuchfront")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith("error: frontend 'nosuchfront' is not available.")
    assert "Choose one of:" in result.stderr and "fakefront" in result.stderr
    assert "needs_pkg: unavailable (needs ktcore_no_such_pkg_xyz" in result.stderr


def test_train_frontend_missing_its_package(extras, tmp_path):
    cfg = write(tmp_path, GOOD)
    result = invoke("train", cfg, "--frontend", "needs_pkg")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.startswith("error: frontend 'needs_pkg' is installed but cannot be used here: "
                                    "needs ktcore_no_such_pkg_xyz: pip install ktcore_no_such_pkg_xyz")


def test_train_legacy_config_prints_a_note(extras, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # ktcore train checks the model path before the frontend
    cfg = write(tmp_path, f"model:\n  model_name_or_path: {tmp_path / 'm'}\noutput:\n  output_dir: o\n"
                          "ktransformers:\n  use_kt: true\n  cpu_infer: 3\n")
    result = invoke("train", cfg, "--frontend", "fakefront")
    assert result.exit_code == 0, result.stderr
    assert "translated legacy KT config" in result.stderr and "cpu_infer -> kt_config.kt_num_threads=3" in result.stderr
    assert json.loads(result.stdout)["output_dir"] == "o"


# ---- doctor -----------------------------------------------------------------------------------------------


def test_doctor_json(clean_plugin_env):
    clean_plugin_env.setenv("KTCORE_CPU_FLAGS", "avx2,fma")
    report = json.loads(ok("doctor", "--json", "--seconds", "0.05"))
    assert report["flags"]["avx2"] is True and report["flags"]["amx_tile"] is False
    assert report["amx_permission"] is False and report["amx_permission_reason"]
    assert report["logical_cores"] >= 1 and report["ram_gib"] > 0
    assert isinstance(report["gpu"], list)
    assert report["dram_read_gbps"] > 0 and report["onednn_bf16_gemm_gflops"] > 0
    assert report["auto_backend"] == "torch"


def test_doctor_text(clean_plugin_env):
    out = ok("doctor", "--seconds", "0.05")
    assert "avx2" in out.lower() and "amx" in out.lower()


# A backend that declares a doctor probe and a converter; its module is imported only when they run.
PROBED = """
from ktcore import hookimpl
from ktcore.specs import ExpertBackendSpec


@hookimpl
def ktcore_register_expert_backends():
    return [ExpertBackendSpec(name="probed", factory="{impl}:Backend", doctor="{impl}:report",
                              converter="{impl}:convert", convert_formats=("q9", "q7"))]
"""

PROBED_IMPL = """
from pathlib import Path


def report(seconds):
    return {"probed_peak_gflops": 123.4, "probed_seconds": seconds}


def convert(model, out, fmt, overwrite=False):
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / ("model." + fmt)).write_text("converted")
    return {"source": model, "format": fmt}
"""


def test_doctor_and_convert_run_what_a_backend_declares(fake_dists, tmp_path):
    impl = fake_dists.write_module("probed_impl", PROBED_IMPL)
    fake_dists.add("ktcore-fake-probed", {"probed": "probed_plugin"}, {"probed_plugin": PROBED.replace("{impl}", impl)})
    report = json.loads(ok("doctor", "--json", "--seconds", "0.05"))
    assert report["probed_peak_gflops"] == 123.4 and report["probed_seconds"] == 0.05
    assert "probed_peak_gflops: 123.4" in ok("doctor", "--seconds", "0.05")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    summary = json.loads(ok("convert", str(model), "--out", str(tmp_path / "out")))
    assert summary["format"] == "q9" and (tmp_path / "out" / "model.q9").is_file()  # the first format is the default
    one_line_error(invoke("convert", str(model), "--format", "q4_k", "--out", str(tmp_path / "out")),
                   "no installed converter writes it", "q9, q7")


def test_core_commands_need_no_backend_plugin(clean_plugin_env, tmp_path):
    """With the built-in plugins only, doctor reports no backend's fields and convert says in one line why not."""
    report = json.loads(ok("doctor", "--json", "--seconds", "0.05"))
    assert not [key for key in report if key.startswith("amx_bf16")]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    one_line_error(invoke("convert", str(model), "--out", str(tmp_path / "out")),
                   "no installed expert backend declares a converter")


_NO_HEAVY_IMPORTS = r'''
import sys
from ktcore.commands.cli import main
try:
    main(sys.argv[1:], prog_name="ktcore")
except SystemExit as exc:
    heavy = sorted(m for m in ("torch", "transformers", "trl") if m in sys.modules)
    print(f"exit={exc.code} heavy={heavy}", file=sys.stderr)
'''


@pytest.mark.parametrize("yaml_text, extra, expected", [
    ("kt_config:\n  kt_backend: amx_bf17\n", [],
     "{cfg}: kt_config.kt_backend: expert backend 'amx_bf17' is not available"),
    ("kt_config:\n  kt_backend: torch\n", ["kt_config.kt_backnd=torch"],
     "command line: unknown key 'kt_config.kt_backnd'; did you mean 'kt_backend'?"),
    ("kt_backend: torch\nkt_config:\n  kt_backend: auto\n", [],
     "{cfg}: kt_backend: 'torch' at the top level and 'auto'"),
    ("kt_config:\n  kt_backend: torch\n", ["model_name_or_path={tmp}/nothing"],
     "error: command line: model_name_or_path '{tmp}/nothing' does not exist"),
    ("kt_config:\n  kt_backend: torch\n", ["kt_config.kt_backend=amx_bf17"],
     "error: command line: kt_config.kt_backend: expert backend 'amx_bf17' is not available"),
    ("kt_config:\n  kt_backend: torch\n", ["--scenario", "x"], "error: ktcore train: No such option '--scenario'."),
    ("kt_config:\n  kt_expert_placement: auto\n", ["kt_config.kt_rates={tmp}/rates.json"],
     "kt_config.kt_rates: {tmp}/rates.json: not a readable JSON rates file"),
], ids=["unknown-backend", "override-typo", "conflicting-keys", "missing-model", "override-unknown-backend",
        "unknown-option", "bad-rates"])
def test_config_errors_are_one_line_before_torch_is_imported(tmp_path, yaml_text, extra, expected):
    """Each mistake is one line naming the file (or the command line), found before torch, transformers or trl
    is imported (so in a fraction of a second, not the ~10 s those imports take)."""
    assert_one_line_before_torch(tmp_path, ["train", "{cfg}", "--frontend", "trl", *extra], yaml_text, expected)


@pytest.mark.parametrize("args, yaml_text, expected", [
    (["chat", "{cfg}"], "kt_config:\n  kt_backend: amx_bf17\n",
     "{cfg}: kt_config.kt_backend: expert backend 'amx_bf17' is not available"),
    (["chat", "{cfg}", "model_name_or_path={tmp}/nothing"], "",
     "error: command line: model_name_or_path '{tmp}/nothing' does not exist"),
    (["chat", "{cfg}", "kt_config.kt_backend=amx_bf17"], "",
     "error: command line: kt_config.kt_backend: expert backend 'amx_bf17' is not available"),
    (["chat", "{cfg}", "adapter_name_or_path=someone/an-adapter"], "", "looks like a Hugging Face Hub ID"),
    (["export", "{cfg}", "--out", "{tmp}/merged"], "", "{cfg}: adapter_name_or_path is required"),
    (["export", "{cfg}", "--out", "{tmp}/model", "adapter_name_or_path={tmp}"], "",
     "--out {tmp}/model is the base model directory"),
], ids=["chat-unknown-backend", "chat-missing-model", "chat-override-backend", "chat-hub-adapter", "export-no-adapter", "export-onto-base"])
def test_chat_and_export_config_errors_are_one_line_before_torch_is_imported(tmp_path, args, yaml_text, expected):
    """As for train: ``ktcore chat`` and ``ktcore export`` name a config's mistake before the heavy imports."""
    assert_one_line_before_torch(tmp_path, args, yaml_text, expected)


def assert_one_line_before_torch(tmp_path, args, yaml_text, expected):
    """``ktcore ARGS`` on a config naming a model directory (plus ``yaml_text``) fails with exit status 2 and one
    line containing ``expected``, with none of torch, transformers and trl imported."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3_moe"}')
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model_name_or_path: {model}\noutput_dir: {tmp_path}/out\nuse_kt: true\n" + yaml_text)
    args = [a.format(cfg=cfg, tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-c", _NO_HEAVY_IMPORTS, *args], capture_output=True, text=True,
                          timeout=120)
    error, status = proc.stderr.strip().splitlines()
    assert status == "exit=2 heavy=[]", proc.stderr
    assert expected.format(cfg=cfg, tmp=tmp_path) in error
    assert error.startswith("error: ")


def test_eval_with_a_frontend_without_evaluation_is_one_line(tmp_path):
    """`ktcore eval --frontend trl`: the TRL frontend has no evaluation; one line naming the one that has."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model_name_or_path: x\nuse_kt: false\neval_dataset: identity\n")
    run = CliRunner().invoke(main, ["eval", str(cfg), "--frontend", "trl"])
    lines = run.stderr.strip().splitlines()
    assert run.exit_code == 2 and len(lines) == 1, run.output
    assert "frontend 'trl' has no evaluation; use --frontend" in lines[0], lines[0]
