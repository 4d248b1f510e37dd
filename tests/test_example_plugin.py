"""The worked example of docs/plugins.md, examples/plugins/ktcore-example-backend, tested without pip install.

A fake ``.dist-info`` carrying the package's entry point goes on sys.path next to the package's ``src``, so
ktcore discovers it exactly as it would the installed wheel; then the package's own contract test runs.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

from fakedist import FakeDists, clean_plugin_env  # noqa: E402,F401  (pytest fixture)

import ktcore  # noqa: E402
import ktcore.plugins  # noqa: E402
from ktcore.testing import ExpertBackendContract  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "ktcore-example-backend"


def _project() -> dict:
    return tomllib.loads((PACKAGE / "pyproject.toml").read_text(encoding="utf-8"))["project"]


@pytest.fixture(autouse=True)
def example_installed(tmp_path, clean_plugin_env):
    """The example package as if pip-installed: its entry points (read from its pyproject) and its src."""
    project = _project()
    FakeDists(tmp_path / "site").dist_info(project["name"], project["entry-points"]["ktcore"], project["version"])
    clean_plugin_env.syspath_prepend(str(tmp_path / "site"))
    clean_plugin_env.syspath_prepend(str(PACKAGE / "src"))
    yield
    for name in [m for m in sys.modules if m.startswith("ktcore_example_backend")]:
        del sys.modules[name]


class TestExampleBackend(ExpertBackendContract):
    """The same class the package's tests/test_example_backend.py declares."""

    backend_name = "example"
    rtol_out = 1e-5
    rtol_grad = 1e-5


class TestExampleBackendBF16Inputs(ExpertBackendContract):
    backend_name = "example"
    weight_dtype = torch.bfloat16
    input_dtype = torch.bfloat16
    rtol_out = 1e-2
    rtol_grad = 2e-2


def test_example_is_discovered_and_listed_lazily():
    records = {r.name: r for r in ktcore.list_plugins("expert_backend")}
    rec = records["example"]
    assert (rec.status, rec.dist, rec.entry_point) == ("ok", "ktcore-example-backend", "example")
    assert "ktcore_example_backend.backend" not in sys.modules  # listing imported only the hook module
    assert rec.spec.probe() is None


def test_auto_keeps_the_builtin_torch_backend():
    from ktcore.plugins.select import resolve_backend

    choice = resolve_backend("auto", need_backward=True, need_lora=True)
    assert choice.spec.name == "torch"
    assert choice.reasons["example"] == "usable, but torch has higher priority (0 > -10)"


def test_example_rejects_what_it_does_not_implement():
    from ktcore.config import KTConfig
    from ktcore.experts import ExpertWeights

    w = ExpertWeights(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 8, 4))
    with pytest.raises(ValueError, match="silu only"):
        ktcore.get_backend("example").pack(w, activation="gelu")
    with pytest.raises(ValueError, match="packs fp32 experts"):  # constructed directly, past the resolver
        type(ktcore.get_backend("example"))(KTConfig(kt_expert_weight_format="bf16")).pack(w)
    with pytest.raises(ktcore.plugins.UnknownPluginError, match="weight format 'bf16' not supported"):
        ktcore.get_backend("example", {"kt_expert_weight_format": "bf16"})


def test_package_test_file_declares_the_contract():
    text = (PACKAGE / "tests" / "test_example_backend.py").read_text(encoding="utf-8")
    assert "class TestExampleBackend(ExpertBackendContract):" in text and 'backend_name = "example"' in text


def test_resident_experts_need_a_backend_that_unpacks(tmp_path):
    """kt_num_gpu_experts with the example backend, which has no ``unpack``: one line naming the layer, the backend
    and the fix, before a weight is read (the model is saved, then loaded through the real loading path)."""
    from ktcore_tiny import tiny_qwen3_moe

    from ktcore.errors import ConfigError

    tiny_qwen3_moe().save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"mlp\.experts: kt_num_gpu_experts needs a backend that unpacks its "
                                          r"experts .* and example does not; set kt_num_gpu_experts: 0"):
        ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "example", "kt_num_gpu_experts": 2}},
                          device="cpu", progress=False)
