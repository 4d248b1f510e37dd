"""`ktcore bench kernels` runs and reports ratios (no timing assertions)."""

import json

from click.testing import CliRunner

from ktcore.commands.cli import main


def test_bench_kernels_reports_every_backend_against_torch():
    result = CliRunner().invoke(main, ["bench", "kernels", "--backend", "torch", "--dtype", "fp32", "--tokens", "2",
                                       "--seconds", "0.01", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["machine"]["dram_read_gbps"] > 0
    (row,) = data["rows"]
    assert row["backend"] == "torch" and row["tokens"] == 2
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    assert row["fwd_speedup_vs_torch"] == 1.0
