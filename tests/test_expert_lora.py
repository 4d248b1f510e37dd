"""The expert-LoRA math the native backends share (fp32 torch between their C++ phases) against float64 autograd.

The backends' contract runs it only under their own rounding (bf16 activations, quantised weights), which can
hide an error of its own; here it is alone, in fp32, at about 10x the measured error. To test another
implementation of the same math, point ``lora_forward`` / ``lora_backward`` below at it.
"""

import pytest
import torch

from ktcore.experts.lora_math import lora_backward, lora_forward
from ktcore.testing import relative_error

E, IN, OUT, RANK, TOKENS = 5, 24, 40, 3, 9
SCALE = 1.75
TOL = 2e-6  # worst measured: 1.7e-7


def _problem(seed, with_rows):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 5, 1, 4])  # expert 1 has no rows
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    rows_n = int(offsets[-1])
    x = torch.randn(TOKENS if with_rows else rows_n, IN, generator=g)
    rows = torch.randint(0, TOKENS, (rows_n,), generator=g, dtype=torch.int32) if with_rows else None
    a = torch.randn(E, RANK, IN, generator=g) * IN ** -0.5
    b = torch.randn(E, OUT, RANK, generator=g)
    grad = torch.randn(rows_n, OUT, generator=g)
    row_weight = torch.rand(rows_n, generator=g)
    return x, rows, offsets, a, b, grad, row_weight


def _reference(x, rows, offsets, a, b, grad, row_weight):
    """float64 autograd: out[r] = SCALE * B_e A_e x_r for the rows r of expert e; the input gradient per row
    without the row weight, the factor gradients with it (as lora_backward documents)."""
    xr = (x if rows is None else x[rows.long()]).double().requires_grad_(True)
    ad, bd = a.double().requires_grad_(True), b.double().requires_grad_(True)
    expert = torch.repeat_interleave(torch.arange(E), offsets.diff())
    out = SCALE * torch.bmm(bd[expert], torch.bmm(ad[expert], xr.unsqueeze(2))).squeeze(2)
    (gx,) = torch.autograd.grad(out, xr, grad.double(), retain_graph=True)
    weighted = grad.double() if row_weight is None else grad.double() * row_weight.double().unsqueeze(1)
    da, db = torch.autograd.grad(out, [ad, bd], weighted)
    return out.detach(), gx, da, db


@pytest.mark.parametrize("with_rows", [True, False], ids=["gathered-rows", "row-per-input"])
@pytest.mark.parametrize("weighted", [True, False], ids=["row-weight", "no-row-weight"])
def test_lora_math_matches_float64_autograd(with_rows, weighted):
    x, rows, offsets, a, b, grad, row_weight = _problem(seed=int(with_rows) + 2 * int(weighted), with_rows=with_rows)
    row_weight = row_weight if weighted else None
    ref_out, ref_gx, ref_da, ref_db = _reference(x, rows, offsets, a, b, grad, row_weight)
    out = lora_forward(x, rows, offsets, a, b, SCALE)
    gx, da, db = lora_backward(x, rows, grad, offsets, a, b, SCALE, row_weight)
    assert out.dtype == gx.dtype == da.dtype == db.dtype == torch.float32
    for name, got, want in (("out", out, ref_out), ("grad_x", gx, ref_gx), ("grad_a", da, ref_da),
                            ("grad_b", db, ref_db)):
        assert got.shape == want.shape, name
        assert relative_error(got, want) <= TOL, f"{name}: {relative_error(got, want):.3g}"
    assert torch.count_nonzero(da[1]) == torch.count_nonzero(db[1]) == 0  # an expert without rows
