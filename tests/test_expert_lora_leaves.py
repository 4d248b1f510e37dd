"""The expert-LoRA functions the native backends share (ktcore/include/ktcore/expert_lora.hpp on the leaf routines of
expert_lora_leaves.inc), checked by tests/cpp/expert_lora_leaves_check.cpp against float64 loops at ragged sizes,
built with the system C++ compiler once per instruction set the backends compile them for and this CPU runs.

Each build also requires that grad_columns gives the same bits whether one call covers the columns or several calls
cover pieces of them: the engines split a gradient's columns among tasks by the thread count, so a routine whose bits
depend on the split makes a backend's gradients depend on its threads.

The backends' own suites reach only the instruction set of their kernel table here (the amx_bf16 table needs AMX);
this runs the AVX-512 leaves the AMX table carries on any AVX-512 CPU. With -ffp-contract=off every build must also
return the same bits, which is what keeps a backend's results independent of the machine's vector width.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ktcore.plugins.hw import cpu_info

ROOT = Path(__file__).resolve().parents[1]
# (name, g++ flags, CPU features they need): generic x86-64 (the portable tables), llamafile's avx2 kernels, and the
# AVX-512 flags of amx_bf16's kernel file (its AMX tile flags aside)
BUILDS = [
    ("generic", [], ()),
    ("avx2", ["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
    ("avx512bf16", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
     ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma", "f16c")),
]


def _amx_kernel_flags():
    """The flags backends/amx_bf16/CMakeLists.txt compiles its AMX kernel file with (AMX_FLAGS; the leaves use no AMX
    instruction, so the build runs on any AVX-512 CPU)."""
    text = (ROOT / "backends" / "amx_bf16" / "CMakeLists.txt").read_text()
    return re.search(r'set\(AMX_FLAGS "([^"]+)"\)', text).group(1).split(";")


def _run(tmp_path, name, flags, contract="off", opt="-O2"):
    exe = tmp_path / f"check_{name}_{contract}"
    subprocess.run(["g++", "-std=gnu++17", opt, f"-ffp-contract={contract}", *flags,
                    f"-I{ROOT / 'ktcore' / 'include'}", str(ROOT / "tests" / "cpp" / "expert_lora_leaves_check.cpp"),
                    "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "expert lora leaf checks passed" in run.stdout, run.stdout + run.stderr
    return run.stdout.split("hash ")[1].split()[0]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine to build the C++ check")
def test_leaves_match_float64_and_each_other_on_every_isa(tmp_path):
    flags_here = set(cpu_info().flags)
    runnable = [(n, f) for n, f, need in BUILDS if set(need) <= flags_here]
    hashes = {name: _run(tmp_path, name, flags) for name, flags in runnable}
    assert len(set(hashes.values())) == 1, hashes
    if "avx512bf16" in hashes:  # as amx_bf16 builds it: contracted multiply-adds, other bits, the same bounds
        _run(tmp_path, "avx512bf16", dict(runnable)["avx512bf16"], contract="fast")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine to build the C++ check")
@pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= set(cpu_info().flags),
                    reason="needs an AVX-512 BF16 CPU to run amx_bf16's kernel-file build")
def test_leaves_as_amx_bf16_builds_them(tmp_path):
    """amx_bf16's kernel file as CMake builds it (-O3, its flags, -mtune=sapphirerapids, default contraction), with
    the FMA-chain avoidance newer GCCs turn on for that tuning forced on (--param avoid-fma-max-bits=512): the
    compiler then fuses some multiply-adds and not others, which made the AMX backend's LoRA gradients depend on
    its thread count on the device (a column's bits followed the path of outer it took) until outer fused them all
    itself. Same bounds, and the split check, as every build."""
    _run(tmp_path, "amx_kernel_file", [*_amx_kernel_flags(), "--param", "avoid-fma-max-bits=512"], contract="fast",
         opt="-O3")
