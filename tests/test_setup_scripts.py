"""scripts/plugin_packages.sh: setup.sh and setup_llamafactory.sh reinstall a package (recompiling a native backend,
about a minute each) only when it is missing or its sources changed. The venv's python is a recorder here, so each
case shows which pip installs the real shell function asked for."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_venv(tmp_path) -> tuple[Path, Path]:
    venv, log = tmp_path / "venv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "python3" / "site-packages").mkdir(parents=True)
    python = venv / "bin" / "python"
    # records the pip call and does what pip's install leaves behind: the distribution's dist-info
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                      f'mkdir -p {venv}/lib/python3/site-packages/demo_pkg-0.1.dist-info\n')
    python.chmod(0o755)
    return venv, log


def install(venv: Path, pkg: Path) -> None:
    script = f'. "{ROOT}/scripts/plugin_packages.sh"; install_plugin "{venv}" --no-deps "{pkg}"'
    subprocess.run(["bash", "-c", script], check=True, cwd=ROOT, env={**os.environ}, timeout=60)


def test_a_package_is_reinstalled_only_when_missing_or_changed(tmp_path):
    venv, log = make_venv(tmp_path)
    pkg = tmp_path / "demo-pkg"
    (pkg / "src").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text('[project]\nname = "demo-pkg"\n')
    (pkg / "src" / "kernel.cpp").write_text("int f() { return 1; }\n")
    (pkg / "CMakeLists.txt").write_text("project(demo)\n")  # native: ktcore's headers count too

    install(venv, pkg)
    assert log.read_text().splitlines() == [f"-m pip install -q --no-deps -e {pkg}"]
    install(venv, pkg)  # unchanged: nothing to do
    assert len(log.read_text().splitlines()) == 1
    (pkg / "tests").mkdir()
    (pkg / "tests" / "test_x.py").write_text("")  # tests and build outputs are not sources
    (pkg / "build").mkdir()
    (pkg / "build" / "x.o").write_text("")
    install(venv, pkg)
    assert len(log.read_text().splitlines()) == 1
    (pkg / "src" / "kernel.cpp").write_text("int f() { return 2; }\n")  # a source changed: recompile
    install(venv, pkg)
    assert len(log.read_text().splitlines()) == 2
    for dist_info in (venv / "lib" / "python3" / "site-packages").iterdir():  # uninstalled: install again
        dist_info.rmdir()
    install(venv, pkg)
    assert len(log.read_text().splitlines()) == 3
