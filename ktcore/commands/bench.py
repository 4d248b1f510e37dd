"""``ktcore bench kernels``: expert-layer timings of every chosen backend, as ratios measured in one run.

Each row times one backend on one layer shape: forward, and forward + backward (input, routing-weight and expert
LoRA gradients), with expert LoRA of rank ``lora_rank`` on gate_up and down as training runs it (0: none), and
reports GFLOP/s (of the frozen projections), the GB/s of expert weights touched, the speed-up over the torch
reference backend, the share of the DRAM read bandwidth and of the bf16 matrix peak measured in the same run
(``ktcore doctor``'s probes), and the minor page faults of one steady-state forward + backward (fresh memory
touched every step). Every time is the median over ``rounds`` rounds, each round's own figure the median of its
repetitions after a warm-up call; the backends take turns within a round, so a slow minute of the machine falls on
all of them, and each row prints the spread of its round figures. Nothing here asserts a time; the test suite's
bounds on such figures run only with ``pytest -m perf``.
"""

from __future__ import annotations

import statistics

import torch

from ..experts.probe import Shape, make_problem, median_time


SCENARIOS = {
    "quick": Shape("quick", 16, 2, 256, 128, (1, 64)),
    "memory": Shape("memory-bound E128 K8 H2048 I768", 128, 8, 2048, 768, (512,)),
    "compute": Shape("compute-bound E8 K2 H2048 I1408", 8, 2, 2048, 1408, (4096,)),
    "dsv2lite": Shape("DeepSeek-V2-Lite E64 K6 H2048 I1408", 64, 6, 2048, 1408, (1, 16, 512, 4096)),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def minor_page_faults(fn) -> int:
    """Minor page faults of the process during one call of ``fn`` (memory touched for the first time)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


class _Timed:
    """One backend on one problem: packed once, then timed round after round."""

    def __init__(self, backend, weights, x, ids, w, backward: bool, lora=None):
        self.packed = packed = backend.pack(weights, activation="silu")
        self.forward = lambda: backend.forward(packed, x, ids, w, lora, save=False)
        self.step = None
        if backward:
            grad_y = torch.ones_like(x)

            def step():
                _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
                backend.backward(packed, ctx, grad_y, lora)

            self.step = step
        self.fwd_s, self.fwd_bwd_s = [], []

    def round(self, seconds: float) -> None:
        self.fwd_s.append(median_time(self.forward, seconds))
        if self.step:
            self.fwd_bwd_s.append(median_time(self.step, seconds))

    def page_faults(self):
        return minor_page_faults(self.step) if self.step else None  # after the timed steps: the steady state


def _spread_pct(times: list) -> float:
    """(slowest - fastest round) / median, in percent."""
    return 100 * (max(times) - min(times)) / statistics.median(times)


def run(scenarios, backends: dict, dtype: str, seconds: float, backward: bool, tokens=None, lora_rank: int = 8,
        rounds: int = 3) -> dict:
    """backends: name -> instance (the first is the baseline). Returns {"machine": ..., "rows": [...]}."""
    from ..experts.probe import measure_read_bandwidth
    from .doctor import backend_reports, measure_onednn_bf16_gflops

    bandwidth = measure_read_bandwidth(seconds=seconds)
    gemm, _ = measure_onednn_bf16_gflops(seconds=seconds)
    # a backend's doctor probe reports its own bf16 matrix peak as <name>_peak_gflops (amx_bf16: AMX tiles)
    peaks = {k: v for k, v in backend_reports(seconds).items() if k.endswith("_peak_gflops") and v}
    peak_source = max(peaks, key=peaks.get) if peaks else "onednn_bf16_gemm_gflops"
    peak = peaks.get(peak_source, gemm)
    rows = []
    baseline = next(iter(backends))
    for key in scenarios:
        shape = SCENARIOS[key]
        for t in tokens or shape.tokens:
            weights, x, ids, w, lora = make_problem(shape, t, DTYPES[dtype], lora_rank=lora_rank)
            touched = int(torch.unique(ids).numel())
            dense_bytes = touched * 3 * shape.hidden * shape.inter * weights.gate.element_size()
            flops = 2.0 * 3 * shape.hidden * shape.inter * t * shape.top_k
            timed = {name: _Timed(backend, weights, x, ids, w, backward, lora) for name, backend in backends.items()}
            for _ in range(rounds):
                for one in timed.values():
                    one.round(seconds)
            base_fwd = statistics.median(timed[baseline].fwd_s)
            base_fwd_bwd = statistics.median(timed[baseline].fwd_bwd_s) if backward else None
            for name, one in timed.items():
                # the bytes this backend's packed experts take (int8: about half of bf16), where it says
                packed_bytes = getattr(one.packed, "nbytes", None)
                nbytes = touched * packed_bytes / shape.experts if packed_bytes else dense_bytes
                fwd = statistics.median(one.fwd_s)
                fwd_bwd = statistics.median(one.fwd_bwd_s) if backward else None
                rows.append({
                    "scenario": shape.name, "tokens": t, "lora_rank": lora_rank, "backend": name,
                    "fwd_ms": fwd * 1e3, "fwd_spread_pct": _spread_pct(one.fwd_s),
                    "fwd_gflops": flops / fwd / 1e9, "fwd_gbps": nbytes / fwd / 1e9,
                    "fwd_read_time_ratio": fwd / (nbytes / (bandwidth * 1e9)),
                    "fwd_pct_peak": 100 * flops / fwd / 1e9 / peak if dtype == "bf16" else None,
                    "fwd_bwd_ms": None if fwd_bwd is None else fwd_bwd * 1e3,
                    "fwd_bwd_spread_pct": _spread_pct(one.fwd_bwd_s) if backward else None,
                    "fwd_speedup_vs_" + baseline: base_fwd / fwd,
                    "fwd_bwd_speedup_vs_" + baseline: None if fwd_bwd is None else base_fwd_bwd / fwd_bwd,
                    "fwd_bwd_page_faults": one.page_faults(),
                })
            del weights, timed
    machine = {"dram_read_gbps": bandwidth, "onednn_bf16_gemm_gflops": gemm, **peaks, "peak_used_gflops": peak,
               "peak_source": peak_source, "dtype": dtype, "torch_threads": torch.get_num_threads(),
               "rounds": rounds}
    return {"machine": machine, "rows": rows}


LEGEND = {
    "fwd_ms": "forward (no activations saved): median over the rounds of each round's median call, ms",
    "fwd_spread_pct": "(slowest - fastest round) / median of the forward, %",
    "fwd_gflops": "GFLOP/s of the frozen projections in the forward (2 x 3 x H x I per routed token, LoRA aside)",
    "fwd_gbps": "GB/s of the expert weights the routing touches, read once per forward, as this backend packs them",
    "fwd_read_time_ratio": "forward time / the time one read of those weights takes at the measured DRAM rate",
    "fwd_pct_peak": "fwd_gflops as % of the bf16 peak in the heading (bf16 only)",
    "fwd_bwd_ms": "forward saving activations + backward (input, routing-weight and expert-LoRA gradients), ms",
    "fwd_bwd_spread_pct": "(slowest - fastest round) / median of forward + backward, %",
    "fwd_speedup_vs_*": "the first backend's fwd_ms / this row's",
    "fwd_bwd_speedup_vs_*": "the first backend's fwd_bwd_ms / this row's",
    "fwd_bwd_page_faults": "minor page faults of one steady-state forward + backward (fresh memory touched per step)",
}


def format_table(result: dict) -> str:
    m = result["machine"]
    head = (f"DRAM read {m['dram_read_gbps']:.1f} GB/s; bf16 peak {m['peak_used_gflops']:.1f} GFLOP/s "
            f"({m['peak_source']}); weights {m['dtype']}; "
            f"{m['torch_threads']} threads; median of {m['rounds']} rounds")
    rows = result["rows"]
    if not rows:
        return head
    speed_keys = [k for k in rows[0] if k.startswith("fwd_speedup_vs_") or k.startswith("fwd_bwd_speedup_vs_")]
    cols = ["scenario", "tokens", "lora_rank", "backend", "fwd_ms", "fwd_spread_pct", "fwd_gflops", "fwd_gbps",
            "fwd_read_time_ratio", "fwd_pct_peak", "fwd_bwd_ms", "fwd_bwd_spread_pct", *speed_keys,
            "fwd_bwd_page_faults"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else ("-" if r[c] is None else str(r[c])) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{key}: {meaning}" for key, meaning in LEGEND.items()]
    return "\n".join(lines)
