"""``ktcore plan``: which expert placement a config's model fits and how fast each would train, from its
config.json alone (no weight is read) and a machine's measured rates (``model/cost.py`` is the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from ..model.cost import Rates, Setting, plan


def measured_rates(kt, seconds: float = 0.5) -> Rates:
    """This machine's rates, measured now with the backend ``kt_backend`` names (``ktcore doctor``'s probes)."""
    from ..plugins.select import get_backend
    from ..plugins.threads import backend_threads
    from .rates import measure_rates

    backend = get_backend(kt.kt_backend, kt, need_backward=True, need_lora=True)
    return Rates(**measure_rates(backend, backend_threads(kt.kt_num_threads), seconds))


def hf_config_of(cfg):
    """The model's config.json (a directory's, a GGUF's metadata) as a transformers config."""
    from transformers import AutoConfig

    from ..config import resolve_model_path

    path = Path(resolve_model_path(cfg))
    if path.suffix.lower() == ".gguf":  # the config ktcore.load_model builds from the file's metadata
        from ..weights.gguf_reader import GGUFFile, gguf_config

        with GGUFFile(path) as file:
            return gguf_config(file)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{cfg.where}: model_name_or_path {cfg.model_name_or_path!r} has no config.json; "
                          "ktcore plan needs only that file (copy it from the model's repository)")
    return AutoConfig.from_pretrained(str(path), trust_remote_code=cfg.trust_remote_code)


def run(cfg, rates: Rates, tokens: list[int], gpu_mem: Optional[float] = None, host_ram: Optional[float] = None,
        cpu_cores: Optional[int] = None) -> dict:
    from dataclasses import asdict, replace

    from ..model.shape import model_shape
    from ..plugins.select import experts_format

    if cpu_cores:
        rates = rates.with_cores(cpu_cores)
    rates = replace(rates, gpu_mem_gib=gpu_mem if gpu_mem is not None else rates.gpu_mem_gib,
                    host_ram_gib=host_ram if host_ram is not None else rates.host_ram_gib)
    shape = model_shape(hf_config_of(cfg))
    kt = cfg.kt
    fmt = experts_format(kt)
    fmt = fmt if fmt != "auto" else "bf16"
    steps = []
    for t in tokens:
        setting = Setting(tokens=t, lora_rank=cfg.lora_rank, weight_format=fmt,
                          recompute=kt.kt_cpu_activation == "recompute", cache_depth=kt.kt_max_cache_depth,
                          ring=kt.kt_stream_ring, stream_recompute=kt.kt_stream_activation == "recompute",
                          gradient_checkpointing=cfg.gradient_checkpointing,
                          gpu_experts=kt.kt_num_gpu_experts, gpu_experts_interval=kt.kt_gpu_experts_interval)
        result = plan(shape, setting, rates)
        steps.append({"tokens": t, "auto": result["auto"],
                      "auto_choice": result["costs"]["auto"].choice if "auto" in result["costs"] else result["auto"],
                      "placements": [c.as_dict() for c in result["costs"].values()]})
    return {"model": cfg.model_name_or_path, "shape": asdict(shape), "rates": asdict(rates),
            "weight_format": fmt, "steps": steps}


def format_plan(result: dict) -> str:
    s, r = result["shape"], result["rates"]
    routed_gb = s["moe_layers"] * s["experts"] * 3 * s["hidden"] * s["expert_intermediate"] / 1e9
    lines = [f"model     {result['model']}: {s['moe_layers']} MoE layers of {s['experts']} experts (top-{s['top_k']}), "
             f"{routed_gb:.1f} B routed + {s['non_expert_params'] / 1e9:.2f} B other parameters; "
             f"experts as {result['weight_format']} on the CPU",
             f"machine   CPU experts {r['cpu_expert_gflops']:g} GFLOP/s on {r['cpu_cores']} cores, DRAM "
             f"{r['dram_gbps']:g} GB/s; " + (f"H2D {r['h2d_gbps']:g} GB/s, GPU {r['gpu_tflops']:g} TFLOP/s"
                                              if r["h2d_gbps"] else "no GPU")
             + f"; GPU memory {r['gpu_mem_gib'] or '?'} GiB, host RAM {r['host_ram_gib'] or '?'} GiB"]
    for step in result["steps"]:
        lines.append("")
        lines.append(f"{step['tokens']} tokens/step: auto takes "
                     + (step["auto_choice"] if step["auto"] else "nothing (no placement fits; see the reasons)"))
        header = ("placement", "tok/s", "step s", "GPU GiB", "host GiB", "CPU share", "H2D GB", "fits")
        rows = [(c["placement"], f"{c['tokens_per_s']:,.0f}", f"{c['step_s']:.3f}", f"{c['gpu_gib']:.1f}",
                 f"{c['host_gib']:.1f}", f"{c['cpu_share']:.2f}", f"{c['copy_gb']:.1f}",
                 "yes" if c["fits"] else "no: " + c["why_not"]) for c in step["placements"]]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)
