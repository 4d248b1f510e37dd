"""`ktcore bench kernels` runs and reports ratios (no timing assertions)."""

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
