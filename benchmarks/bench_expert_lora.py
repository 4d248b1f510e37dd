"""What expert LoRA costs inside each native backend: the same layer call with and without LoRA, in one run.

    python benchmarks/bench_expert_lora.py [--backends amx_bf16,llamafile:q4_k,...] [--threads N] [--tokens 512]
        [--rank 8] [--shape E,K,H,I] [--rounds 3] [--seconds 1] [--phases]

A backend is ``name`` or ``name:format`` (kt_expert_weight_format: llamafile's q4_k, q8_0, bf16 ...), or
``amx_bf16:portable`` for the amx_bf16 orchestration on its plain C++ kernels (any CPU; slow, and its LoRA share
is not what AMX sees). The default shape is kt-kernel's SFT benchmark layer, E=128 K=8 H=2048 I=768 at 512 tokens,
bf16 weights; LoRA rank ``--rank`` on gate_up and down with fp32 factors, as PEFT keeps them. Each figure is the
median over ``--rounds`` rounds, LoRA on and off taking turns; the ratio is on / off. ``--phases`` adds, for
amx_bf16 and amx_int8, where a forward + backward call's time goes, from the engine's phase clock (the LoRA
prologues, each GEMM with its LoRA epilogue, the LoRA gradient phases), without and with LoRA. No timed asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import ktcore
from ktcore.experts.probe import Shape, make_problem, median_time
from ktcore.config import KTConfig


def make_backend(spec: str, threads: int):
    name, _, fmt = spec.partition(":")
    kt = {"kt_backend": name, "kt_num_threads": threads}
    if name == "amx_bf16":
        from ktcore_amx_bf16.backend import AMXBF16Backend

        return AMXBF16Backend(KTConfig(**kt), kernels=fmt or None)
    if fmt:
        kt["kt_expert_weight_format"] = fmt
    return ktcore.get_backend(name, kt, need_backward=True, need_lora=True)


def fwd_bwd(backend, packed, x, ids, w, lora) -> None:
    """One forward saving for backward, then the backward."""
    _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    backend.backward(packed, ctx, torch.ones_like(x), lora)


def time_layer(backend, packed, x, ids, w, lora, seconds: float) -> tuple[float, float]:
    """(forward seconds, forward + backward seconds), medians."""
    return (median_time(lambda: backend.forward(packed, x, ids, w, lora, save=False), seconds),
            median_time(lambda: fwd_bwd(backend, packed, x, ids, w, lora), seconds))


def phase_ms(backend, packed, x, ids, w, lora, calls: int = 5) -> dict:
    """{phase: milliseconds per forward + backward call} from the engine's phase clock, and under "the call" the
    wall time of the same calls (the rest is what runs outside the engine's phases: Python, torch)."""
    engine = backend._engine
    engine.phase_clock(True)
    engine.phase_times()  # starts over
    t0 = time.perf_counter()
    for _ in range(calls):
        fwd_bwd(backend, packed, x, ids, w, lora)
    wall = time.perf_counter() - t0
    times = engine.phase_times()
    engine.phase_clock(False)
    return {**{name: seconds / calls * 1e3 for name, (seconds, _) in times.items()}, "the call": wall / calls * 1e3}


def print_phases(spec: str, off: dict, on: dict) -> None:
    print()
    print(f"{spec}: forward + backward, ms per call, by phase")
    print()
    print("| phase | no LoRA | with LoRA | difference |")
    print("| --- | ---: | ---: | ---: |")
    call_off, call_on = off.pop("the call"), on.pop("the call")
    rows = [(name, off.get(name, 0.0), on.get(name, 0.0)) for name in list(on) + [n for n in off if n not in on]]
    rows += [("all phases", sum(off.values()), sum(on.values())), ("the call", call_off, call_on),
             ("outside the phases", call_off - sum(off.values()), call_on - sum(on.values()))]
    for name, a, b in rows:
        print(f"| {name} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="llamafile:q4_k,amx_bf16:portable")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--shape", default="128,8,2048,768", help="E,K,H,I")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per measurement")
    ap.add_argument("--phases", action="store_true", help="amx_bf16 / amx_int8: also the time of each engine phase")
    args = ap.parse_args()
    e, k, h, i = (int(v) for v in args.shape.split(","))
    shape = Shape("layer", e, k, h, i, (args.tokens,))
    weights, x, ids, w, lora = make_problem(shape, args.tokens, torch.bfloat16, lora_rank=args.rank)
    torch.set_num_threads(args.threads)
    print(f"E={e} K={k} H={h} I={i}, {args.tokens} tokens, bf16 weights, expert LoRA r={args.rank} (fp32 factors), "
          f"{args.threads} threads, median of {args.rounds} rounds")
    print()
    print("| backend | forward ms, no LoRA | with LoRA | ratio | fwd+bwd ms, no LoRA | with LoRA | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    phases = []
    for spec in args.backends.split(","):
        backend = make_backend(spec, args.threads)
        packed = backend.pack(weights, activation="silu")
        rounds = [[time_layer(backend, packed, x, ids, w, ad, args.seconds) for ad in (None, lora)]
                  for _ in range(args.rounds)]
        (f0, b0), (f1, b1) = ([statistics.median(r[j][m] for r in rounds) for m in (0, 1)] for j in (0, 1))
        print(f"| {spec} | {f0 * 1e3:.1f} | {f1 * 1e3:.1f} | {f1 / f0:.2f}x | {b0 * 1e3:.1f} | {b1 * 1e3:.1f} | "
              f"{b1 / b0:.2f}x |", flush=True)
        if args.phases and hasattr(getattr(backend, "_engine", None), "phase_clock"):
            phases.append((spec, phase_ms(backend, packed, x, ids, w, None), phase_ms(backend, packed, x, ids, w, lora)))
        del packed
    for row in phases:
        print_phases(*row)


if __name__ == "__main__":
    main()
