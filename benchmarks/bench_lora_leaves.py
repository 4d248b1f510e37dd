"""The expert-LoRA work of one amx_bf16 layer call alone, on one thread: builds benchmarks/lora_leaves_bench.cpp
with the system g++ and runs it (no torch, no AMX: any x86-64 CPU with the chosen ISA).

    python benchmarks/bench_lora_leaves.py [--isa avx512bf16|avx512|avx2|generic] [--shape E,K,H,I] [--tokens 512]
        [--rank 8] [--reps 9]

It calls ktcore/include/ktcore/expert_lora.hpp's functions on the leaf routines of expert_lora_leaves.inc, compiled
with the flags of the kernel file that carries them (``avx512bf16``: backends/amx_bf16's kernels_amx.cpp without the
AMX tile flags), in the pattern of the amx_bf16 engine's phases (per expert: the prologue over its rows, the epilogue
per output block, the gradients per unit), and prints each phase's milliseconds of thread CPU time (median of
``--reps``; CPU time, so other jobs on a shared machine count less) and a hash of every result, which tells a change
that keeps the bits from one that does not. Default shape: kt-kernel's SFT benchmark layer, E=128 K=8 H=2048 I=768 at
512 tokens, LoRA r=8 with fp32 factors.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ISA_FLAGS = {
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", choices=sorted(ISA_FLAGS), default="avx512bf16")
    ap.add_argument("--shape", default="128,8,2048,768", help="E,K,H,I")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "lora_leaves_bench"
        subprocess.run(["g++", "-std=gnu++17", "-O3", *ISA_FLAGS[args.isa], f"-I{ROOT / 'ktcore' / 'include'}",
                        str(ROOT / "benchmarks" / "lora_leaves_bench.cpp"), "-o", str(exe)], check=True)
        e, k, h, i = args.shape.split(",")
        out = subprocess.run([str(exe), e, k, h, i, str(args.tokens), str(args.rank), str(args.reps)],
                             check=True, capture_output=True, text=True).stdout
    print(f"isa {args.isa}")
    print(out, end="")


if __name__ == "__main__":
    main()
