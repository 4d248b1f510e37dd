"""The amx_int8 plugin as `auto` sees it: listed without loading the extension, chosen for int8 experts on AMX (and
AVX-512 VNNI) CPUs, never for weight format auto, and a reason everywhere else."""

import subprocess
import sys

import pytest
from click.testing import CliRunner

import ktcore
import ktcore.plugins
import ktcore.plugins.hw
from ktcore.commands.cli import main
from ktcore.plugins.select import resolve_backend

SPR = "amx_tile,amx_bf16,amx_int8,avx512f,avx512bw,avx512vl,avx512_bf16,avx512_vnni,avx2,fma"
AVX2 = "avx2,fma"


@pytest.fixture
def flags(monkeypatch):
    def use(value):
        monkeypatch.setenv("KTCORE_CPU_FLAGS", value)
        ktcore.plugins.hw._detect.cache_clear()

    ktcore.plugins.reset_registry()
    yield use
    monkeypatch.delenv("KTCORE_CPU_FLAGS", raising=False)
    ktcore.plugins.reset_registry()
    ktcore.plugins.hw._detect.cache_clear()


def test_listed_without_loading_extension(flags):
    from ktcore.plugins import get_registry

    spec = get_registry().specs("expert_backend")["amx_int8"]
    assert spec.weight_formats == ("int8",) and spec.lossy and spec.supports_backward and spec.supports_lora
    # in a fresh process: this session's other tests have imported the extension
    code = ("import sys; from ktcore.plugins import get_registry; get_registry().specs('expert_backend')['amx_int8'];"
            "assert 'ktcore_amx_int8._ext' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auto_picks_amx_int8_for_int8_experts_on_amx(flags):
    flags(SPR)
    choice = resolve_backend("auto", weight_format="int8", need_backward=True, need_lora=True)
    assert choice.spec.name == "amx_int8"
    assert choice.reasons["amx_bf16"] == "weight format 'int8' not supported (has auto, bf16)"
    assert choice.reasons["torch"] == "weight format 'int8' not supported (has auto, fp32, bf16)"
    # weight format auto: never quantised behind the user's back
    auto = resolve_backend("auto", need_backward=True, need_lora=True)
    assert auto.spec.name != "amx_int8" and "not for 'auto'" in auto.reasons["amx_int8"]


def test_says_why_not_without_avx512_vnni(flags):
    flags(AVX2)
    choice = resolve_backend("auto", weight_format="int8", need_backward=True, need_lora=True)
    assert choice.spec is None
    assert choice.reasons["amx_int8"] == "CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni"
    out = CliRunner().invoke(main, ["list-backends", "--explain", "--weight-format", "int8"]).output
    (line,) = [ln for ln in out.splitlines() if "amx_int8" in ln]
    assert line.endswith("CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni")


def test_named_with_format_auto_packs_int8(flags):
    from ktcore_amx_int8 import _ext

    if _ext.amx_unavailable_reason() and _ext.vnni_unavailable_reason():
        pytest.skip("neither AMX INT8 nor AVX-512 VNNI here")
    backend = ktcore.get_backend("amx_int8", {"kt_backend": "amx_int8"}, need_backward=True, need_lora=True)
    assert backend.name == "amx_int8" and backend.kernels in ("amx", "vnni")


def test_doctor_report_says_which_kernels():
    from ktcore_amx_int8 import _ext
    from ktcore_amx_int8.doctor import report

    got = report(0.05)
    if _ext.amx_unavailable_reason():
        assert got["amx_int8_peak_gops"] is None and got["amx_int8_peak_source"] == _ext.amx_unavailable_reason()
    else:
        assert got["amx_int8_peak_gops"] > 100 and got["amx_int8_kernels"] == "amx"
