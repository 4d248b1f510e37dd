"""ktcore amx_bf16 against KTransformers' kt-kernel (``AMXBF16_SFT_MOE``, the 0.7.2 C++ API) on kt-kernel's own
benchmark shape: one MoE layer E=128 K=8 H=2048 I=768, 512 tokens, bf16 weights, expert LoRA r=8 on gate, up and
down, forward (saving for backward) and backward. Plain script, prints a markdown table; no timed asserts.

    python benchmarks/bench_ktkernel.py [--threads N] [--tokens 512] [--rounds 3]

Runs only where kt-kernel is importable and this CPU can run AMX; otherwise it says which in one line. Both sides get
the same weights and the same LoRA: kt-kernel's separate gate and up A factors are both ktcore's shared gate_up A,
and its B factors the gate and up halves of ktcore's, so both compute the same function (the table reports how
far their outputs and gradients are apart). Each figure is the median over rounds, the two taking turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

E, K, H, I, RANK, ALPHA = 128, 8, 2048, 768, 8, 16.0


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _problem(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).contiguous()

    weights = (rnd(E, I, H, scale=H ** -0.5), rnd(E, I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5))
    lora = (rnd(E, RANK, H, scale=H ** -0.5), rnd(E, 2 * I, RANK, scale=0.05), rnd(E, RANK, I, scale=I ** -0.5),
            rnd(E, H, RANK, scale=0.05))
    x = rnd(tokens, H, scale=1.0)
    ids = torch.rand(tokens, E, generator=g).topk(K, dim=1).indices.contiguous()
    w = torch.softmax(torch.rand(tokens, K, generator=g), dim=1).contiguous()
    gy = rnd(tokens, H, scale=1.0)
    return weights, lora, x, ids, w, gy


class KtcoreLayer:
    def __init__(self, threads: int, weights, lora):
        from ktcore.config import KTConfig
        from ktcore.experts import ExpertLoRA, ExpertWeights
        from ktcore_amx_bf16.backend import AMXBF16Backend

        self.backend = AMXBF16Backend(KTConfig(kt_backend="amx_bf16", kt_num_threads=threads))
        self.packed = self.backend.pack(ExpertWeights(*weights))
        self.lora = ExpertLoRA(*lora, gate_up_scale=ALPHA / RANK, down_scale=ALPHA / RANK)

    def forward(self, x, ids, w):
        self.y, self.ctx = self.backend.forward(self.packed, x, ids, w, self.lora, save=True)
        return self.y

    def backward(self, gy):
        gx, _, grads = self.backend.backward(self.packed, self.ctx, gy, self.lora)
        return gx, grads.down_a


class KtKernelLayer:
    """kt-kernel's AMXBF16_SFT_MOE driven through its C++ extension, as its own SFT tests do."""

    def __init__(self, threads: int, weights, lora, tokens: int):
        from kt_kernel import kt_kernel_ext

        ext = kt_kernel_ext
        pool = ext.WorkerPoolConfig()
        pool.subpool_count = 1
        pool.subpool_numa_map = [0]
        pool.subpool_thread_count = [threads]
        self.cpu = ext.CPUInfer(pool)
        gu_a, gu_b, d_a, d_b = lora
        # kt-kernel keeps separate gate and up LoRA: the same A for both, B split into its gate and up halves
        self.keep = [*weights, gu_a, gu_b[:, :I].contiguous(), gu_a.clone(), gu_b[:, I:].contiguous(), d_a, d_b]
        names = ["gate_proj", "up_proj", "down_proj", "gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b",
                 "down_lora_a", "down_lora_b"]
        cfg = ext.moe.MOESFTConfig()
        cfg.expert_num, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size = E, K, H, I
        cfg.lora_rank, cfg.lora_alpha, cfg.max_cache_depth, cfg.max_len, cfg.layer_idx = RANK, ALPHA, 1, tokens, 0
        for name, t in zip(names, self.keep):
            setattr(cfg, name, t.data_ptr())
        cfg.pool = self.cpu.backend_
        self.moe = ext.moe.AMXBF16_SFT_MOE(cfg)
        self.cpu.submit(self.moe.load_weights_task())
        self.cpu.sync()
        self.cpu.submit(self.moe.warm_up_task())
        self.cpu.sync()
        self.grads = [torch.zeros_like(t) for t in self.keep[3:]]

    def forward(self, x, ids, w):
        y = torch.zeros_like(x)
        self.bsz = torch.tensor([x.shape[0]])
        self.cpu.submit(self.moe.forward_sft_task(self.bsz.data_ptr(), K, ids.data_ptr(), w.data_ptr(),
                                                  x.data_ptr(), y.data_ptr(), True))
        self.cpu.sync()
        return y

    def backward(self, gy):
        gx = torch.zeros_like(gy)
        for g in self.grads:  # kt-kernel adds the LoRA gradients into these buffers
            g.zero_()
        grad_w = torch.empty(gy.shape[0], K, dtype=torch.float32)  # the routing-weight gradient, as its SFT layer
        # 0.7.2: the six LoRA gradients, then the routing weights', then the frozen weights' (0: LoRA only)
        self.cpu.submit(self.moe.backward_task(gy.data_ptr(), gx.data_ptr(), *(g.data_ptr() for g in self.grads),
                                               grad_w.data_ptr(), 0, 0, 0))
        self.cpu.sync()
        return gx, self.grads[4]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="calls per round (median)")
    args = ap.parse_args()
    try:
        import kt_kernel
    except ImportError as exc:
        print(f"kt-kernel is not importable here ({exc}); nothing to compare with (pip install kt-kernel==0.7.2)")
        return
    from ktcore_amx_bf16 import _ext

    why = _ext.amx_unavailable_reason()
    if why:
        print(f"amx_bf16 cannot run on this machine: {why}")
        return
    weights, lora, x, ids, w, gy = _problem(args.tokens)
    ours = KtcoreLayer(args.threads, weights, lora)
    try:
        peer = KtKernelLayer(args.threads, weights, lora, args.tokens)
    except AttributeError as exc:
        print(f"kt-kernel {getattr(kt_kernel, '__version__', '?')} is importable but its API is not the one this "
              f"bench drives (0.7.2's kt_kernel_ext.moe.AMXBF16_SFT_MOE): {exc}")
        return
    torch.set_num_threads(args.threads)
    times = {("ktcore", "fwd"): [], ("ktcore", "bwd"): [], ("kt-kernel", "fwd"): [], ("kt-kernel", "bwd"): []}
    results = {}
    for _ in range(args.rounds):
        for name, layer in (("ktcore", ours), ("kt-kernel", peer)):
            fwd, bwd = [], []
            for _ in range(args.reps):
                tf, y = _timed(lambda: layer.forward(x, ids, w))
                tb, grads = _timed(lambda: layer.backward(gy))
                fwd.append(tf)
                bwd.append(tb)
            times[name, "fwd"].append(statistics.median(fwd))
            times[name, "bwd"].append(statistics.median(bwd))
            results[name] = (y, *grads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"machine: {cpu}, {args.threads} threads; kt-kernel {getattr(kt_kernel, '__version__', '?')}, "
          f"torch {torch.__version__}")
    print(f"E={E} K={K} H={H} I={I}, {args.tokens} tokens, bf16 weights, expert LoRA r={RANK} (gate, up, down), "
          f"median of {args.rounds} rounds x {args.reps} calls")
    print()
    print("| what | ktcore amx_bf16 ms | kt-kernel ms | kt-kernel / ktcore |")
    print("| --- | ---: | ---: | ---: |")
    for part, label in (("fwd", "forward (saving for backward)"), ("bwd", "backward")):
        a, b = statistics.median(times["ktcore", part]), statistics.median(times["kt-kernel", part])
        print(f"| {label} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x |")
    print()
    (y0, gx0, gd0), (y1, gx1, gd1) = results["ktcore"], results["kt-kernel"]
    print(f"agreement (relative difference, kt-kernel against ktcore): output {_relative(y1, y0):.2e}, input "
          f"gradient {_relative(gx1, gx0):.2e}, down LoRA A gradient {_relative(gd1, gd0):.2e}")


if __name__ == "__main__":
    main()
