"""`ktcore bench kernels` runs and reports ratios (no timing assertions)."""

import json

import pytest
from click.testing import CliRunner

from ktcore.commands.cli import main


def test_bench_kernels_reports_every_backend_against_torch():
    pytest.importorskip("ktcore_llamafile", reason="a second backend to compare: pip install -e backends/llamafile")
    result = CliRunner().invoke(main, ["bench", "kernels", "--backend", "torch", "--backend", "llamafile", "--dtype",
                                       "fp32", "--tokens", "2", "--seconds", "0.01", "--json"])
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
