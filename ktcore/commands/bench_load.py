"""``ktcore bench load``: where ``ktcore chat``'s load of the model a YAML names goes, stage by stage.

Each round is a fresh Python process (``python -m ktcore.commands.bench_load``), so the imports count and nothing
stays cached in memory, as for a user's ``ktcore chat``; the figures are medians over the rounds with their
spread, in wall seconds and in the process's CPU seconds (the steadier figure on a shared host: the load is
mostly one thread). For a ``.gguf`` model each round then also loads the same file's tokenizer with transformers'
``AutoTokenizer``, as ktcore did before it picked the tokenizer class from its own parse of the header (to pick
it, AutoTokenizer parses the whole file again), so the tokenizer stage is compared with it in the same process.
Nothing here asserts a time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

STAGES = {  # key -> what the figure covers
    "imports": "import torch and transformers",
    "checks": "config, model path and backend checks; a GGUF file's header parsed once",
    "tokenizer": "the tokenizer (a GGUF file's: its class from ktcore's config of the header)",
    "model": "the model, routed experts (or MLPs) packed into the CPU backend",
    "adapter": "the adapter named by adapter_name_or_path",
    "total": "all of the above: what ktcore chat takes before its first token",
    "autotokenizer": "reference: AutoTokenizer.from_pretrained(folder, gguf_file=...) on the same file",
}


def one_round(config_path: str, overrides: list[str]) -> dict:
    """The seconds of each stage of one load, in this process (run it in a fresh one)."""
    started = _now()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from ..config import load_config, resolve_model_path
    from ..weights.model_path import is_gguf
    from .chat import load_for_chat

    marks = [("checks", _now())]  # (the stage beginning here, (wall, cpu) then)
    cfg = load_config(config_path, overrides, quiet=True)
    load_for_chat(cfg, stage=lambda key, text: marks.append((key, _now())))
    seconds = {"imports": _since(started, marks[0][1])}
    for (key, at), (_, until) in zip(marks, marks[1:]):  # the last mark is "ready"
        seconds[key] = _since(at, until)
    seconds["total"] = _since(started, marks[-1][1])
    path = resolve_model_path(cfg)
    if is_gguf(path):
        from transformers import AutoTokenizer

        begun = _now()
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        seconds["autotokenizer"] = _since(begun, _now())
    return seconds


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float], end: tuple[float, float]) -> list[float]:
    return [end[0] - start[0], end[1] - start[1]]


def run(config_path: str, overrides: list[str], rounds: int) -> dict:
    """``rounds`` loads, each in a fresh process: per stage and clock (wall, cpu) the median and the spread
    (max - min) / median."""
    samples: dict[str, list[list[float]]] = {}
    for _ in range(rounds):
        proc = subprocess.run([sys.executable, "-m", "ktcore.commands.bench_load", config_path, *overrides],
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"ktcore bench load: the load failed: {proc.stderr.strip().splitlines()[-1:]}")
        for key, value in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            samples.setdefault(key, []).append(value)
    result = {"config": config_path, "rounds": rounds, "stages": {}}
    for key in STAGES:
        if key in samples:
            result["stages"][key] = row = {}
            for index, clock in enumerate(("wall", "cpu")):
                values = [sample[index] for sample in samples[key]]
                median = statistics.median(values)
                row[f"{clock}_s"] = median
                row[f"{clock}_spread_pct"] = 100 * (max(values) - min(values)) / median if median else 0.0
    return result


def format_table(result: dict) -> str:
    stages = result["stages"]
    lines = [f"{result['config']}: median of {result['rounds']} loads, each in a fresh process", "",
             "| stage | wall s | spread % | CPU s | spread % | what |", "|---|---:|---:|---:|---:|---|"]
    for key, row in stages.items():
        lines.append(f"| {key} | {row['wall_s']:.2f} | {row['wall_spread_pct']:.0f} | {row['cpu_s']:.2f} | "
                     f"{row['cpu_spread_pct']:.0f} | {STAGES[key]} |")
    if "autotokenizer" in stages and stages["tokenizer"]["cpu_s"] > 0:
        ratios = [stages["autotokenizer"][k] / stages["tokenizer"][k] for k in ("wall_s", "cpu_s")]
        lines += ["", f"tokenizer: AutoTokenizer / ktcore = {ratios[0]:.1f}x wall, {ratios[1]:.1f}x CPU"]
    return "\n".join(lines)


if __name__ == "__main__":  # one round, for run(): python -m ktcore.commands.bench_load CONFIG [KEY=VALUE ...]
    print(json.dumps(one_round(sys.argv[1], sys.argv[2:])))
