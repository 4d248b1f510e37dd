"""``auto`` backend selection with faked CPU flags and fake backend plugins; a reason for every rejection."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

from fakedist import BACKEND_CLASS, clean_plugin_env, fake_dists  # noqa: E402,F401  (pytest fixtures)

import ktcore  # noqa: E402
from ktcore.plugins import hw  # noqa: E402
from ktcore.commands.cli import main  # noqa: E402
from ktcore.plugins.hw import CpuInfo  # noqa: E402
from ktcore.plugins import UnknownPluginError  # noqa: E402
from ktcore.plugins.select import resolve_backend  # noqa: E402

AMX = "amx_tile,amx_bf16,amx_int8,avx512f,avx512bw,avx512_bf16,avx512_vnni,avx2,fma"
AVX512 = "avx512f,avx512bw,avx512_bf16,avx512_vnni,avx2,fma"
AVX2 = "avx2,fma"

# One distribution registering several backends that differ in exactly one way each.
BACKENDS = """
from ktcore import hookimpl
from ktcore.specs import ExpertBackendSpec


def _raises():
    raise RuntimeError("boom")


@hookimpl
def ktcore_register_expert_backends():
    impl = "{impl}:Backend"
    return [
        ExpertBackendSpec(name="amx_fast", factory=impl, required_cpu_features=("amx_tile", "amx_bf16"),
                          weight_formats=("bf16",), priority=100),
        ExpertBackendSpec(name="amx_q8", factory=impl, required_cpu_features=("amx_tile", "amx_int8"),
                          weight_formats=("int8",), priority=110),
        ExpertBackendSpec(name="amx_lossy", factory=impl, required_cpu_features=("amx_tile", "amx_int8"),
                          weight_formats=("int8",), lossy=True, priority=105),
        ExpertBackendSpec(name="avx512", factory=impl, required_cpu_features=("avx512f", "avx512_bf16"),
                          weight_formats=("bf16", "fp32"), priority=50),
        ExpertBackendSpec(name="infer_only", factory=impl, required_cpu_features=("avx2",),
                          weight_formats=("bf16", "gguf"), supports_backward=False, priority=200),
        ExpertBackendSpec(name="no_lora", factory=impl, weight_formats=("fp32",), supports_lora=False, priority=20),
        ExpertBackendSpec(name="probed", factory=impl, probe=lambda: "libvendor.so not found", priority=300),
        ExpertBackendSpec(name="probe_raises", factory=impl, probe=_raises, priority=400),
    ]
"""

ALL = {"amx_fast", "amx_q8", "amx_lossy", "avx512", "infer_only", "no_lora", "probed", "probe_raises", "torch"}


@pytest.fixture
def backends(fake_dists):
    impl = fake_dists.write_module("select_impl", BACKEND_CLASS.format(name="fake"))
    fake_dists.add("ktcore-fake-select", {"select": "select_plugin"},
                   {"select_plugin": BACKENDS.replace("{impl}", impl)})
    return impl


def cpu(flags: str, permission=None, reason="") -> CpuInfo:
    parsed = frozenset(flags.split(","))
    granted = "amx_tile" in parsed if permission is None else permission
    return CpuInfo(parsed, granted, reason, "test cpu", 8, overridden=True)


def test_cpu_flags_override(clean_plugin_env):
    clean_plugin_env.setenv("KTCORE_CPU_FLAGS", "AVX2, fma amx_tile")
    info = hw.cpu_info()
    assert info.overridden and info.flags == {"avx2", "fma", "amx_tile"}
    assert info.amx_permission and info.has("avx2", "fma") and info.missing(["avx2", "amx_int8"]) == ["amx_int8"]
    clean_plugin_env.setenv("KTCORE_CPU_FLAGS", "avx2")
    info = hw.cpu_info()
    assert not info.amx_permission and "amx_tile not in KTCORE_CPU_FLAGS" in info.amx_permission_reason


def test_auto_with_amx_for_bf16_training(backends):
    choice = resolve_backend("auto", weight_format="bf16", need_backward=True, cpu=cpu(AMX))
    assert choice.spec.name == "amx_fast"
    r = choice.reasons
    assert set(r) == ALL
    assert r["amx_fast"] is None
    assert r["amx_q8"] == "weight format 'bf16' not supported (has int8)"
    assert r["avx512"] == "usable, but amx_fast has higher priority (100 > 50)"
    assert r["torch"] == "usable, but amx_fast has higher priority (100 > 0)"
    assert r["infer_only"] == "no backward pass (training needs one)"
    assert r["no_lora"] == "weight format 'bf16' not supported (has fp32)"
    assert r["probed"] == "libvendor.so not found"
    assert r["probe_raises"] == "probe failed: RuntimeError: boom"
    assert all(r[n] for n in ALL - {"amx_fast"}), "every backend not chosen has a reason"


def test_auto_with_amx_int8_weights(backends):
    choice = resolve_backend("auto", weight_format="int8", need_backward=True, cpu=cpu(AMX))
    assert choice.spec.name == "amx_q8"
    assert choice.reasons["amx_fast"] == "weight format 'int8' not supported (has bf16)"


def test_lossy_backend_only_where_its_format_is_asked_for(backends):
    """A backend that quantises (amx_int8) is never what `auto` picks for weight format auto, however high its
    priority; for its own format it is, and naming it asks for it."""
    choice = resolve_backend("auto", need_backward=True, cpu=cpu(AMX))
    assert choice.spec.name == "amx_q8"
    assert choice.reasons["amx_lossy"] == ("quantises the experts (int8): chosen only when kt_expert_weight_format "
                                           "names its format, not for 'auto'")
    int8 = resolve_backend("auto", weight_format="int8", need_backward=True, cpu=cpu(AMX))
    assert int8.reasons["amx_lossy"] == "usable, but amx_q8 has higher priority (110 > 105)"
    named = resolve_backend("amx_lossy", need_backward=True, cpu=cpu(AMX))
    assert named.spec.name == "amx_lossy" and named.reasons["amx_lossy"] is None
    assert resolve_backend("auto", weight_format="int8", cpu=cpu(AVX512)).reasons["amx_lossy"] == \
        "CPU lacks amx_tile, amx_int8"


def test_auto_without_amx_falls_back_to_avx512(backends):
    choice = resolve_backend("auto", weight_format="bf16", need_backward=True, cpu=cpu(AVX512))
    assert choice.spec.name == "avx512"
    assert choice.reasons["amx_fast"] == "CPU lacks amx_tile, amx_bf16"
    assert choice.reasons["amx_q8"] == "CPU lacks amx_tile, amx_int8"


def test_auto_on_plain_avx2_picks_torch(backends):
    choice = resolve_backend("auto", weight_format="bf16", need_backward=True, cpu=cpu(AVX2))
    assert choice.spec.name == "torch"
    assert choice.reasons["avx512"] == "CPU lacks avx512f, avx512_bf16"
    assert choice.reasons["torch"] is None


def test_amx_flags_without_kernel_permission(backends):
    refused = "the kernel refused AMX tile permission (arch_prctl errno 1: Operation not permitted)"
    choice = resolve_backend("auto", weight_format="bf16", need_backward=True,
                             cpu=cpu(AMX, permission=False, reason=refused))
    assert choice.spec.name == "avx512"
    assert choice.reasons["amx_fast"] == refused


def test_inference_may_use_a_backend_without_backward(backends):
    choice = resolve_backend("auto", weight_format="gguf", need_backward=False, cpu=cpu(AVX2))
    assert choice.spec.name == "infer_only"
    assert choice.reasons["torch"] == "weight format 'gguf' not supported (has auto, fp32, bf16)"


def test_need_lora(backends):
    choice = resolve_backend("auto", weight_format="fp32", need_backward=True, need_lora=True, cpu=cpu(AVX2))
    assert choice.reasons["no_lora"] == "no expert LoRA"
    assert choice.spec.name == "torch"
    without = resolve_backend("auto", weight_format="fp32", need_backward=True, cpu=cpu(AVX2))
    assert without.spec.name == "no_lora"


def test_env_flags_drive_auto(backends, monkeypatch):
    monkeypatch.setenv("KTCORE_CPU_FLAGS", AMX)
    assert resolve_backend("auto", weight_format="bf16", need_backward=True).spec.name == "amx_fast"
    monkeypatch.setenv("KTCORE_CPU_FLAGS", AVX2)
    assert resolve_backend("auto", weight_format="bf16", need_backward=True).spec.name == "torch"


def test_named_backend_that_cannot_run_here_says_why(backends):
    with pytest.raises(UnknownPluginError) as info:
        resolve_backend("amx_fast", cpu=cpu(AVX2))
    msg = str(info.value)
    assert "expert backend 'amx_fast' is installed but cannot be used here: CPU lacks amx_tile, amx_bf16." in msg
    assert "  probed: unavailable (libvendor.so not found)" in msg
    assert "Choose one of:" in msg and "torch" in msg.splitlines()[1]
    assert resolve_backend("avx512", cpu=cpu(AVX512)).spec.name == "avx512"


def test_nothing_usable_lists_every_reason(backends, monkeypatch):
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "torch")
    monkeypatch.setenv("KTCORE_CPU_FLAGS", "")
    choice = resolve_backend("auto", weight_format="bf16", need_backward=True)
    assert choice.spec is None and all(choice.reasons.values())
    with pytest.raises(UnknownPluginError, match="no expert backend can run here:\n  amx_fast: CPU lacks amx_tile"):
        ktcore.get_backend("auto", {"kt_expert_weight_format": "bf16"}, need_backward=True)


def test_get_backend_imports_and_builds_only_the_chosen_one(backends, monkeypatch):
    monkeypatch.setenv("KTCORE_CPU_FLAGS", AVX512)
    assert backends not in sys.modules
    backend = ktcore.get_backend("auto", {"kt_expert_weight_format": "bf16"}, need_backward=True)
    assert type(backend).__module__ == backends and backend.config.kt_expert_weight_format == "bf16"
    torch_backend = ktcore.get_backend("auto", {"kt_backend": "torch"})
    assert type(torch_backend).__name__ == "TorchExpertBackend"


# ---- ktcore list-backends --explain --------------------------------------------------------------------------


def explain(monkeypatch, flags, *args):
    monkeypatch.setenv("KTCORE_CPU_FLAGS", flags)
    result = CliRunner().invoke(main, ["list-backends", *args])
    assert result.exit_code == 0, result.output
    return result.output


def row(output: str, name: str) -> str:
    (line,) = [ln for ln in output.splitlines() if ln[2:].split(" ")[0] == name]
    return line


def test_list_backends_explain_with_amx(backends, monkeypatch):
    out = explain(monkeypatch, AMX, "--explain")
    assert out.splitlines()[0].split() == ["NAME", "PRIORITY", "FEATURES", "FORMATS", "BACKWARD", "REASON"]
    # training needs backward; any weight format: the int8 AMX backend has the highest usable priority
    assert row(out, "amx_q8").startswith("* amx_q8") and row(out, "amx_q8").endswith("chosen by auto")
    assert [ln for ln in out.splitlines() if ln.startswith("* ")] == [row(out, "amx_q8")]
    assert row(out, "amx_fast").endswith("usable, but amx_q8 has higher priority (110 > 100)")
    assert row(out, "infer_only").endswith("no backward pass (training needs one)")
    assert row(out, "probed").endswith("libvendor.so not found")
    assert row(out, "probe_raises").endswith("probe failed: RuntimeError: boom")
    assert "amx_tile,amx_bf16" in row(out, "amx_fast")


def test_list_backends_for_a_weight_format(backends, monkeypatch):
    out = explain(monkeypatch, AMX, "--explain", "--weight-format", "int8")
    assert row(out, "amx_q8").startswith("* amx_q8")
    assert row(out, "amx_lossy").endswith("usable, but amx_q8 has higher priority (110 > 105)")
    assert row(out, "amx_fast").endswith("weight format 'int8' not supported (has bf16)")
    assert row(explain(monkeypatch, AMX, "--explain"), "amx_lossy").endswith("not for 'auto'")
    monkeypatch.setenv("KTCORE_CPU_FLAGS", AMX)
    result = CliRunner().invoke(main, ["list-backends", "--weight-format", "int4"])
    assert result.exit_code == 2 and "'int4' is not one of auto, fp32, bf16, int8" in result.output


def test_list_backends_explain_without_amx(backends, monkeypatch):
    out = explain(monkeypatch, AVX512, "--explain")
    assert row(out, "avx512").startswith("* avx512")
    assert row(out, "amx_fast").endswith("CPU lacks amx_tile, amx_bf16")
    assert row(out, "torch").endswith("usable, but avx512 has higher priority (50 > 0)")


def test_list_backends_without_explain_has_no_reasons(backends, monkeypatch):
    out = explain(monkeypatch, AVX2)
    assert "REASON" not in out and "CPU lacks" not in out
    assert row(out, "torch").startswith("* torch")  # training needs expert LoRA: no_lora is not marked


def test_list_backends_marks_what_training_picks(backends, monkeypatch):
    out = explain(monkeypatch, AVX2, "--explain")
    assert row(out, "no_lora").endswith("no expert LoRA")
    assert row(out, "torch").endswith("chosen by auto")


def test_list_backends_json(backends, monkeypatch):
    data = json.loads(explain(monkeypatch, AMX, "--json"))
    rows = {r["name"]: r for r in data["backends"]}
    assert set(rows) == ALL
    assert [n for n, r in rows.items() if r["auto"]] == ["amx_q8"]
    assert rows["amx_fast"]["usable"] and not rows["probed"]["usable"]
    assert rows["infer_only"]["backward"] is False and rows["infer_only"]["reason"].startswith("no backward")
    assert rows["amx_q8"]["reason"] == "chosen by auto" and rows["amx_q8"]["priority"] == 110
    assert data["broken"] == []


def test_list_backends_explain_shows_broken_plugins(backends, fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": "raise ImportError('no libamx')"})
    with pytest.warns(Warning, match="no libamx"):
        out = explain(monkeypatch, AVX2, "--explain")
    assert "brokenmod (ktcore-fake-broken): broken: ImportError: no libamx" in out
    data = json.loads(explain(monkeypatch, AVX2, "--json"))
    assert [b["entry_point"] for b in data["broken"]] == ["brokenmod"]
