"""The ``ktcore`` command line (DESIGN section 5)."""

from __future__ import annotations

import json
import math
import sys

import click

from .. import __version__
from ..errors import KtcoreError, PluginError
from ..plugins import get_registry
from ..plugins.threads import is_main_rank
from ..specs import import_object


class KtcoreGroup(click.Group):
    """Turns ktcore's own errors into one clear line and exit code 2 instead of a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (KtcoreError, FileNotFoundError) as exc:
            click.echo("error: " + " ".join(str(exc).split("\n")), err=True)  # one line, whatever the message
            ctx.exit(2)
        except click.UsageError as exc:  # a command's arguments: one line, not click's usage block
            command = exc.ctx.command_path if exc.ctx else ctx.command_path
            click.echo(f"error: {command}: {exc.format_message()} (see {command} --help)", err=True)
            ctx.exit(2)


@click.group(cls=KtcoreGroup)
@click.version_option(__version__, prog_name="ktcore")
def main():
    """Fine-tune and run MoE models bigger than the GPU: routed experts on CPU backends."""


def _print_rows(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        click.echo("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns).rstrip())


@main.command("plugins")
@click.option("--all", "show_all", is_flag=True, help="also list broken and disabled plugins")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def plugins_cmd(show_all, as_json):
    """Every plugin descriptor, with the distribution that registered it."""
    records = [r for r in get_registry().records() if show_all or r.status == "ok"]
    rows = [r.as_dict() for r in records]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        _print_rows(rows, ["name", "kind", "dist", "version", "status", "reason"])


@main.command("list-backends")
@click.option("--json", "as_json", is_flag=True)
@click.option("--explain", is_flag=True, help="say why each backend is or is not chosen by auto")
@click.option("--weight-format", default="auto", show_default=True,
              help="the kt_expert_weight_format to choose for (int8: which backend computes int8 experts)")
def list_backends(as_json, explain, weight_format):
    """Expert backends; the row `auto` picks on this machine is marked with *."""
    from ..config import KTConfig
    from ..plugins.select import resolve_backend

    formats = KTConfig.__dataclass_fields__["kt_expert_weight_format"].metadata.get("choices")
    if formats and weight_format not in formats:
        raise click.BadParameter(f"{weight_format!r} is not one of {', '.join(formats)}", param_hint="--weight-format")
    # what training (wrap_model) picks
    choice = resolve_backend("auto", weight_format=weight_format, need_backward=True, need_lora=True)
    registry = get_registry()
    rows = []
    for name, spec in sorted(registry.specs("expert_backend").items()):
        why = choice.reasons.get(name)
        rows.append({"name": name, "auto": choice.spec is not None and choice.spec.name == name,
                     "usable": why is None or why.startswith("usable"), "priority": spec.priority,
                     "features": ",".join(spec.required_cpu_features) or "-",
                     "formats": ",".join(spec.weight_formats), "backward": spec.supports_backward,
                     "reason": why or "chosen by auto", "description": spec.description})
    broken = [r for r in registry.records("expert_backend") if r.status != "ok"]
    if as_json:
        click.echo(json.dumps({"backends": rows, "broken": [r.as_dict() for r in broken]}, indent=2))
        return
    for row in rows:
        row["name"] = ("* " if row["auto"] else "  ") + row["name"]
    columns = ["name", "priority", "features", "formats", "backward"] + (["reason"] if explain else [])
    _print_rows(rows, columns)
    if explain:
        for rec in broken:
            click.echo(f"  {rec.entry_point} ({rec.dist}): {rec.status}: {rec.reason}")


def _list_kind(kind: str, columns: list[str], describe, more=None):
    @click.option("--json", "as_json", is_flag=True)
    def command(as_json):
        registry = get_registry()
        rows = [{"name": name, **describe(spec)} for name, spec in sorted(registry.specs(kind).items())]
        if more:
            rows += more(registry.specs(kind))
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            _print_rows(rows, ["name"] + columns)
    return command


main.command("list-archs", help="Model architectures and the HF classes they handle.")(
    _list_kind("arch", ["hf_architectures", "experts_module"],
               lambda s: {"hf_architectures": ",".join(s.hf_architectures), "experts_module": s.experts_module}))
def _frontends_elsewhere(installed) -> list[dict]:
    """Rows for the frontends not installed here that have an environment of their own (or a setup script)."""
    from ..frontends.environments import environments, not_set_up, source_tree

    rows = [{"name": n, "stages": "-", "requires": "-", "description": f"in {python.parent.parent}: ktcore train "
             f"--frontend {n} runs there"} for n, python in environments().items() if n not in installed]
    scripts = sorted((source_tree() / "scripts").glob("setup_*.sh")) if source_tree() else []
    for name in (s.stem[len("setup_"):] for s in scripts):
        if name not in installed and (how := not_set_up(name)):
            rows.append({"name": name, "stages": "-", "requires": "-", "description": how})
    return rows


main.command("list-frontends", help="Training frontends and the stages they run.")(
    _list_kind("frontend", ["stages", "requires", "description"],
               lambda s: {"stages": ",".join(s.stages), "requires": ",".join(s.required_packages) or "-",
                          "description": s.description}, _frontends_elsewhere))
main.command("list-adapter-formats", help="Adapter file formats.")(
    _list_kind("adapter_format", ["description"], lambda s: {"description": s.description}))


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--seconds", default=0.5, show_default=True, help="time for each measured probe")
def doctor(as_json, seconds):
    """CPU features, AMX permission, threads, RAM, GPU, and measured peak rates."""
    from .doctor import collect, format_report
    from .rates import rates_of_auto

    report = collect(seconds=seconds)
    report["rates"] = rates_of_auto(seconds)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@main.command("plan")
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(dir_okay=False))
@click.option("--rates", "rates_path", type=click.Path(dir_okay=False),
              help="rates file: ktcore doctor --json output, or a JSON of fixed rates (default: measure here)")
@click.option("--gpu-mem", type=float, help="GPU memory in GiB (default: the rates', or this GPU's)")
@click.option("--host-ram", type=float, help="host RAM in GiB (default: the rates', or this host's)")
@click.option("--cpu-cores", type=click.IntRange(min=1), help="cores for the CPU backend (scales its rate)")
@click.option("--tokens", default=None, help="tokens per step, a comma list (default: cutoff_len x batch size)")
@click.option("--json", "as_json", is_flag=True)
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def plan_cmd(config_path, rates_path, gpu_mem, host_ram, cpu_cores, tokens, as_json, overrides):
    """Predict time and memory of each expert placement from config.json alone, and what auto would take."""
    from ..config import load_config
    from ..model.cost import load_rates
    from .plan import format_plan, measured_rates, run

    cfg = load_config(config_path, overrides)
    try:
        steps = [int(t) for t in tokens.split(",")] if tokens else \
            [cfg.cutoff_len * cfg.per_device_train_batch_size]
    except ValueError:
        raise click.UsageError(f"--tokens {tokens!r}: a comma list of token counts, e.g. 2048,8192") from None
    if any(t <= 0 for t in steps):
        raise click.UsageError(f"--tokens {tokens!r}: token counts must be positive")
    rates = load_rates(rates_path) if rates_path else measured_rates(cfg.kt)
    result = run(cfg, rates, steps, gpu_mem, host_ram, cpu_cores)
    click.echo(json.dumps(result, indent=2) if as_json else format_plan(result))


def _config_here(command: str, config_path, frontend: str, overrides):
    """The config, checked here first; a frontend installed only in an environment of its own gets the same
    ``ktcore COMMAND`` there instead (this process is replaced)."""
    from ..config import load_config
    from ..frontends.environments import hand_over

    cfg = load_config(config_path, overrides)
    if frontend not in get_registry().specs("frontend"):
        hand_over(frontend, [command, config_path, "--frontend", frontend, *overrides])
    return cfg


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(dir_okay=False))
@click.option("--frontend", default="trl", show_default=True, help="training frontend plugin")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def train(config_path, frontend, overrides):
    """Train the LoRA adapter described by CFG.yaml with a frontend (KEY=VALUE overrides keys)."""
    from ..frontends import run_frontend

    summary = run_frontend(frontend, _config_here("train", config_path, frontend, overrides))
    if is_main_rank():  # launched on several ranks (torchrun, accelerate launch): one summary, rank 0's
        click.echo(json.dumps(summary, indent=2, default=str))
    _leave_process_group()


def _leave_process_group() -> None:
    """A launched job's ranks tear their process group down once training succeeded, while the interpreter is
    whole: left to interpreter exit, gloo's worker threads may still hold work whose tensors then abort the process
    ("terminate called without an active exception", pytorch/pytorch#190489; a rank of tests/test_ddp.py died so
    in CI after its summary was printed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@main.command("eval", context_settings={"ignore_unknown_options": False})
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(dir_okay=False))
@click.option("--frontend", default="llamafactory", show_default=True, help="frontend plugin that evaluates")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def eval_cmd(config_path, frontend, overrides):
    """Evaluation loss and perplexity of the model (and adapter) CFG.yaml describes on its eval_dataset."""
    from ..frontends import evaluate_frontend

    cfg = _config_here("eval", config_path, frontend, overrides)
    click.echo(json.dumps(evaluate_frontend(frontend, cfg), indent=2, default=str))


@main.command()
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(dir_okay=False))
@click.option("--prompt", default=None, help="answer this one prompt and exit (default: interactive)")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def chat(config_path, prompt, overrides):
    """Talk to the model CFG.yaml describes (routed experts on the CPU backend, its adapter if any)."""
    from .chat import run_chat
    from ..config import load_config

    run_chat(load_config(config_path, overrides), prompt=prompt)


@main.command("convert")
@click.argument("model", metavar="MODEL", type=click.Path(exists=True))
@click.option("--format", "fmt", default=None,
              help="a model directory: bf16 or int8 (default bf16); a .gguf file: the GGUF block type (default: "
                   "the converter's first, q4_k for llamafile's)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="output directory")
@click.option("--threadpools", type=click.IntRange(min=1), default=1, show_default=True,
              help="a model directory: split each layer's experts into this many thread-pool files")
@click.option("--non-expert", is_flag=True, help="a model directory: every tensor but the routed experts, in bf16")
@click.option("--workers", type=click.IntRange(min=0), default=0,
              help="a model directory: layers converted at once, one reading at a time [default: min(4, cores)]; "
                   "host memory: one layer's files each")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--overwrite", is_flag=True,
              help="a .gguf file: replace the output when it is an earlier output of ktcore convert")
def convert_cmd(model, fmt, out, threadpools, non_expert, workers, quiet, overwrite):
    """MODEL a safetensors model directory (FP8 DeepSeek-V3 included): write its routed experts (--format
    bf16|int8), or with --non-expert every other tensor, as a weight store for kt_weight_path /
    kt_non_expert_weight_path; an interrupted run resumes. MODEL.gguf: re-quantise its routed experts with the
    converter of the installed expert backend that writes --format (llamafile: DIR/<name>.<fmt>.gguf); an
    existing output is replaced only with --overwrite, and only when ktcore convert wrote it."""
    from pathlib import Path

    if Path(model).is_dir():
        from ..weights.convert import FORMATS, convert_model

        if overwrite:
            raise click.UsageError("--overwrite takes a .gguf MODEL: a weight store in --out is resumed or refused, "
                                   "never replaced (choose a new --out to convert again)")
        if non_expert and fmt not in (None, "bf16"):
            raise click.UsageError("--non-expert writes bf16; drop --format")
        if fmt not in (None, *FORMATS):
            raise click.UsageError(f"--format {fmt}: a model directory converts to one of {', '.join(FORMATS)}")
        summary = convert_model(model, out, fmt or "bf16", threadpools, non_expert, progress=not quiet,
                                workers=workers)
        click.echo(json.dumps(summary, indent=2))
        return
    if non_expert or threadpools != 1 or workers:
        raise click.UsageError("--non-expert, --threadpools and --workers take a safetensors model directory, "
                               "not a file")
    converters = [(spec, f) for _, spec in sorted(get_registry().specs("expert_backend").items()) if spec.converter
                  for f in spec.convert_formats]
    if not converters:
        raise PluginError("ktcore convert: no installed expert backend declares a converter (`ktcore list-backends`)")
    fmt = fmt or converters[0][1]
    spec = next((spec for spec, f in converters if f == fmt), None)
    if spec is None:
        raise PluginError(f"ktcore convert --format {fmt}: no installed converter writes it; choose one of "
                          f"{', '.join(f for _, f in converters)}")
    summary = import_object(spec.converter)(model, out, fmt, overwrite=overwrite)
    click.echo(json.dumps(summary, indent=2))


@main.group()
def adapter():
    """Convert and verify LoRA adapters (formats: `ktcore list-adapter-formats`)."""


@adapter.command("convert")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--to", "to", default="peft", show_default=True, help="target format (peft, fused_expert, gguf, ...)")
@click.option("--base", default=None, help="local base model (default: the adapter's base_model_name_or_path)")
@click.option("--overwrite", is_flag=True, help="replace DST when it is an earlier output of this command")
def adapter_convert(src, dst, to, base, overwrite):
    """Convert the adapter SRC (format sniffed) into DST in format --to."""
    from ..adapters import convert

    click.echo(json.dumps(convert(src, dst, to, base=base, overwrite=overwrite), indent=2))


@adapter.command("verify")
@click.argument("path", metavar="DIR")
@click.option("--base", default=None, help="check against this local base model")
def adapter_verify(path, base):
    """Validate an adapter (format sniffed) and print every check that passed."""
    from ..adapters import verify
    from ..adapters.integrity import Note

    name, checks = verify(path, base=base)
    click.echo(f"{path}: {name} adapter OK")
    for line in checks:
        click.echo(f"  {'NOTE' if isinstance(line, Note) else 'ok'}  {line}")


@main.command("export")
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="directory for the merged model")
@click.option("--shard-size", default=2.0, show_default=True, help="largest shard in GiB")
@click.option("--overwrite", is_flag=True, help="replace DIR when it is an earlier output of ktcore export")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def export_cmd(config_path, out, shard_size, overwrite, overrides):
    """Merge adapter_name_or_path into model_name_or_path as a standalone safetensors model."""
    from ..config import load_config
    from .export import export_merged

    summary = export_merged(load_config(config_path, overrides), out, max_shard_bytes=int(shard_size * (1 << 30)),
                            overwrite=overwrite)
    click.echo(json.dumps(summary, indent=2))


@main.group()
def bench():
    """Benchmarks that report ratios measured in one run (never pass/fail on time)."""


@bench.command("kernels")
@click.option("--scenario", "scenarios", multiple=True, default=("quick",), show_default=True,
              type=click.Choice(["quick", "memory", "compute", "dsv2lite"]), help="layer shapes (repeatable)")
@click.option("--backend", "backend_names", multiple=True,
              help="backends to time (repeatable; default: torch and every usable one); the first is the baseline")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp32"]))
@click.option("--tokens", default=None, help="comma list of token counts instead of the scenario's")
@click.option("--seconds", default=1.0, show_default=True, help="time budget per measurement")
@click.option("--backward/--no-backward", default=True, show_default=True, help="also time forward+backward")
@click.option("--lora-rank", default=8, show_default=True, help="expert LoRA rank on gate_up and down (0: none)")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="rounds per figure (median reported, spread shown)")
@click.option("--json", "as_json", is_flag=True)
def bench_kernels(scenarios, backend_names, dtype, tokens, seconds, backward, lora_rank, rounds, as_json):
    """Expert-layer forward/backward of each backend vs the torch reference, DRAM bandwidth and bf16 peak."""
    from .bench import format_table, run
    from ..config import KTConfig
    from ..plugins.select import get_backend, resolve_backend

    if not backend_names:
        choice = resolve_backend("auto", need_backward=backward, need_lora=lora_rank > 0)
        usable = [n for n, why in sorted(choice.reasons.items()) if why is None or why.startswith("usable")]
        backend_names = ["torch"] + [n for n in usable if n != "torch"]
    backends = {name: get_backend(name, KTConfig(kt_backend=name), need_backward=backward, need_lora=lora_rank > 0)
                for name in backend_names}
    token_list = tuple(int(t) for t in tokens.split(",")) if tokens else None
    result = run(scenarios, backends, dtype, seconds, backward, token_list, lora_rank, rounds)
    click.echo(json.dumps(result, indent=2) if as_json else format_table(result))


@bench.command("load")
@click.argument("config_path", metavar="CFG.yaml", type=click.Path(exists=True, dir_okay=False))
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="loads, each in a fresh process (median reported, spread shown)")
@click.option("--json", "as_json", is_flag=True)
def bench_load(config_path, overrides, rounds, as_json):
    """Where ktcore chat's load of the model CFG.yaml names goes, stage by stage (imports, checks, tokenizer,
    model, adapter), next to transformers' AutoTokenizer on the same GGUF file."""
    from .bench_load import format_table, run

    result = run(config_path, list(overrides), rounds)
    click.echo(json.dumps(result, indent=2) if as_json else format_table(result))


@bench.command("convert")
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="a safetensors model directory (default: a synthetic bf16 one of --synthetic-gb)")
@click.option("--synthetic-gb", default=10.0, show_default=True,
              help="size of the synthetic checkpoint's experts (Qwen3-30B-A3B layers, random bf16)")
@click.option("--format", "fmt", default="bf16", show_default=True, type=click.Choice(["bf16", "int8"]))
@click.option("--threadpools", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="where the synthetic model (written once, reused by later runs) and the store go "
                   "(default: a temp directory, removed)")
@click.option("--workers", type=click.IntRange(min=0), default=0, help="layers at once [default: min(4, cores)]")
@click.option("--keep", is_flag=True, help="keep the synthetic model and the store")
@click.option("--json", "as_json", is_flag=True)
def bench_convert_cmd(model_dir, synthetic_gb, fmt, threadpools, workdir, workers, keep, as_json):
    """`ktcore convert` of a model directory against `dd` reading the same expert shards, both from a cold page
    cache for those files: MB/s of each and their ratio."""
    import shutil
    import tempfile
    from pathlib import Path

    from .bench_convert import format_result, run, synthetic_model

    work = Path(workdir or tempfile.mkdtemp(prefix="ktcore-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = model_dir or synthetic_model(work / "model", synthetic_gb)
        result = run(model_dir, work / "store", fmt, threadpools, keep=keep, workers=workers)
    finally:
        if not keep and workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    click.echo(json.dumps(result) if as_json else format_result(result))


def _share(text: str) -> float:
    """--hybrid-cpu-share's value: a share, or None for auto."""
    if text == "auto":
        return None
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share < 1:
        raise click.BadParameter(f"{text!r}: a share between 0 and 1 (exclusive), or auto",
                                 param_hint="--hybrid-cpu-share")
    return share


@bench.command("train")
@click.option("--shape", default="deepseek-v2-lite", show_default=True,
              type=click.Choice(["deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b"]), help="the model's shape")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="decoder layers (default: the model's own; 3 or 2 at the tiny CPU shape)")
@click.option("--tokens", default=None, help="comma list of tokens per step [default: 2048,8192; 64,256 on the CPU]")
@click.option("--backend", default="auto", show_default=True, help="expert backend (kt_backend)")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="backend threads (kt_num_threads)")
@click.option("--lora-rank", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="timed steps per run")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0), help="untimed steps first")
@click.option("--gradient-checkpointing", is_flag=True, help="attention-only checkpointing, as ktcore train does")
@click.option("--expert-lora-off/--no-expert-lora-off", default=True, show_default=True,
              help="also time each step with LoRA on the attention and dense linears only")
@click.option("--baseline", is_flag=True,
              help="also transformers + PEFT with the whole model on the GPU, and transformers + accelerate with "
                   "the routed experts offloaded to host memory")
@click.option("--kernel-seconds", default=1.0, show_default=True,
              help="time budget of each kernel-only measurement (0: skip it)")
@click.option("--expert-format", "expert_formats", default="bf16", show_default=True,
              help="comma list of bf16, q8_0, q4_k: the same random model with its routed experts in bf16 (on "
                   "--backend) or as a GGUF of Q8_0 / Q4_K blocks (on llamafile), each timed in turn")
@click.option("--loss-steps", default=0, show_default=True, type=click.IntRange(min=0),
              help="also train this many steps on a task whose loss falls, at the first --tokens, per expert format "
                   "(the last loss and its relative difference to bf16's)")
@click.option("--model", "model_dir", default=None, type=click.Path(exists=True),
              help="time this model (a directory, or a .gguf file whose quantised experts the llamafile backend "
                   "computes with) instead of building one")
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="where the scratch model is written (default: the system's temp directory)")
@click.option("--keep", is_flag=True, help="keep the scratch model (its path is printed)")
@click.option("--cpu", "on_cpu", is_flag=True, help="run on the CPU at the tiny shape even when there is a GPU")
@click.option("--placement", "placements", default="cpu", show_default=True,
              help="comma list of kt_expert_placement values, each run side by side (cpu, gpu_stream, hybrid, auto)")
@click.option("--hybrid-cpu-share", default="0.5", show_default=True,
              help="kt_hybrid_cpu_share of the hybrid runs (ktcore plan predicts the best); auto: unset, the share "
                   "chosen from the rates and re-balanced from measured times")
@click.option("--rates", "rates_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="kt_rates of the auto and re-balanced hybrid runs (default: measured at load)")
@click.option("--stream-ring", default=2, show_default=True, type=click.IntRange(min=1),
              help="kt_stream_ring of the gpu_stream runs")
@click.option("--stream-activation", default="retain", show_default=True, type=click.Choice(["retain", "recompute"]),
              help="kt_stream_activation of the gpu_stream, hybrid and auto runs")
@click.option("--num-gpu-experts", "num_gpu_experts", default="0", show_default=True,
              help="comma list of kt_num_gpu_experts values (experts per MoE layer resident on the GPU), each cpu "
                   "run side by side (e.g. 0,8,16)")
@click.option("--gpu-experts-interval", default=8, show_default=True, type=click.IntRange(min=1),
              help="kt_gpu_experts_interval of the --num-gpu-experts runs (forward calls between choices)")
@click.option("--expert-lora-device", "lora_devices", default="model", show_default=True,
              help="comma list of kt_expert_lora_device values, each run side by side (model, host)")
@click.option("--profile", default=0, show_default=True, type=click.IntRange(min=0),
              help="after each ktcore run's timed steps, one more step under torch's profiler: list its N ops with "
                   "the most time of their own on the model's device")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line: the environment, then each run")
def bench_train(shape, layers, tokens, backend, threads, lora_rank, steps, warmup, gradient_checkpointing,
                expert_lora_off, baseline, kernel_seconds, expert_formats, loss_steps, model_dir, workdir, keep, on_cpu,
                placements, stream_ring, stream_activation, num_gpu_experts, gpu_experts_interval, hybrid_cpu_share,
                rates_path, lora_devices, profile, as_json):
    """LoRA SFT steps of a random-weight model of a real shape, as ktcore train runs them: tokens/s, where the
    step's time goes, peak memory, and the kernel-only time of the same layers (no GPU: a tiny shape)."""
    from pathlib import Path

    import torch

    from .bench_train import (EXPERT_FORMATS, SHAPES, Settings, environment, format_header, format_profile,
                              format_row, run)

    formats = {f.strip() for f in expert_formats.split(",")}
    if not formats <= set(EXPERT_FORMATS):
        raise click.BadParameter(f"{expert_formats!r}: choose from {', '.join(EXPERT_FORMATS)}, e.g. bf16,q8_0,q4_k",
                                 param_hint="--expert-format")
    if model_dir and Path(model_dir).is_file() and formats != {"bf16"}:
        raise click.BadParameter(f"{model_dir}: a .gguf file is timed with the experts it has; drop --expert-format "
                                 "(it writes GGUF files of a model directory or of the random model)",
                                 param_hint="--model")
    share = _share(hybrid_cpu_share)
    settings = Settings(SHAPES[shape], layers, (), backend=backend, threads=threads, rank=lora_rank,
                        warmup=warmup, steps=steps, gradient_checkpointing=gradient_checkpointing,
                        expert_lora_off=expert_lora_off, baseline=baseline, kernel_seconds=kernel_seconds,
                        expert_formats=tuple(f for f in EXPERT_FORMATS if f in formats), loss_steps=loss_steps,
                        placements=tuple(p.strip() for p in placements.split(",")), stream_ring=stream_ring,
                        stream_activation=stream_activation, gpu_experts_interval=gpu_experts_interval,
                        hybrid_cpu_share=share, rates=rates_path, profile=profile,
                        expert_lora_devices=tuple(d.strip() for d in lora_devices.split(",")))
    try:
        settings.num_gpu_experts = tuple(int(n) for n in num_gpu_experts.split(","))
    except ValueError:
        settings.num_gpu_experts = (-1,)
    if any(n < 0 for n in settings.num_gpu_experts):
        raise click.UsageError(f"--num-gpu-experts {num_gpu_experts}: a comma list of integers >= 0 (0: none)")
    unknown = [p for p in settings.placements if p not in ("cpu", "gpu_stream", "hybrid", "auto")]
    if unknown:
        raise click.UsageError(f"--placement {','.join(unknown)}: bench train runs cpu, gpu_stream, hybrid and auto")
    unknown = [d for d in settings.expert_lora_devices if d not in ("model", "host")]
    if unknown:
        raise click.UsageError(f"--expert-lora-device {','.join(unknown)}: choose model, host or model,host")
    if on_cpu:
        settings.device = torch.device("cpu")
    default_tokens = "64,256" if settings.tiny else "2048,8192"
    try:
        settings.tokens = tuple(int(t) for t in (tokens or default_tokens).split(","))
    except ValueError:
        settings.tokens = ()
    if not settings.tokens or min(settings.tokens) < 1:
        raise click.BadParameter(f"{tokens!r} is not a comma list of positive token counts, e.g. 2048,8192",
                                 param_hint="--tokens")
    if model_dir and baseline and Path(model_dir).is_file():
        raise click.BadParameter(f"{model_dir}: --baseline times transformers on a model directory; drop --baseline "
                                 "for a .gguf file", param_hint="--model")
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    if as_json:
        click.echo(json.dumps({"environment": environment()}))
    else:
        click.echo(format_header(settings))
    profiles = []  # --profile: printed under the table (in --json, each run's row carries its own)
    for row in run(settings, Path(model_dir) if model_dir else None, workdir, keep):
        click.echo(json.dumps(row) if as_json else format_row(row))
        profiles.append(format_profile(row))
        sys.stdout.flush()  # each run as it finishes, also into a pipe (a run cut short keeps what it measured)
    if not as_json and any(profiles):
        click.echo("\n".join(p for p in profiles if p))


@main.command()
@click.option("--workdir", default="runs/demo", show_default=True, type=click.Path(file_okay=False),
              help="where the demo model, data and adapter are written")
@click.option("--frontend", default="trl", show_default=True)
@click.option("--steps", default=None, type=int, help="training steps (default: the demo's own)")
def demo(workdir, frontend, steps):
    """Build a tiny Qwen3-MoE, train LoRA on a synthetic task, and show generations before and after."""
    from .demo import run_demo

    run_demo(workdir, frontend=frontend, steps=steps)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
