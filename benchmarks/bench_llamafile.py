"""llamafile backend benchmark on one DeepSeek-V2-Lite MoE layer (E=64, K=6, H=2048, I=1408).

Experts are random GGUF blocks (valid small fp16 scales) packed zero-copy with ``pack_blocks``, so the
numbers measure the kernels, not a quantiser. Reports:

* decode T=1..4: time per forward and effective read rate = bytes of the touched experts' blocks / time, as a
  percentage of ``ktcore.commands.doctor.measure_read_bandwidth()`` (the number ``ktcore doctor`` prints). On a shared
  machine both swing from moment to moment, so the bandwidth is the median of three measurements and each decode
  row the median of ``--rounds`` rounds of ``--iters`` calls (fresh routing every call);
* prefill T=512: forward time vs. "dequantise the touched experts (ktcore_llamafile's C++ dequantiser) and
  call torch's matmul" per call, and vs. amx_bf16 on bf16 weights when that backend can run here.

No assertions on timings.  Usage:
    python benchmarks/bench_llamafile.py [--formats q4_k,q8_0] [--threads N] [--iters 20] [--rounds 5]
        [--prefill-iters 2] [--activations q16|q8] [--tokens 1,2,3,4,512]

``--tokens`` picks the table's rows: T <= 64 are decode rows (bandwidth), larger T prefill rows (vs. the baseline).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from ktcore.config import KTConfig

E, K, H, I = 64, 6, 2048, 1408


def random_blocks(fmt: str, n: int, k: int, gen) -> torch.Tensor:
    from ktcore_llamafile import blocks as B

    elems, nbytes = B.block_info(fmt)
    raw = torch.randint(0, 256, (E, n, B.row_bytes(k, fmt)), generator=gen, dtype=torch.uint8)
    blocks = raw.view(-1, nbytes)
    offsets = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[fmt]
    for off in offsets:
        scale = (torch.rand(blocks.shape[0], generator=gen) * 2e-3).half().view(torch.uint8).view(-1, 2)
        blocks[:, off:off + 2] = scale
    return raw


def routing(T: int, gen):
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    w = torch.softmax(torch.rand(T, K, generator=gen), dim=1)
    return ids, w


def touched_bytes(packed, ids) -> int:
    per_expert = sum(p.blocks[0].numel() for p in (packed.gate, packed.up, packed.down))
    return int(torch.unique(ids).numel()) * per_expert


def dequant_matmul(packed, x, ids, w):
    """The baseline: dequantise every touched expert, then torch matmuls."""
    from ktcore_llamafile import blocks as B

    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, pos = torch.nonzero(ids == e, as_tuple=True)
        gate = B.dequantize_rows(packed.gate.blocks[e], packed.gate.qtype, H)
        up = B.dequantize_rows(packed.up.blocks[e], packed.up.qtype, H)
        down = B.dequantize_rows(packed.down.blocks[e], packed.down.qtype, I)
        xe = x[tok]
        h = F.silu(xe @ gate.T) * (xe @ up.T)
        y.index_add_(0, tok, (h @ down.T) * w[tok, pos].unsqueeze(1))
    return y


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q4_k,q8_0")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5,
                    help="decode rows: the median of this many rounds of --iters calls")
    ap.add_argument("--prefill-iters", type=int, default=2)
    ap.add_argument("--activations", default="q16", choices=("q16", "q8x2", "q8"),
                    help="the backend's activation quantisation (q16: int16, the default; q8x2: its former name; "
                         "q8: ggml's one int8 plane)")
    ap.add_argument("--tokens", default="1,2,3,4,512",
                    help="comma-separated T values: T <= 64 are reported as decode rows, larger T as prefill rows")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(args.threads)

    from ktcore.experts.probe import measure_read_bandwidth
    from ktcore_llamafile.backend import LlamafileBackend

    bw = statistics.median(measure_read_bandwidth() for _ in range(3))
    backend = LlamafileBackend(KTConfig(kt_num_threads=args.threads), activations=args.activations)
    print(f"DeepSeek-V2-Lite layer E={E} K={K} H={H} I={I}; {args.threads} threads; isa={backend.isa}; "
          f"activations={backend.activations}; "
          f"DRAM read bandwidth (ktcore doctor) {bw:.1f} GB/s")
    print(f"{'format':7} {'T':>4} {'ms/call':>9} {'MB read':>8} {'GB/s':>7} {'% of bw':>8} {'baseline ms':>12} "
          f"{'speed-up':>9}")
    gen = torch.Generator().manual_seed(0)
    for fmt in args.formats.split(","):
        packed = backend.pack_blocks(random_blocks(fmt, I, H, gen), random_blocks(fmt, I, H, gen),
                                     random_blocks(fmt, H, I, gen), fmt, H, I)
        x = None
        for T in tokens:
            if T > 64:
                continue
            calls = [(torch.randn(T, H, generator=gen), *routing(T, gen)) for _ in range(args.iters)]
            nbytes = sum(touched_bytes(packed, ids) for _, ids, _ in calls)
            backend.forward(packed, *calls[0])
            rounds = []
            for _ in range(args.rounds):
                t_all = 0.0
                for x, ids, w in calls:  # fresh routing each call: the touched experts come from DRAM
                    t0 = time.perf_counter()
                    backend.forward(packed, x, ids, w)
                    t_all += time.perf_counter() - t0
                rounds.append(t_all)
            t_all = statistics.median(rounds)
            rate = nbytes / t_all / 1e9
            print(f"{fmt:7} {T:>4} {1e3 * t_all / len(calls):>9.3f} {nbytes / len(calls) / 1e6:>8.1f} "
                  f"{rate:>7.2f} {100 * rate / bw:>7.1f}% {'':>12} {'':>9}")
        for T in tokens:
            if T <= 64:
                continue
            x, (ids, w) = torch.randn(T, H, generator=gen), routing(T, gen)
            t_ours = timed(lambda: backend.forward(packed, x, ids, w), args.prefill_iters)
            t_base = timed(lambda: dequant_matmul(packed, x, ids, w), args.prefill_iters)
            y, _ = backend.forward(packed, x, ids, w)
            ref = dequant_matmul(packed, x, ids, w)
            rel = ((y - ref).norm() / ref.norm()).item()
            gflops = 2 * T * K * 3 * H * I / t_ours / 1e9
            print(f"{fmt:7} {T:>4} {1e3 * t_ours:>9.1f} {touched_bytes(packed, ids) / 1e6:>8.1f} {'':>7} {'':>8} "
                  f"{1e3 * t_base:>12.1f} {t_base / t_ours:>8.2f}x   ({gflops:.0f} GFLOP/s; rel. diff {rel:.1e})")
    if x is None or x.shape[0] <= 64:
        return
    try:
        from ktcore.experts import ExpertWeights
        from ktcore_amx_bf16.backend import AMXBF16Backend

        amx = AMXBF16Backend(KTConfig(kt_num_threads=args.threads))
        dq = backend.unpack(packed)
        amx_packed = amx.pack(ExpertWeights(dq.gate.bfloat16(), dq.up.bfloat16(), dq.down.bfloat16()))
        t_amx = timed(lambda: amx.forward(amx_packed, x.bfloat16(), ids, w), args.prefill_iters)
        print(f"T={x.shape[0]} amx_bf16 on bf16 weights: {1e3 * t_amx:.1f} ms (llamafile {fmt} / amx_bf16 = "
              f"{t_ours / t_amx:.2f})")
    except Exception as exc:  # noqa: BLE001 - amx_bf16 needs an AMX CPU
        print(f"amx_bf16 comparison skipped: {type(exc).__name__}: {str(exc).splitlines()[0]}")


if __name__ == "__main__":
    main()
