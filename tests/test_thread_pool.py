"""ktcore/include/ktcore/thread_pool.hpp, the pool both native backends run on: built with the system C++
compiler and checked by tests/cpp/thread_pool_check.cpp (every item once, run_each and its barrier, a failing
task's exception without a deadlock)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine to build the C++ check")
def test_thread_pool(tmp_path):
    exe = tmp_path / "thread_pool_check"
    subprocess.run(["g++", "-std=c++17", "-O2", "-pthread", f"-I{ROOT / 'ktcore' / 'include'}",
                    str(ROOT / "tests" / "cpp" / "thread_pool_check.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "thread pool checks passed" in run.stdout
