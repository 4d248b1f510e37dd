"""The package's shape: imports only go down the layers, no circle, no named plugin in the core, and
``ktcore.testing`` without pytest (docs/architecture.md draws the layers)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bottom first; a module may import from its own layer and the ones before it (and the root package's API)
LAYERS = [
    ("errors", "specs", "files", "outputs"),
    ("plugins",),
    ("experts",),
    ("model",),
    ("weights",),
    ("config", "llamafactory_keys"),
    ("adapters",),
    ("frontends",),
    ("commands", "builtin", "testing", "__main__"),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "ktcore").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the ktcore modules it imports anywhere (function bodies too; TYPE_CHECKING blocks aside)."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _layer(module: str) -> int:
    return RANK[module.split(".")[1]]


def test_imports_only_go_down_the_layers():
    modules = _modules()
    upward = [f"{src} -> {dst}" for src, dsts in _imports(modules).items() if src != "ktcore"
              for dst in dsts if dst != "ktcore" and _layer(dst) > _layer(src)]
    assert not upward, upward


def test_no_import_circle():
    graph = {src: dsts - {"ktcore"} for src, dsts in _imports(_modules()).items() if src != "ktcore"}
    done, path = set(), []

    def visit(node):
        if node in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_the_core_names_no_plugin_package():
    """Removing a plugin package never breaks a core command: the core reaches plugins through descriptors."""
    named = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                named += [a.name for a in node.names if a.name.startswith("ktcore_")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ktcore_"):
                named.append(node.module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"ktcore_\w+(\.\w+)*[.:][\w.]+", node.value):  # "module:attr" for import_object
                named.append(node.value)
    assert not named, named


def test_ktcore_testing_needs_no_pytest():
    code = ("import sys; sys.modules['pytest'] = None\n"
            "import ktcore.testing\n"
            "from ktcore.testing.upcycle import upcycle\n"
            "from ktcore.testing.tiny import save_tiny_chat_moe\n"
            "try:\n"
            "    ktcore.testing.ExpertBackendContract\n"
            "except ImportError:\n"
            "    print('contract needs pytest')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "contract needs pytest"
