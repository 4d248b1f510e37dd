"""Routed experts computed on the model's device with expert LoRA (``gpu_stream``, hybrid, resident experts):
ktcore's ``device_experts`` (LoRA beside the grouped GEMMs) against PEFT's parametrisation (``W + scaling * B @ A``
added to the weights, then transformers' grouped kernel), which is what the streamed path ran before and what
transformers + PEFT run for a MoE model on the GPU. One layer, forward + backward, in one run.

    python benchmarks/bench_device_experts.py [--shape E,K,H,I] [--tokens 2048,8192] [--rank 8] [--rounds 5]

Default shape: DeepSeek-V2-Lite's layer (E=64 K=6 H=2048 I=1408). On a GPU in bf16 (weights bf16, LoRA factors
fp32 as PEFT keeps them); without one on the CPU in float32 (slow; use fewer tokens). Prints, per tokens, the median
seconds of each way, the ratio, the peak memory above the inputs, and the largest relative difference of the
gradients (x, then each factor) between the two. No timed asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ktcore.model.device_experts import WeightsOf, device_experts


def experts_module(E: int, H: int, I: int):
    """transformers' own DeepSeek-V2 experts module (its gate, its act), built without weights."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts

    config = DeepseekV2Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, hidden_act="silu")
    with torch.device("meta"):
        return DeepseekV2Experts(config)


def problem(E, K, H, I, rank, tokens, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    weights = (randn(E, 2 * I, H, scale=0.02).to(dtype), randn(E, H, I, scale=0.02).to(dtype))
    factors = tuple((randn(E, n, rank, scale=0.1).requires_grad_(), randn(E, rank, k, scale=0.1).requires_grad_(), 2.0)
                    for n, k in ((2 * I, H), (H, I)))
    x = randn(tokens, H, scale=1.0).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(device)
    routing = torch.rand(tokens, K, generator=g).to(device)
    return weights, factors, x, ids, routing, randn(tokens, H, scale=1.0).to(dtype)


def peft_way(module, weights, factors, x, ids, routing):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    added = [w + (torch.bmm(b, a) * s).to(w.dtype) for w, (b, a, s) in zip(weights, factors)]
    return ALL_EXPERTS_FUNCTIONS["grouped_mm"](WeightsOf(module, *added), x, ids, routing)


def run_once(way, module, weights, factors, x, ids, routing, grad_y):
    for leaf in (x, *[t for b, a, _ in factors for t in (b, a)]):
        leaf.grad = None
    way(module, weights, factors, x, ids, routing).backward(grad_y)
    return [x.grad] + [t.grad for b, a, _ in factors for t in (b, a)]


def measure(way, args, device, rounds):
    """(median seconds, peak bytes above what was allocated before, gradients)."""
    cuda = device.type == "cuda"
    times = []
    grads = run_once(way, *args)  # warm-up
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        grads = run_once(way, *args)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return statistics.median(times), peak, [g.detach().clone() for g in grads]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64,6,2048,1408", help="E,K,H,I")
    parser.add_argument("--tokens", default=None, help="comma list (default 2048,8192 on a GPU, 256 on the CPU)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    E, K, H, I = (int(v) for v in args.shape.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = [int(t) for t in (args.tokens or ("2048,8192" if device.type == "cuda" else "256")).split(",")]
    module = experts_module(E, H, I)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, {dtype}, E={E} K={K} H={H} I={I}, LoRA r={args.rank}, median of {args.rounds}")
    print("| tokens | PEFT's W + s B A, s | ktcore device_experts, s | speed-up | peak GiB PEFT's / ktcore's | "
          "grads max rel diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for t in tokens:
        weights, factors, x, ids, routing, grad_y = problem(E, K, H, I, args.rank, t, device, dtype)
        call = (module, weights, factors, x, ids, routing, grad_y)
        peft_s, peft_peak, peft_grads = measure(peft_way, call, device, args.rounds)
        ours_s, ours_peak, ours_grads = measure(device_experts, call, device, args.rounds)
        diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(ours_grads, peft_grads))
        peaks = "-" if peft_peak is None else f"{peft_peak / 2**30:.2f} / {ours_peak / 2**30:.2f}"
        print(f"| {t:,} | {peft_s:.4f} | {ours_s:.4f} | {peft_s / ours_s:.2f}x | {peaks} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
