"""Plugin discovery and safe loading, through real entry points of fake installed distributions."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))

from fakedist import clean_plugin_env, fake_dists  # noqa: E402,F401  (pytest fixtures)

import ktcore  # noqa: E402
from ktcore.plugins import hookspecs  # noqa: E402
from ktcore.plugins import (  # noqa: E402
    PluginConflictError,
    PluginError,
    PluginWarning,
    Registry,
    UnknownPluginError,
    get_registry,
    list_plugins,
)
from ktcore.specs import SPEC_TYPES, ExpertBackendSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "plugins.md"

RAISES_ON_IMPORT = """
raise ImportError("libfancy.so: cannot open shared object file")
"""

# a plugin module implementing all four hooks (the meta-test below checks this covers every hookspec)
ALL_HOOKS = """
from ktcore import hookimpl
from ktcore.specs import AdapterFormatSpec, ArchSpec, ExpertBackendSpec, FrontendSpec


@hookimpl
def ktcore_register_expert_backends():
    return [ExpertBackendSpec(name="allhooks_backend", factory="nowhere_heavy:Backend")]


@hookimpl
def ktcore_register_archs():
    return [ArchSpec(name="allhooks_arch", hf_architectures=("AllHooksForCausalLM",), model_types=("allhooks",),
                     experts_module="model.layers.{layer}.mlp.experts")]


@hookimpl
def ktcore_register_frontends():
    return [FrontendSpec(name="allhooks_frontend", run="nowhere_heavy:run", stages=("sft", "dpo"))]


@hookimpl
def ktcore_register_adapter_formats():
    return [AdapterFormatSpec(name="allhooks_adapter", factory="nowhere_heavy:Format")]
"""

BAD_HOOK_ARGS = """
from ktcore import hookimpl


@hookimpl
def ktcore_register_expert_backends(config):  # the spec takes no arguments
    return []
"""

MISSPELLED_HOOK = """
from ktcore import hookimpl


@hookimpl
def ktcore_register_backends():  # not a ktcore hook: would silently register nothing
    return []
"""

WRONG_DESCRIPTOR = """
from ktcore import hookimpl
from ktcore.specs import ArchSpec


@hookimpl
def ktcore_register_archs():  # this one is fine and must survive its sibling's failure
    return [ArchSpec(name="wrongdesc_arch", hf_architectures=("X",), model_types=("x",), experts_module="m")]


@hookimpl
def ktcore_register_expert_backends():
    return [ArchSpec(name="not_a_backend", hf_architectures=("X",), model_types=("x",), experts_module="m")]
"""

RETURNS_DICT = """
from ktcore import hookimpl


@hookimpl
def ktcore_register_frontends():
    return [{"name": "dictfront", "run": "x:y"}]
"""

HOOK_RAISES = """
from ktcore import hookimpl
from ktcore.specs import ExpertBackendSpec


@hookimpl
def ktcore_register_expert_backends():
    return [ExpertBackendSpec(name="bad name!", factory="x:y")]
"""


def by_name(records):
    return {r.name: r for r in records}


# ---- discovery ---------------------------------------------------------------------------------------------


def test_builtins_register_through_ktcore_entry_points(clean_plugin_env):
    rows = by_name(Registry().records())
    assert rows["torch"].kind == "expert_backend" and rows["torch"].dist == "ktcore"
    assert rows["torch"].status == "ok" and rows["torch"].entry_point == "torch"
    assert any(r.kind == "arch" and r.dist == "ktcore" for r in rows.values())


def test_ok_plugin_registers_a_backend(fake_dists):
    fake_dists.backend("ktcore-fake-ok", "okb", priority=3, version="2.5")
    registry = Registry()
    rec = by_name(registry.records("expert_backend"))["okb"]
    assert (rec.kind, rec.dist, rec.version, rec.status, rec.entry_point) == (
        "expert_backend", "ktcore-fake-ok", "2.5", "ok", "okb")
    assert isinstance(rec.spec, ExpertBackendSpec) and rec.spec.priority == 3
    assert set(registry.specs("expert_backend")) >= {"okb", "torch"}
    assert registry.get("expert_backend", "okb") is rec.spec
    assert "spec" not in rec.as_dict() and json.dumps(rec.as_dict())


def test_plugin_with_all_four_hooks(fake_dists):
    fake_dists.add("ktcore-fake-all", {"allhooks": "allhooks"}, {"allhooks": ALL_HOOKS})
    registry = Registry()
    for kind, name in [("expert_backend", "allhooks_backend"), ("arch", "allhooks_arch"),
                       ("frontend", "allhooks_frontend"), ("adapter_format", "allhooks_adapter")]:
        spec = registry.get(kind, name)
        assert isinstance(spec, SPEC_TYPES[kind])
    assert "nowhere_heavy" not in sys.modules  # descriptors only name their code


def test_get_registry_is_cached_and_reset(fake_dists):
    from ktcore import plugins

    first = get_registry()
    assert get_registry() is first
    fake_dists.backend("ktcore-fake-late", "lateb")
    assert "lateb" not in first.specs("expert_backend")  # installed after loading: not seen yet
    plugins.reset_registry()
    assert "lateb" in get_registry().specs("expert_backend")
    assert "lateb" in {r.name for r in ktcore.list_plugins("expert_backend")}


def test_same_distribution_twice_on_sys_path_is_not_a_conflict(fake_dists, tmp_path):
    from fakedist import FakeDists

    fake_dists.backend("ktcore-fake-twice", "twiceb")
    again = FakeDists(tmp_path / "site2")
    again.suffix = fake_dists.suffix  # the same module names: a second copy of the same install
    again.backend("ktcore-fake-twice", "twiceb")
    second_site = str(again.root)
    sys.path.append(second_site)
    try:
        rows = [r for r in Registry().records() if r.name == "twiceb"]
    finally:
        sys.path.remove(second_site)
    assert len(rows) == 1


# ---- broken plugins --------------------------------------------------------------------------------------


def test_plugin_raising_on_import_is_broken_warned_once_and_others_work(fake_dists):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": RAISES_ON_IMPORT})
    fake_dists.backend("ktcore-fake-ok", "okb")
    with pytest.warns(PluginWarning, match="brokenmod.*ktcore-fake-broken.*libfancy.so"):
        registry = Registry()
    rows = by_name(registry.records())
    assert rows["brokenmod"].status == "broken" and rows["brokenmod"].kind == "module"
    assert rows["brokenmod"].reason.startswith("ImportError: libfancy.so")
    assert rows["okb"].status == "ok" and rows["torch"].status == "ok"
    assert "okb" in registry.specs("expert_backend")
    # a failed module shows under every kind, and only among the inactive rows
    assert "brokenmod" in {r.name for r in registry.records("frontend")}
    assert "brokenmod" not in {r.name for r in registry.records(include_inactive=False)}

    with warnings.catch_warnings(record=True) as caught:  # warned once per process, not per load
        warnings.simplefilter("always")
        again = Registry()
    assert not [w for w in caught if issubclass(w.category, PluginWarning)]
    assert by_name(again.records())["brokenmod"].status == "broken"


def test_syntax_error_in_plugin_is_broken_too(fake_dists):
    fake_dists.add("ktcore-fake-syntax", {"syntaxmod": "syntaxmod"}, {"syntaxmod": "def broken(:\n"})
    with pytest.warns(PluginWarning):
        rows = by_name(list_plugins())
    assert rows["syntaxmod"].status == "broken" and "SyntaxError" in rows["syntaxmod"].reason


def test_entry_point_naming_a_missing_module_is_broken(fake_dists):
    fake_dists.add("ktcore-fake-missing", {"ghost": "ghost_module_not_written"})
    with pytest.warns(PluginWarning, match="ghost"):
        rows = by_name(Registry().records())
    assert rows["ghost"].status == "broken" and "ModuleNotFoundError" in rows["ghost"].reason


def test_hookimpl_with_argument_not_in_spec_is_broken(fake_dists):
    fake_dists.add("ktcore-fake-badargs", {"badargs": "badargs"}, {"badargs": BAD_HOOK_ARGS})
    with pytest.warns(PluginWarning, match="badargs"):
        registry = Registry()
    rec = by_name(registry.records())["badargs"]
    assert rec.status == "broken" and "PluginValidationError" in rec.reason and "config" in rec.reason
    assert "torch" in registry.specs("expert_backend")


def test_misspelled_hook_is_broken(fake_dists):
    fake_dists.add("ktcore-fake-typo", {"typo": "typo"}, {"typo": MISSPELLED_HOOK})
    fake_dists.backend("ktcore-fake-ok", "okb")
    with pytest.warns(PluginWarning, match="typo"):
        registry = Registry()
    rec = by_name(registry.records())["typo"]
    assert rec.status == "broken" and "unknown hook ktcore_register_backends" in rec.reason
    assert "ktcore_register_expert_backends" in rec.reason
    assert "okb" in registry.specs("expert_backend")


def test_hook_returning_wrong_descriptor_type_is_broken(fake_dists):
    fake_dists.add("ktcore-fake-wrongdesc", {"wrongdesc": "wrongdesc"}, {"wrongdesc": WRONG_DESCRIPTOR})
    fake_dists.add("ktcore-fake-dict", {"dictmod": "dictmod"}, {"dictmod": RETURNS_DICT})
    with pytest.warns(PluginWarning):
        registry = Registry()
    rows = by_name(registry.records())
    bad = rows["wrongdesc.ktcore_register_expert_backends"]
    assert bad.status == "broken" and bad.kind == "expert_backend"
    assert "returned ArchSpec, expected ExpertBackendSpec" in bad.reason
    assert "not_a_backend" not in registry.specs("arch") and "not_a_backend" not in registry.specs("expert_backend")
    assert rows["wrongdesc_arch"].status == "ok"  # the module's good hook still counts
    assert "expected FrontendSpec" in rows["dictmod.ktcore_register_frontends"].reason


def test_hook_raising_is_broken(fake_dists):
    fake_dists.add("ktcore-fake-raises", {"raises": "raises"}, {"raises": HOOK_RAISES})
    with pytest.warns(PluginWarning, match="raises"):
        rows = by_name(Registry().records())
    rec = rows["raises.ktcore_register_expert_backends"]
    assert rec.status == "broken" and "ValueError" in rec.reason and "bad name!" in rec.reason


# ---- strict mode -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", [RAISES_ON_IMPORT, BAD_HOOK_ARGS, MISSPELLED_HOOK, WRONG_DESCRIPTOR],
                         ids=["import", "args", "hook-name", "type"])
def test_strict_mode_reraises(fake_dists, monkeypatch, source):
    fake_dists.add("ktcore-fake-strict", {"strictmod": "strictmod"}, {"strictmod": source})
    monkeypatch.setenv("KTCORE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="strictmod.*ktcore-fake-strict 1.0.*KTCORE_STRICT_PLUGINS") as info:
        get_registry()
    assert info.value.__cause__ is not None


def test_strict_mode_off_by_argument(fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-strict", {"strictmod": "strictmod"}, {"strictmod": RAISES_ON_IMPORT})
    monkeypatch.setenv("KTCORE_STRICT_PLUGINS", "1")
    with pytest.warns(PluginWarning):
        assert by_name(Registry(strict=False).records())["strictmod"].status == "broken"
    monkeypatch.setenv("KTCORE_STRICT_PLUGINS", "0")
    assert by_name(Registry().records())["strictmod"].status == "broken"  # already warned above
    with pytest.raises(PluginError):
        Registry(strict=True)


# ---- allow and deny lists --------------------------------------------------------------------------------


def test_allow_list_loads_named_plugins_and_always_builtins(fake_dists, monkeypatch):
    impl_a = fake_dists.backend("ktcore-fake-a", "alpha")
    fake_dists.backend("ktcore-fake-b", "beta")
    monkeypatch.setenv("KTCORE_LOAD_PLUGINS", "ktcore-fake-a")  # by distribution name
    rows = by_name(Registry().records())
    assert rows["alpha"].status == "ok" and rows["torch"].status == "ok"
    assert rows["beta"].status == "disabled" and "KTCORE_LOAD_PLUGINS" in rows["beta"].reason
    assert fake_dists.plugin_modules["beta"] not in sys.modules  # never imported
    assert impl_a not in sys.modules

    monkeypatch.setenv("KTCORE_LOAD_PLUGINS", " beta , nothing-such ")  # by entry point name, spaces ignored
    rows = by_name(Registry().records())
    assert rows["beta"].status == "ok" and rows["alpha"].status == "disabled" and rows["torch"].status == "ok"


def test_empty_allow_list_means_builtins_only(fake_dists, monkeypatch):
    fake_dists.backend("ktcore-fake-a", "alpha")
    monkeypatch.setenv("KTCORE_LOAD_PLUGINS", "")
    registry = Registry()
    assert set(registry.specs("expert_backend")) == {"torch"}
    with pytest.raises(UnknownPluginError, match="alpha.*disabled.*not listed in KTCORE_LOAD_PLUGINS"):
        registry.get("expert_backend", "alpha")


def test_deny_list_disables_anything_builtins_included(fake_dists, monkeypatch):
    fake_dists.backend("ktcore-fake-a", "alpha")
    fake_dists.backend("ktcore-fake-b", "beta")
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "torch,ktcore-fake-b")
    monkeypatch.setenv("KTCORE_LOAD_PLUGINS", "beta")  # deny wins over allow
    rows = by_name(Registry().records())
    assert rows["torch"].status == "disabled" and "KTCORE_DISABLE_PLUGINS" in rows["torch"].reason
    assert rows["beta"].status == "disabled" and "KTCORE_DISABLE_PLUGINS" in rows["beta"].reason
    assert rows["alpha"].status == "disabled" and "KTCORE_LOAD_PLUGINS" in rows["alpha"].reason
    assert fake_dists.plugin_modules["beta"] not in sys.modules


def test_deny_list_skips_a_broken_plugin_silently(fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": RAISES_ON_IMPORT})
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "brokenmod")
    monkeypatch.setenv("KTCORE_STRICT_PLUGINS", "1")  # a disabled plugin is never imported, so never fails
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        rows = by_name(Registry().records())
    assert rows["brokenmod"].status == "disabled"


def test_allow_and_deny_arguments_override_environment(fake_dists, monkeypatch):
    fake_dists.backend("ktcore-fake-a", "alpha")
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "alpha")
    assert "alpha" in Registry(deny=set()).specs("expert_backend")
    assert "alpha" not in Registry(allow=set(), deny=set()).specs("expert_backend")


# ---- conflicts -------------------------------------------------------------------------------------------


def test_duplicate_name_from_two_distributions_names_both(fake_dists):
    fake_dists.backend("ktcore-fake-one", "dup", ep="one")
    fake_dists.backend("ktcore-fake-two", "dup", ep="two", version="3.1")
    with pytest.raises(PluginConflictError) as info:
        Registry()
    msg = str(info.value)
    assert "'dup'" in msg and "expert_backend" in msg
    assert "ktcore-fake-one 1.0" in msg and "ktcore-fake-two 3.1" in msg
    assert "KTCORE_DISABLE_PLUGINS=" in msg


def test_conflict_with_a_builtin(fake_dists):
    fake_dists.backend("ktcore-fake-shadow", "torch", ep="shadow")
    with pytest.raises(PluginConflictError) as info:
        get_registry()
    assert f"ktcore {ktcore.__version__} (entry point 'torch')" in str(info.value)
    assert "ktcore-fake-shadow 1.0 (entry point 'shadow')" in str(info.value)


def test_conflict_resolved_by_disabling_one(fake_dists, monkeypatch):
    fake_dists.backend("ktcore-fake-one", "dup", ep="one")
    fake_dists.backend("ktcore-fake-two", "dup", ep="two")
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "two")
    rec = by_name(Registry().records("expert_backend", include_inactive=False))["dup"]
    assert rec.dist == "ktcore-fake-one"


def test_same_name_in_different_kinds_is_fine(fake_dists):
    fake_dists.add("ktcore-fake-all", {"allhooks": "allhooks"}, {"allhooks": ALL_HOOKS.replace(
        'name="allhooks_arch"', 'name="allhooks_backend"')})
    registry = Registry()
    assert "allhooks_backend" in registry.specs("arch") and "allhooks_backend" in registry.specs("expert_backend")


# ---- asking for what is not there ----------------------------------------------------------------------------


def test_unknown_plugin_lists_available_and_why_others_are_not(fake_dists, monkeypatch):
    fake_dists.add("ktcore-fake-broken", {"brokenmod": "brokenmod"}, {"brokenmod": RAISES_ON_IMPORT})
    fake_dists.backend("ktcore-fake-ok", "okb")
    fake_dists.backend("ktcore-fake-off", "offb")
    monkeypatch.setenv("KTCORE_DISABLE_PLUGINS", "offb")
    with pytest.warns(PluginWarning):
        registry = Registry()
    with pytest.raises(UnknownPluginError) as info:
        registry.get("expert_backend", "nope")
    msg = str(info.value)
    assert msg.splitlines()[0] == "expert backend 'nope' is not available."
    assert "Choose one of: okb, torch." in msg
    assert "brokenmod (ktcore-fake-broken): broken (ImportError: libfancy.so" in msg
    assert "offb (ktcore-fake-off): disabled (listed in KTCORE_DISABLE_PLUGINS)" in msg
    assert isinstance(info.value, KeyError) and not msg.startswith("'")  # KeyError, but unquoted


def test_unavailable_backend_says_why(fake_dists, monkeypatch):
    fake_dists.backend("ktcore-fake-amx", "amxb", features=("amx_tile", "amx_bf16"))
    monkeypatch.setenv("KTCORE_CPU_FLAGS", "avx2,fma")
    with pytest.raises(UnknownPluginError) as info:
        ktcore.get_backend("amxb")
    msg = str(info.value)
    assert "expert backend 'amxb' is installed but cannot be used here: CPU lacks amx_tile, amx_bf16." in msg
    assert "Choose one of: torch." in msg


def test_unknown_frontend_lists_frontends(fake_dists):
    fake_dists.add("ktcore-fake-all", {"allhooks": "allhooks"}, {"allhooks": ALL_HOOKS})
    from ktcore.frontends import resolve_frontend

    with pytest.raises(UnknownPluginError, match="frontend 'nope' is not available.\nChoose one of: .*allhooks_frontend"):
        resolve_frontend("nope")


# ---- listing stays light ---------------------------------------------------------------------------------


def test_listing_does_not_import_backend_code(fake_dists):
    from click.testing import CliRunner

    from ktcore.commands.cli import main

    impl = fake_dists.backend("ktcore-fake-lazy", "lazyb", probe="lambda: None")
    runner = CliRunner()
    for args in (["plugins", "--all"], ["list-backends", "--explain"], ["list-backends", "--json"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        assert "lazyb" in result.output
    assert impl not in sys.modules
    backend = ktcore.get_backend("lazyb")  # using it is what imports it
    assert impl in sys.modules and backend.name == "lazyb"


def test_listing_does_not_import_torch_or_frontends():
    """In a fresh interpreter, listing every kind imports no torch, transformers or training frontend."""
    code = (
        "import sys\n"
        "from ktcore.commands.cli import main\n"
        "for args in (['plugins', '--all', '--json'], ['list-backends', '--explain'], ['list-archs'],\n"
        "             ['list-frontends'], ['list-adapter-formats']):\n"
        "    try:\n"
        "        main(args, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'trl', 'llamafactory') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KTCORE_CPU_FLAGS",)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stdout, out.stdout + out.stderr


# ---- meta-test: every hook is documented and exercised (in the spirit of datasette) ---------------------------


def _hook_names() -> list[str]:
    names = [n for n in dir(hookspecs) if n.startswith("ktcore_") and callable(getattr(hookspecs, n))]
    assert sorted(names) == sorted(hookspecs.HOOK_KINDS), "HOOK_KINDS must list every hookspec"
    return names


@pytest.mark.parametrize("hook", sorted(hookspecs.HOOK_KINDS))
def test_every_hook_is_documented(hook):
    assert hook in _hook_names()
    text = DOCS.read_text(encoding="utf-8")
    assert f"`{hook}()`" in text, f"docs/plugins.md does not document {hook}"
    spec_type = SPEC_TYPES[hookspecs.HOOK_KINDS[hook]]
    assert f"`{spec_type.__name__}`" in text
    from dataclasses import fields

    for f in fields(spec_type):
        assert f"`{f.name}`" in text, f"docs/plugins.md does not describe {spec_type.__name__}.{f.name}"


@pytest.mark.parametrize("hook", sorted(hookspecs.HOOK_KINDS))
def test_every_hook_is_exercised_by_a_test(hook):
    """Some fake plugin in tests/ implements the hook (as a decorated function in plugin source text)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and f"def {hook}(" in node.value:
                found.append(path.name)
    assert found, f"no test plugin implements {hook}"
    assert hook in ALL_HOOKS
