"""``ExpertBackendContract``: the pytest suite every expert backend must pass.

Subclass it in your backend's tests and set ``backend_name`` (and tolerances for reduced precision)::

    from ktcore.testing import ExpertBackendContract

    class TestMyBackend(ExpertBackendContract):
        backend_name = "my_backend"
        weight_dtype = torch.bfloat16
        rtol_out, rtol_grad = 4e-3, 4e-3  # about 10x the worst error measured (write it down next to them)

Each test compares the backend with an oracle that does not use the backend: a float64 dense reference (every
expert applied to every token, combined through a [T, E] weight matrix) on ``oracle_weights(weights)``, by
default the very weights handed to ``pack``. A backend that packs into a lossy format overrides
``oracle_weights`` to round them as that format does, with code of its own (e.g. gguf's quantisers), never with
the backend's packing. The comparisons run on the raw backend and through ``ExpertLayer``, the autograd
boundary models call, with LoRA on gate_up and down of different ranks and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ..experts import ActivationBudget, ExpertLayer, ExpertLoRA, ExpertWeights, activation_function, can_unpack
from ..experts.int8 import Int8Experts


@dataclass(frozen=True)
class Case:
    num_experts: int
    hidden: int
    inter: int
    tokens: int
    top_k: int
    rank: int = 4  # gate_up LoRA rank
    down_rank: int = 6  # down LoRA rank: different, so that a mix-up of the two LoRAs shows
    unrouted: int = 0  # tokens whose slots all point at no expert
    label: str = ""


CASES = [
    Case(8, 64, 32, 24, 2, label="regular"),
    Case(3, 37, 23, 9, 1, label="odd-sizes-E3-K1"),
    Case(5, 40, 24, 7, 2, unrouted=2, label="unrouted-tokens"),
    Case(16, 48, 40, 3, 2, label="sparse-hits"),  # most experts get 0 or 1 token
    Case(4, 32, 16, 1, 2, label="one-token"),
]

LORA_GRADS = ("gate_up_a", "gate_up_b", "down_a", "down_b")


def dense_reference(weights: ExpertWeights, x, topk_ids, topk_weights, lora: ExpertLoRA | None = None,
                    activation: str = "silu"):
    """y in float64: every expert on every token, mixed by a [T, E] combine matrix. Differentiable."""
    num_experts = weights.num_experts
    combine = torch.zeros(x.shape[0], num_experts, dtype=torch.float64)
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    safe_ids = topk_ids.clamp(0, num_experts - 1)
    combine = combine.scatter_add(1, safe_ids, torch.where(valid, topk_weights, torch.zeros_like(topk_weights)))
    gate, up, down = (t.double() for t in (weights.gate, weights.up, weights.down))
    act = activation_function(activation)
    y = torch.zeros_like(x)
    for e in range(num_experts):
        g, u = x @ gate[e].T, x @ up[e].T
        if lora is not None and lora.gate_up_a is not None:
            delta = lora.gate_up_scale * ((x @ lora.gate_up_a[e].T) @ lora.gate_up_b[e].T)
            g, u = g + delta[:, : gate.shape[1]], u + delta[:, gate.shape[1]:]
        h = act(g) * u
        out = h @ down[e].T
        if lora is not None and lora.down_a is not None:
            out = out + lora.down_scale * ((h @ lora.down_a[e].T) @ lora.down_b[e].T)
        y = y + combine[:, e: e + 1] * out
    return y


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


class ExpertBackendContract:
    """Base class; pytest collects the ``test_*`` methods of subclasses named ``Test*``."""

    backend_name: str = "torch"
    weight_dtype: torch.dtype = torch.float32
    input_dtype: torch.dtype = torch.float32
    rtol_out: float = 1e-6
    rtol_grad: float = 1e-6
    activation: str = "silu"
    kt_config: dict = {}

    # -- hooks for subclasses ------------------------------------------------------------------------
    def make_backend(self, **kt):
        from .. import get_backend

        return get_backend(self.backend_name, {"kt_backend": self.backend_name, **self.kt_config, **kt},
                           need_backward=True, need_lora=True)

    def oracle_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """The dense weights the backend's packed format stands for, computed without the backend."""
        return weights

    # -- helpers ---------------------------------------------------------------------------------------
    def problem(self, case: Case, seed: int = 0, lora: bool = True):
        g = torch.Generator().manual_seed(seed)
        e, h, i, t, k, r = case.num_experts, case.hidden, case.inter, case.tokens, case.top_k, case.rank
        rd = case.down_rank

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale)

        weights = ExpertWeights(rnd(e, i, h, scale=h ** -0.5).to(self.weight_dtype),
                                rnd(e, i, h, scale=h ** -0.5).to(self.weight_dtype),
                                rnd(e, h, i, scale=i ** -0.5).to(self.weight_dtype))
        x = rnd(t, h).to(self.input_dtype)
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        if case.unrouted:
            ids[: case.unrouted] = e  # transformers' expert-parallel sentinel: no expert
        w = torch.rand(t, k, generator=g).to(torch.float32)
        ad = None
        if lora:
            ad = ExpertLoRA(rnd(e, r, h, scale=h ** -0.5), rnd(e, 2 * i, r, scale=0.5),
                            rnd(e, rd, i, scale=i ** -0.5), rnd(e, h, rd, scale=0.5),
                            gate_up_scale=0.75, down_scale=1.5)
        return weights, x, ids, w, ad

    def reference(self, weights, x, ids, w, lora, grad_y):
        xr = x.double().requires_grad_(True)
        wr = w.double().requires_grad_(True)
        lr = lora.map(lambda t: t.double().requires_grad_(True)) if lora else None
        y = dense_reference(self.oracle_weights(weights), xr, ids, wr, lr, self.activation)
        leaves = [xr, wr] + ([t for t in lr.tensors() if t is not None] if lr else [])
        grads = torch.autograd.grad(y, leaves, grad_y.double())
        return y.detach(), grads[0], grads[1], list(grads[2:])

    def run_backend(self, backend, weights, x, ids, w, lora, grad_y):
        packed = backend.pack(weights, activation=self.activation)
        y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
        gx, gw, lg = backend.backward(packed, ctx, grad_y, lora)
        return y, gx, gw, [t for t in lg.tensors() if t is not None]

    def assert_matches_reference(self, got, want, x, w, lora_names=LORA_GRADS):
        """got/want: (y, grad_x, grad_topk_weights, [LoRA grads]) of the backend and of ``reference``."""
        (y, gx, gw, lg), (ry, rgx, rgw, rlg) = got, want
        assert y.shape == x.shape and y.dtype == x.dtype and gw.shape == w.shape
        assert relative_error(y, ry) <= self.rtol_out, f"forward: {relative_error(y, ry):.3g}"
        assert relative_error(gx, rgx) <= self.rtol_grad, f"input grad: {relative_error(gx, rgx):.3g}"
        assert relative_error(gw, rgw) <= self.rtol_grad, f"routing-weight grad: {relative_error(gw, rgw):.3g}"
        assert len(lg) == len(rlg) == len(lora_names)
        for name, g, want_g in zip(lora_names, lg, rlg):
            assert g.shape == want_g.shape, name
            assert relative_error(g, want_g) <= self.rtol_grad, f"LoRA {name} grad: {relative_error(g, want_g):.3g}"

    # -- the contract ------------------------------------------------------------------------------------
    @pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
    @pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
    def test_matches_float64_reference(self, case, with_lora):
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(case, lora=with_lora)
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(self.input_dtype)
        got = self.run_backend(backend, weights, x, ids, w, lora, grad_y)
        want = self.reference(weights, x, ids, w, lora, grad_y)
        self.assert_matches_reference(got, want, x, w, LORA_GRADS if with_lora else ())

    @pytest.mark.parametrize("cpu_activation", ["retain", "recompute"])
    def test_expert_layer_autograd_matches_float64_reference(self, cpu_activation):
        """Through ``ExpertLayer`` (what the model calls; ``torch.autograd`` drives backward), LoRA on gate_up and
        down with different ranks and scales: the layer must hand each LoRA its own scale."""
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(CASES[0], seed=3)
        budget = ActivationBudget(1)
        layer = ExpertLayer(backend, backend.pack(weights, self.activation), budget, cpu_activation)
        leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
        lora_leaves = lora.map(lambda t: t.clone().requires_grad_(True))
        y = layer(leaves[0], ids, leaves[1], lora_leaves)
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(self.input_dtype)
        gx, gw, *lg = torch.autograd.grad(y, leaves + list(lora_leaves.tensors()), grad_y)
        assert budget.in_use == 0  # the saved context was consumed (retain) or never taken (recompute)
        self.assert_matches_reference((y.detach(), gx, gw, lg), self.reference(weights, x, ids, w, lora, grad_y), x, w)

    def test_unrouted_tokens_get_zero(self):
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(CASES[2])
        y, ctx = backend.forward(backend.pack(weights, self.activation), x, ids, w, lora, save=True)
        assert torch.count_nonzero(y[: CASES[2].unrouted]) == 0

    @pytest.mark.parametrize("part", ["gate_up", "down"])
    def test_lora_on_one_projection(self, part):
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(CASES[0])
        if part == "gate_up":
            lora.down_a = lora.down_b = None
        else:
            lora.gate_up_a = lora.gate_up_b = None
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(self.input_dtype)
        got = self.run_backend(backend, weights, x, ids, w, lora, grad_y)
        want = self.reference(weights, x, ids, w, lora, grad_y)
        self.assert_matches_reference(got, want, x, w, (f"{part}_a", f"{part}_b"))

    def test_forward_without_save_matches(self):
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(CASES[0])
        packed = backend.pack(weights, self.activation)
        y1, ctx1 = backend.forward(packed, x, ids, w, lora, save=False)
        y2, ctx2 = backend.forward(packed, x, ids, w, lora, save=True)
        assert ctx1 is None and ctx2 is not None
        torch.testing.assert_close(y1, y2, rtol=0, atol=0)

    def test_async_matches_sync(self):
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(CASES[0])
        packed = backend.pack(weights, self.activation)
        y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
        ya, ctxa = backend.wait(backend.submit_forward(packed, x, ids, w, lora, True))
        torch.testing.assert_close(ya, y, rtol=0, atol=0)
        grad_y = torch.ones_like(x)
        g1 = backend.backward(packed, ctx, grad_y, lora)
        g2 = backend.wait(backend.submit_backward(packed, ctxa, grad_y, lora))
        torch.testing.assert_close(g2[0], g1[0], rtol=0, atol=0)
        torch.testing.assert_close(g2[1], g1[1], rtol=0, atol=0)

    def test_interleaved_layers_are_repeatable(self):
        """Two layers called in turn, several outstanding contexts: results do not depend on call order."""
        backend = self.make_backend()
        layers = [self.problem(CASES[0], seed=s) for s in (10, 11)]
        packs = [backend.pack(lw[0], self.activation) for lw in layers]
        first = [backend.forward(p, *lw[1:], save=True) for p, lw in zip(packs, layers)]
        again = [backend.forward(p, *lw[1:], save=True) for p, lw in zip(reversed(packs), reversed(layers))][::-1]
        for (y1, _), (y2, _) in zip(first, again):
            torch.testing.assert_close(y1, y2, rtol=0, atol=0)
        grad_y = torch.ones_like(layers[0][1])
        b_late = [backend.backward(p, ctx, grad_y, lw[4]) for p, (_, ctx), lw in zip(packs, again, layers)]
        b_early = [backend.backward(p, ctx, grad_y, lw[4]) for p, (_, ctx), lw in zip(packs, first, layers)]
        for g1, g2 in zip(b_early, b_late):
            torch.testing.assert_close(g1[0], g2[0], rtol=0, atol=0)

    def test_same_inputs_give_the_same_bits(self):
        """Two calls on the same inputs: identical outputs and gradients, expert LoRA's included. A backend that adds
        up partial sums (of LoRA gradients, say) in the order its threads happen to finish fails this."""
        backend = self.make_backend()
        weights, x, ids, w, lora = self.problem(Case(4, 64, 48, 160, 2, rank=8, label="busy-experts"))
        grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).to(self.input_dtype)
        packed = backend.pack(weights, self.activation)
        runs = []
        for _ in range(2):
            y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
            gx, gw, lg = backend.backward(packed, ctx, grad_y, lora)
            runs.append([y, gx, gw, *(t for t in lg.tensors() if t is not None)])
        assert len(runs[0]) == 7
        for first, second in zip(*runs):
            torch.testing.assert_close(second, first, rtol=0, atol=0)

    def test_unpack_gives_the_weights_it_computes_with(self):
        """``unpack`` (``kt_num_gpu_experts`` copies resident experts from it) returns the experts asked for, in that
        order, as the weights the packed format stands for (``oracle_weights``), bit for bit. A transposed tile,
        padding taken for data, or another expert's rows or scales would each fail. A backend without it (it is
        optional) must be refused by ``kt_num_gpu_experts`` before anything loads."""
        from ..errors import ConfigError
        from ..model.resident import check_unpack

        backend = self.make_backend()
        if not can_unpack(backend):
            with pytest.raises(ConfigError, match="kt_num_gpu_experts needs a backend that unpacks"):
                check_unpack(type(backend), self.backend_name, "a layer")
            return
        weights = self.problem(Case(5, 70, 40, 1, 1, label="padded"))[0]
        want = self.oracle_weights(weights)
        packed = backend.pack(weights, self.activation)
        for ids in (torch.tensor([3, 0, 4]), None):
            got = backend.unpack(packed, ids)
            if isinstance(got, Int8Experts):
                got = got.dequantize(torch.float32)
            for name in ("gate", "up", "down"):
                expected = getattr(want, name) if ids is None else getattr(want, name)[ids]
                torch.testing.assert_close(getattr(got, name).float(), expected.float(), rtol=0, atol=0,
                                           msg=lambda m: f"{name}, ids {ids}: {m}")
