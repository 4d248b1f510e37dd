"""amx_bf16 kernel benchmarks (plain script; prints a markdown table, no timed asserts).

    python benchmarks/bench_amx_bf16.py [--quick] [--rounds N] [--cases memory,compute,dsv2] [--out results.md]
        [--profile [--lora-rank R]] [--micro] [--threads N]

Measures in one run: DRAM read bandwidth (AVX-512 streaming read in the extension, and torch.sum over a
2 GiB tensor), the AMX BF16 tile-only peak, torch's bf16 matmul, then
  * memory-bound layer  E=128 K=8 H=2048 I=768  T=512   (1.2 GB of bf16 weights) vs one read of the weights
  * compute-bound layer E=8   K=2 H=2048 I=1408 T=4096  GFLOP/s vs AMX peak and vs torch bf16 matmul
  * DeepSeek-V2-Lite    E=64  K=6 H=2048 I=1408 T=1,16,512,4096 forward and forward+backward vs the torch backend
No expert LoRA in these runs, except in the phase profile with ``--lora-rank R``, where each layer runs without
and then with LoRA of rank R (fp32 factors) on gate_up and down. The bandwidth is the median of three readings; every layer figure is the median of
--rounds rounds, the two backends taking turns within a round (a shared VM drifts from minute to minute). The
memory- and compute-bound layers are also timed paired: every call between two readings of its yardstick (a read
of the layer's own weights; the tile-only peak), so each ratio uses a reading taken next to the call (on the shared
VM the ratios still move from run to run: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import ktcore
from ktcore.experts.probe import make_expert_lora
from ktcore.config import KTConfig
from ktcore.experts import ExpertWeights
from ktcore_amx_bf16 import _ext
from ktcore_amx_bf16.backend import AMXBF16Backend
from ktcore_amx_bf16.measure import Meter, amx_peak_gflops, read_bandwidth_gbps


def timeit(fn, min_time=1.0, min_reps=3, max_reps=50, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Paired:
    """A paired measure's medians: the layer's seconds and its ratio to the adjacent yardstick; with rounds,
    the ratio of every round too."""
    time: float
    ratio: float
    ratios: tuple = ()


def paired(layer, reference, min_time, min_reps=10):
    """Calls of ``layer`` (which returns the seconds it timed), each between two readings of ``reference``
    (seconds the same work takes at the machine's rate measured right then) and compared with the faster of
    the two."""
    layer()  # warm-up
    times, ratios = [], []
    before = reference()
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t = layer()
        after = reference()
        times.append(t)
        ratios.append(t / min(before, after))
        before = after
    return Paired(statistics.median(times), statistics.median(ratios))


def _median(values):
    if isinstance(values[0], Paired):
        ratios = tuple(v.ratio for v in values)
        return Paired(statistics.median(v.time for v in values), statistics.median(ratios), ratios)
    return statistics.median(values)


def rounds(n, *measures):
    """Median of n rounds of each measure, the measures taking turns within a round."""
    runs = [[m() for m in measures] for _ in range(max(1, n))]
    return [_median([r[i] for r in runs]) for i in range(len(measures))]


def spread(p: Paired) -> str:
    return f"{min(p.ratios):.2f}-{max(p.ratios):.2f}x"


def make_layer(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g, dtype=torch.bfloat16) * scale)
    return ExpertWeights(rnd(E, I, H, scale=H ** -0.5), rnd(E, I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5))


def make_inputs(E, K, H, T, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.softmax(torch.rand(T, K, generator=g), dim=1)
    gy = torch.randn(T, H, generator=g).to(dtype)
    return x, ids, w, gy


def run_fwd(backend, packed, x, ids, w):
    return lambda: backend.forward(packed, x, ids, w, None, save=False)


def run_fwd_bwd(backend, packed, x, ids, w, gy, lora=None):
    def f():
        _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
        backend.backward(packed, ctx, gy, lora)
    return f


def timed(fn):
    """fn, returning the seconds it took (for paired)."""
    def f():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return f


def timed_backward(backend, packed, x, ids, w, gy):
    """A forward that saves for backward, then the backward alone, timed."""
    def f():
        _, ctx = backend.forward(packed, x, ids, w, None, save=True)
        t0 = time.perf_counter()
        backend.backward(packed, ctx, gy, None)
        return time.perf_counter() - t0
    return f


@dataclass
class Run:
    """What every layer's benchmark needs from main: the backends, the output, the timing settings, the
    machine's measured bandwidth (GB/s) and AMX peak (GFLOP/s), and a meter on as many threads as the backend."""
    amx: AMXBF16Backend
    tb: object
    out: Callable[..., None]
    min_time: float
    rounds: int
    skip_torch_backend: bool
    bw: float
    peak: float
    threads: int
    meter: Meter


def memory_bound(run):
    """E=128 K=8 H=2048 I=768 T=512: forward and backward against one read of the weights."""
    amx, tb, out, min_time = run.amx, run.tb, run.out, run.min_time
    E, K, H, I, T = 128, 8, 2048, 768, 512
    wts = make_layer(E, H, I)
    packed = amx.pack(wts)
    x, ids, w, gy = make_inputs(E, K, H, T)
    nbytes = packed.gate.nbytes + packed.up.nbytes + packed.down.nbytes
    t_read = nbytes / (run.bw * 1e9)
    tpk = tb.pack(wts)

    def read_weights():  # one streaming read of the packed weights themselves, every thread
        return sum(run.meter.read_seconds(t.data_ptr(), t.nbytes) for t in (packed.gate, packed.up, packed.down))

    tf, tfb, ttf, pf, pb = rounds(
        run.rounds, lambda: timeit(run_fwd(amx, packed, x, ids, w), min_time=min_time),
        lambda: timeit(run_fwd_bwd(amx, packed, x, ids, w, gy), min_time=min_time),
        lambda: timeit(run_fwd(tb, tpk, x, ids, w), min_time=min_time),
        lambda: paired(timed(run_fwd(amx, packed, x, ids, w)), read_weights, min_time),
        lambda: paired(timed_backward(amx, packed, x, ids, w, gy), read_weights, min_time))
    out(f"### memory-bound E={E} K={K} H={H} I={I} T={T} ({nbytes / 1e9:.2f} GB bf16 weights)")
    out()
    out("| what | time ms | vs one weight read | target |")
    out("| --- | ---: | ---: | --- |")
    out(f"| one read of the weights at {run.bw:.1f} GB/s | {t_read * 1e3:.1f} | 1.00x | |")
    out(f"| amx_bf16 forward | {tf * 1e3:.1f} | {tf / t_read:.2f}x | <= 1.35x |")
    out(f"| amx_bf16 backward (fwd+bwd minus fwd) | {(tfb - tf) * 1e3:.1f} | {(tfb - tf) / t_read:.2f}x | <= 2x |")
    out(f"| amx_bf16 forward+backward | {tfb * 1e3:.1f} | {tfb / t_read:.2f}x | |")
    out(f"| torch backend forward | {ttf * 1e3:.1f} | {ttf / t_read:.2f}x | |")
    out()
    out("Paired with a read of the same weights just before and after each call (median ratio to the faster read):")
    out()
    out("| what | time ms | vs the adjacent weight read | rounds | target |")
    out("| --- | ---: | ---: | ---: | --- |")
    out(f"| amx_bf16 forward | {pf.time * 1e3:.1f} | {pf.ratio:.2f}x | {spread(pf)} | <= 1.35x |")
    out(f"| amx_bf16 backward (the call alone, after a saving forward) | {pb.time * 1e3:.1f} | {pb.ratio:.2f}x | "
        f"{spread(pb)} | <= 2x |")
    out()


def compute_bound(run):
    """E=8 K=2 H=2048 I=1408 T=4096: GFLOP/s against the AMX peak and torch's dense matmul."""
    amx, out, min_time = run.amx, run.out, run.min_time
    E, K, H, I, T = 8, 2, 2048, 1408, 4096
    wts = make_layer(E, H, I)
    packed = amx.pack(wts)
    x, ids, w, gy = make_inputs(E, K, H, T)
    flops = 2.0 * T * K * H * 3 * I
    a = torch.randn(T * K, H, dtype=torch.bfloat16)
    w1 = torch.randn(H, 2 * I, dtype=torch.bfloat16)
    w2 = torch.randn(I, H, dtype=torch.bfloat16)

    def dense():
        hh = a @ w1
        return hh[:, :I] @ w2

    def at_peak():  # seconds for these FLOPs at the tile-only rate measured right now
        return flops / (run.meter.amx_peak(0.05) * 1e9)

    tf, tfb, t_dense, pf = rounds(
        run.rounds, lambda: timeit(run_fwd(amx, packed, x, ids, w), min_time=min_time),
        lambda: timeit(run_fwd_bwd(amx, packed, x, ids, w, gy), min_time=min_time),
        lambda: timeit(dense, min_time=min_time),
        lambda: paired(timed(run_fwd(amx, packed, x, ids, w)), at_peak, min_time))
    out(f"### compute-bound E={E} K={K} H={H} I={I} T={T} ({flops / 1e9:.0f} GFLOP per forward)")
    out()
    out("| what | time ms | GFLOP/s | vs AMX peak | target |")
    out("| --- | ---: | ---: | ---: | --- |")
    out(f"| AMX tile-only peak | | {run.peak:.0f} | 100% | |")
    out(f"| amx_bf16 forward | {tf * 1e3:.1f} | {flops / tf / 1e9:.0f} | {flops / tf / 1e9 / run.peak:.0%} | >= 70% |")
    out(f"| amx_bf16 forward+backward (3x FLOPs) | {tfb * 1e3:.1f} | {3 * flops / tfb / 1e9:.0f} | "
        f"{3 * flops / tfb / 1e9 / run.peak:.0%} | |")
    out(f"| torch bf16 dense matmul, same FLOPs | {t_dense * 1e3:.1f} | {flops / t_dense / 1e9:.0f} | "
        f"{flops / t_dense / 1e9 / run.peak:.0%} | amx_bf16 >= 1.3x this: {t_dense / tf:.2f}x |")
    out(f"| amx_bf16 forward, paired with the tile-only peak just before and after each call | {pf.time * 1e3:.1f} | "
        f"{flops / pf.time / 1e9:.0f} | {1 / pf.ratio:.0%} of the higher peak (rounds {1 / max(pf.ratios):.0%}-"
        f"{1 / min(pf.ratios):.0%}) | >= 70% |")
    out()


def deepseek_v2_lite(run):
    """DeepSeek-V2-Lite layer E=64 K=6 H=2048 I=1408 at T = 1, 16, 512, 4096 against the torch backend."""
    amx, tb, out, min_time = run.amx, run.tb, run.out, run.min_time
    E, K, H, I = 64, 6, 2048, 1408
    wts = make_layer(E, H, I)
    packed = amx.pack(wts)
    tpk = tb.pack(wts)
    out(f"### DeepSeek-V2-Lite layer E={E} K={K} H={H} I={I} (torch backend: bf16, {run.threads} torch threads)")
    out()
    out("| T | amx fwd ms | torch fwd ms | fwd speed-up | amx fwd+bwd ms | torch fwd+bwd ms | fwd+bwd speed-up |")
    out("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for T in (1, 16, 512, 4096):
        x, ids, w, gy = make_inputs(E, K, H, T)
        amx_fns = [lambda: timeit(run_fwd(amx, packed, x, ids, w), min_time=min_time),
                   lambda: timeit(run_fwd_bwd(amx, packed, x, ids, w, gy), min_time=min_time)]
        if run.skip_torch_backend:
            af, afb = rounds(run.rounds, *amx_fns)
            out(f"| {T} | {af * 1e3:.2f} | | | {afb * 1e3:.2f} | | |")
            continue
        af, afb, tf_, tfb_ = rounds(
            run.rounds, *amx_fns, lambda: timeit(run_fwd(tb, tpk, x, ids, w), min_time=min_time, min_reps=2),
            lambda: timeit(run_fwd_bwd(tb, tpk, x, ids, w, gy), min_time=min_time, min_reps=2))
        out(f"| {T} | {af * 1e3:.2f} | {tf_ * 1e3:.2f} | {tf_ / af:.1f}x | {afb * 1e3:.2f} | {tfb_ * 1e3:.2f} | "
            f"{tfb_ / afb:.1f}x |")
    out()


CASES = {"memory": memory_bound, "compute": compute_bound, "dsv2": deepseek_v2_lite}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per layer figure (median)")
    ap.add_argument("--cases", default="memory,compute,dsv2",
                    help="comma-separated layers to run: memory (memory-bound), compute (compute-bound), dsv2")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--skip-torch-backend", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also print per-phase times of forward+backward")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="--profile: each layer also with expert LoRA of this rank on gate_up and down (0: none)")
    ap.add_argument("--micro", action="store_true", help="also run the gemm_block micro-benchmark")
    ap.add_argument("--threads", type=int, default=0,
                    help="amx_bf16 threads (kt_num_threads; default: every CPU this process may use)")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    if not cases <= CASES.keys():
        ap.error(f"--cases takes memory, compute, dsv2; got {args.cases!r}")
    min_time = 0.3 if args.quick else 1.0

    why = _ext.amx_unavailable_reason()
    if why:
        raise SystemExit(f"amx_bf16 cannot run on this machine: {why}")
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    amx = AMXBF16Backend(KTConfig(kt_backend="amx_bf16", kt_num_threads=args.threads or threads))
    tb = ktcore.get_backend("torch", {"kt_expert_weight_format": "bf16"})
    lines = []

    def out(s=""):
        print(s, flush=True)
        lines.append(s)

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out(f"machine: {cpu}, {threads} threads (amx_bf16 pool {amx.num_threads}), torch {torch.__version__}")
    bw = statistics.median(read_bandwidth_gbps(2 << 30) for _ in range(3))
    big = torch.ones((2 << 30) // 4, dtype=torch.float32)
    t_sum = timeit(lambda: big.sum(), min_time=min_time)
    bw_torch = big.nbytes / t_sum / 1e9
    del big
    peak = amx_peak_gflops(1.0)
    out(f"DRAM read bandwidth: {bw:.1f} GB/s (extension AVX-512 read), {bw_torch:.1f} GB/s (torch.sum over 2 GiB)")
    out(f"AMX BF16 tile-only peak: {peak:.0f} GFLOP/s")
    out()

    run = Run(amx, tb, out, min_time, args.rounds, args.skip_torch_backend, bw, peak, threads,
              Meter(amx.num_threads, "amx"))
    for case, bench in CASES.items():
        if case in cases:
            bench(run)
            gc.collect()  # the layer's weights
    if args.micro:
        out("### gemm_block micro-benchmark (operands cache-resident, every thread its own)")
        out()
        out("| threads | m rows | K blocks | GFLOP/s |")
        out("| ---: | ---: | ---: | ---: |")
        for th in (1, threads):
            meter = Meter(th, "amx")
            for m, kb in ((32, 8), (32, 64), (256, 64), (4, 64), (1, 64)):
                out(f"| {th} | {m} | {kb} | {meter.bench_gemm(m, kb, 2000 if m <= 32 else 200):.0f} |")
        out(f"| 1 | tile-only peak | | {Meter(1, 'amx').amx_peak(0.3):.0f} |")
        out()
    if args.profile:
        engine = amx._engine
        engine.phase_clock(True)
        out("### per-phase profile of forward+backward (ms per call, mean of 5; the engine's phase clock)")
        out()
        for (E, K, H, I, Ts) in [(64, 6, 2048, 1408, (1, 16, 512, 4096)), (8, 2, 2048, 1408, (4096,)),
                                 (128, 8, 2048, 768, (512,))]:
            packed = amx.pack(make_layer(E, H, I))
            loras = [None] + ([make_expert_lora(E, H, I, args.lora_rank, torch.Generator().manual_seed(0))]
                              if args.lora_rank else [])
            for T in Ts:
                x, ids, w, gy = make_inputs(E, K, H, T)
                for lora in loras:
                    f = run_fwd_bwd(amx, packed, x, ids, w, gy, lora)
                    f()
                    engine.phase_times()  # starts over
                    t0 = time.perf_counter()
                    for _ in range(5):
                        f()
                    tot = (time.perf_counter() - t0) / 5
                    phases = " ".join(f"{k}={v / 5 * 1e3:.2f}" for k, (v, _) in engine.phase_times().items())
                    what = f", LoRA r={args.lora_rank}" if lora else ""
                    out(f"- E={E} K={K} T={T}{what}: fwd+bwd {tot * 1e3:.2f} ms | {phases}")
            del packed
            gc.collect()
        engine.phase_clock(False)
        out()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
