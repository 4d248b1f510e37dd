"""The expert-LoRA math the native backends share (ktcore/include/ktcore/expert_lora.hpp, run inside their tasks)
in fp32 against float64 autograd.

The backends' contract checks it only next to their base projections, whose rounding can hide an error of its
own. Here the llamafile backend runs on fp32 weights (exact, no block rounding) that are small next to the LoRA
deltas, so the layer's output and gradients are mostly the LoRA terms; an expert gets no rows, gate_up and down
have different ranks and scales. Tolerances are about 10x the measured error.
"""

import pytest
import torch

from ktcore.config import KTConfig
from ktcore.experts import ExpertLoRA, ExpertWeights
from ktcore.testing import relative_error
from ktcore.testing.contract import dense_reference

E, H, I, TOKENS, TOP_K = 5, 40, 24, 9, 2
TOL_OUT, TOL_GRAD = 2e-6, 1e-5  # worst measured: 2.4e-7 / 1.1e-6


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    base = ExpertWeights(*(torch.randn(*s, generator=g) * 1e-3 for s in ((E, I, H), (E, I, H), (E, H, I))))
    lora = ExpertLoRA(torch.randn(E, 3, H, generator=g) * H ** -0.5, torch.randn(E, 2 * I, 3, generator=g),
                      torch.randn(E, 2, I, generator=g) * I ** -0.5, torch.randn(E, H, 2, generator=g),
                      gate_up_scale=1.75, down_scale=0.5)
    x = torch.randn(TOKENS, H, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:TOP_K] for _ in range(TOKENS)])  # expert E-1: no rows
    w = torch.rand(TOKENS, TOP_K, generator=g)
    return base, lora, x, ids, w, torch.randn(TOKENS, H, generator=g)


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_lora_math_matches_float64_autograd(seed):
    pytest.importorskip("ktcore_llamafile", reason="the native LoRA math runs in a native backend")
    from ktcore_llamafile.backend import LlamafileBackend

    base, lora, x, ids, w, grad_y = _problem(seed)
    backend = LlamafileBackend(KTConfig(kt_backend="llamafile", kt_expert_weight_format="fp32", kt_num_threads=2))
    packed = backend.pack(base)
    y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    gx, gw, grads = backend.backward(packed, ctx, grad_y, lora)

    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    lr = lora.map(lambda t: t.double().requires_grad_(True))
    ref = dense_reference(base, xr, ids, wr, lr)
    ref_grads = torch.autograd.grad(ref, [xr, wr, *lr.tensors()], grad_y.double())
    without_lora = dense_reference(base, x.double(), ids, w.double())
    assert relative_error(without_lora, ref) > 0.9  # the LoRA terms are what this layer computes

    assert relative_error(y, ref) <= TOL_OUT, relative_error(y, ref)
    for name, got, want in zip(("grad_x", "grad_w", "gate_up_a", "gate_up_b", "down_a", "down_b"),
                               (gx, gw, *grads.tensors()), ref_grads):
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert relative_error(got, want) <= TOL_GRAD, f"{name}: {relative_error(got, want):.3g}"
    for g in grads.tensors():  # the expert without rows gets exactly zero
        assert torch.count_nonzero(g[E - 1]) == 0
