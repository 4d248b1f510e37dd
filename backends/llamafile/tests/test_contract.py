"""ExpertBackendContract for every block type, against the float64 reference on the weights quantised and
dequantised by gguf's (and, for Q4_K, ggml's) own code, never by the backend's."""

import numpy as np
import pytest
import torch
from ggml_oracle import round_trip

from ktcore.config import KTConfig
from ktcore.experts import ExpertWeights
from ktcore.testing import ExpertBackendContract
from ktcore.testing.contract import relative_error

from ktcore_llamafile import blocks as B


class _Quantised(ExpertBackendContract):
    """Tolerances: about 10x the worst relative error measured over the contract on this format (forward / grads,
    AVX2, int16 activations), noted beside them."""

    backend_name = "llamafile"
    fmt = "q8_0"
    isa = None

    @property
    def kt_config(self):
        return {"kt_expert_weight_format": self.fmt, "kt_num_threads": 2}

    def make_backend(self, **kt):
        from ktcore_llamafile.backend import LlamafileBackend

        return LlamafileBackend(KTConfig(**{"kt_backend": "llamafile", **self.kt_config, **kt}), isa=self.isa)

    def oracle_weights(self, weights):
        return ExpertWeights(*(round_trip(t, self.fmt) for t in (weights.gate, weights.up, weights.down)))


class TestQ8_0(_Quantised):
    fmt = "q8_0"
    rtol_out, rtol_grad = 5e-4, 1e-3  # measured 4.4e-5 / 9.6e-5


class TestQ4_0(_Quantised):
    fmt = "q4_0"
    rtol_out, rtol_grad = 5e-4, 8e-4  # measured 4.7e-5 / 7.2e-5


class TestQ4_1(_Quantised):
    fmt = "q4_1"
    rtol_out, rtol_grad = 5e-4, 1e-3  # measured 4.9e-5 / 8.4e-5


class TestQ4_K(_Quantised):
    fmt = "q4_k"
    rtol_out, rtol_grad = 5e-4, 5e-4  # measured 4.4e-5 / 4.9e-5


class TestBF16(_Quantised):
    fmt = "bf16"
    rtol_out, rtol_grad = 2e-6, 5e-6  # measured 1.8e-7 / 4.5e-7 (fp32 math on exact bf16 weights)


class TestF32(_Quantised):
    fmt = "fp32"
    rtol_out, rtol_grad = 2e-6, 1e-5  # measured 1.7e-7 / 8.7e-7


class TestQ8_0Scalar(_Quantised):
    fmt = "q8_0"
    isa = "scalar"
    rtol_out, rtol_grad = 5e-4, 1e-3  # measured 4.4e-5 / 9.6e-5 (bit for bit AVX2's)


def _vector_isas():
    from ktcore_llamafile._ext import cpu_has

    return [isa for isa in ("avx2", "vnni") if cpu_has(isa)]


def _pair(fmt, seed=0, tokens=24, activations="q16"):
    from ktcore_llamafile.backend import LlamafileBackend
    from ktcore.testing.contract import Case

    case = Case(8, 512, 256, tokens, 2)
    t = ExpertBackendContract()
    weights, x, ids, w, lora = t.problem(case, seed=seed)
    out = {}
    for isa in ("scalar", *_vector_isas()):
        be = LlamafileBackend(KTConfig(kt_expert_weight_format=fmt, kt_num_threads=2), isa=isa,
                              activations=activations)
        packed = be.pack(weights)
        y, ctx = be.forward(packed, x, ids, w, lora, save=True)
        gx, gw, lg = be.backward(packed, ctx, torch.ones_like(x), lora)
        out[isa] = (y, gx, gw, *[g for g in lg.tensors() if g is not None])
    return out


@pytest.mark.skipif(not __import__("ktcore_llamafile._ext", fromlist=["x"]).cpu_has("avx2"), reason="no AVX2")
@pytest.mark.parametrize("activations", ["q16", "q8"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "bf16", "f16", "fp32"])
def test_vector_and_scalar_paths_agree_bitwise(fmt, activations):
    """AVX2 and (where the CPU has it) AVX-512 VNNI against the scalar path."""
    out = _pair(fmt, activations=activations)
    for isa in _vector_isas():
        for a, b in zip(out["scalar"], out[isa]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_isa_switch(monkeypatch):
    from ktcore_llamafile.backend import LlamafileBackend

    monkeypatch.setenv("KTCORE_LLAMAFILE_ISA", "scalar")
    assert LlamafileBackend(KTConfig()).isa == "scalar"
    monkeypatch.delenv("KTCORE_LLAMAFILE_ISA")
    assert LlamafileBackend(KTConfig()).isa in ("avx2", "avx512vnni")
    with pytest.raises(ValueError):
        LlamafileBackend(KTConfig(), isa="sse9")


def _gguf_dequantized(gate, up, down, types, hidden, inter) -> ExpertWeights:
    """Raw expert blocks (uint8 [E, rows, row_bytes]) decoded by gguf's own dequantiser."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    def decode(blocks, fmt, k):
        rows = dequantize(blocks.numpy().reshape(-1), Q[fmt.upper()]).reshape(*blocks.shape[:2], -1)
        return torch.from_numpy(rows[..., :k].copy())

    return ExpertWeights(decode(gate, types[0], hidden), decode(up, types[1], hidden), decode(down, types[2], inter))


def test_pack_blocks_refuses_float_rows_that_are_no_whole_blocks():
    """A GGUF file keeps float rows unpadded; the kernels read whole 32-element blocks. 8 experts of 24-element
    F32 rows are as many bytes as 6 padded ones: refused, not packed as 6 experts."""
    from ktcore_llamafile.backend import LlamafileBackend

    E, H, I = 8, 24, 32
    be = LlamafileBackend(KTConfig(kt_num_threads=1))
    gate, up, down = (np.zeros((E, n, k), dtype=np.float32) for n, k in ((I, H), (I, H), (H, I)))
    with pytest.raises(ValueError, match="rows of 96 bytes, where 24 f32 elements padded to whole blocks take 128"):
        be.pack_blocks(gate, up, down, "f32", H, I)


def test_pack_blocks_from_raw_gguf_blocks_q5_k_q6_k():
    """Experts given as raw blocks (Q5_K gate/up, Q6_K down, as in a Q5_K_M file) run without dequantising."""
    from ktcore_llamafile.backend import LlamafileBackend
    from ktcore.testing.contract import dense_reference

    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 4, 256, 512, 6, 2
    rb = lambda k, t: B.row_bytes(k, t)  # noqa: E731
    raw = lambda n, k, t: torch.randint(0, 256, (E, n, rb(k, t)), generator=g, dtype=torch.uint8)  # noqa: E731
    gate, up, down = raw(I, H, "q5_k"), raw(I, H, "q5_k"), raw(H, I, "q6_k")
    for arr, t, off in ((gate, "q5_k", (0, 2)), (up, "q5_k", (0, 2)), (down, "q6_k", (208,))):
        elems, nbytes = B.block_info(t)
        blocks = arr.view(-1, nbytes)
        for o in off:  # small finite fp16 scales
            scale = (torch.rand(blocks.shape[0], generator=g) * 1e-3).half().view(torch.uint8).view(-1, 2)
            blocks[:, o:o + 2] = scale
    be = LlamafileBackend(KTConfig(kt_num_threads=2))
    packed = be.pack_blocks(gate.numpy(), up.numpy(), down.numpy(), ("q5_k", "q5_k", "q6_k"), H, I)
    assert packed.gate.blocks.data_ptr() == gate.data_ptr()  # zero-copy
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    y, ctx = be.forward(packed, x, ids, w, save=True)
    dense = _gguf_dequantized(gate, up, down, ("q5_k", "q5_k", "q6_k"), H, I)
    ref = dense_reference(dense, x.double(), ids, w.double())
    assert relative_error(y, ref) < 3e-4  # measured 3.2e-5
    gx, gw, _ = be.backward(packed, ctx, torch.ones_like(x))
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    yr = dense_reference(dense, xr, ids, wr)
    rgx, rgw = torch.autograd.grad(yr, [xr, wr], torch.ones_like(yr))
    assert relative_error(gx, rgx) < 2e-4 and relative_error(gw, rgw) < 3e-4  # measured 1.2e-5, 2.5e-5


def test_unsupported_format_is_explained():
    from ktcore_llamafile.backend import LlamafileBackend
    from ktcore.experts import ExpertWeights

    be = LlamafileBackend(KTConfig(kt_expert_weight_format="q6_k"))
    with pytest.raises(ValueError, match="read from GGUF files"):
        be.pack(ExpertWeights(torch.zeros(1, 32, 32), torch.zeros(1, 32, 32), torch.zeros(1, 32, 32)))


def test_two_activation_planes_are_far_more_accurate_than_one(monkeypatch):
    """activations="q16" (default: one int16 plane; "q8x2" its former name) vs "q8" (ggml's single Q8 plane)."""
    from ktcore_llamafile.backend import LlamafileBackend
    from ktcore.testing.contract import Case, dense_reference

    weights, x, ids, w, _ = ExpertBackendContract().problem(Case(8, 512, 256, 16, 2), seed=1)
    oracle = ExpertWeights(*(round_trip(t, "q4_1") for t in (weights.gate, weights.up, weights.down)))
    errs = {}
    for mode in ("q8", "q16"):
        be = LlamafileBackend(KTConfig(kt_expert_weight_format="q4_1", kt_num_threads=2), activations=mode)
        ref = dense_reference(oracle, x.double(), ids, w.double())
        errs[mode] = relative_error(be.forward(be.pack(weights), x, ids, w)[0], ref)
    assert errs["q16"] < 5e-4 and errs["q8"] < 0.1 and errs["q16"] < errs["q8"] / 30, errs  # 4.6e-5, 1.1e-2
    monkeypatch.setenv("KTCORE_LLAMAFILE_ACT", "q8")
    assert LlamafileBackend(KTConfig()).activations == "q8"
    monkeypatch.setenv("KTCORE_LLAMAFILE_ACT", "q8x2")
    assert LlamafileBackend(KTConfig()).activations == "q16"
    with pytest.raises(ValueError):
        LlamafileBackend(KTConfig(), activations="int4")


@pytest.mark.skipif(not __import__("ktcore_llamafile._ext", fromlist=["x"]).cpu_has("avx2"), reason="no AVX2")
@pytest.mark.parametrize("activations", ["q16", "q8"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"])
def test_in_place_row_kernels_match_scalar_on_raw_blocks(fmt, activations):
    """AVX2 kernels on raw blocks, bit for bit the scalar path, on random raw blocks (every scale/min bit
    pattern) and every row- and token-tile remainder: q8 dots Q8_0/Q4_0/Q4_1/Q4_K blocks in place (no unpacked
    scratch row); q16 expands rows to int16 (vectorised for those four types) and runs 4x2 register tiles."""
    from ktcore_llamafile.backend import LlamafileBackend

    g = torch.Generator().manual_seed(3)
    E, H, I = 3, 512, 203  # I: row-tile remainders (16-row tasks, 4-row tiles), odd chunk counts
    elems, nbytes = B.block_info(fmt)
    offs = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[fmt]

    def raw(n, k):
        arr = torch.randint(0, 256, (E, n, B.row_bytes(k, fmt)), generator=g, dtype=torch.uint8)
        blocks = arr.view(-1, nbytes)
        for o in offs:
            blocks[:, o:o + 2] = (torch.randn(blocks.shape[0], generator=g) * 1e-2).half().view(torch.uint8).view(-1, 2)
        return arr

    gate, up, down = raw(I, H), raw(I, H), raw(H, I)
    for T in (1, 2, 3, 5, 40):
        x = torch.randn(T, H, generator=g)
        ids = torch.rand(T, E, generator=g).topk(2, dim=1).indices
        w = torch.rand(T, 2, generator=g)
        ys = []
        for isa in ("scalar", *_vector_isas()):
            be = LlamafileBackend(KTConfig(kt_num_threads=2), isa=isa, activations=activations)
            ys.append(be.forward(be.pack_blocks(gate, up, down, fmt, H, I), x, ids, w)[0])
        for y in ys[1:]:
            torch.testing.assert_close(ys[0], y, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ["scalar", "auto"])
@pytest.mark.parametrize("types", [("q4_k",) * 3, ("q8_0",) * 3, ("q5_k", "q5_k", "q6_k"), ("q4_k", "q8_0", "q4_1")])
def test_fused_forward_equals_phased_forward(types, isa):
    """With SiLU, q16 activations and quantised blocks the forward runs as one C++ call (Engine.forward16); the
    other configurations run phase by phase (a C++ call per projection, each with its expert LoRA). The two must
    agree bit for bit, with expert LoRA and without: forward, the saved activations and backward, for decode
    (in-place row kernels) and prefill row counts."""
    from ktcore.experts import ExpertLoRA
    from ktcore_llamafile.backend import LlamafileBackend

    g = torch.Generator().manual_seed(5)
    E, H, I, K = 5, 512, 203, 2  # I: a partial 32-column tile, down's rows padded to whole blocks

    def raw(n, k, fmt):
        arr = torch.randint(0, 256, (E, n, B.row_bytes(k, fmt)), generator=g, dtype=torch.uint8)
        blocks = arr.view(-1, B.block_info(fmt)[1])
        for o in {"q4_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}.get(fmt, (0,)):
            blocks[:, o:o + 2] = (torch.randn(blocks.shape[0], generator=g) * 1e-2).half().view(torch.uint8).view(-1, 2)
        return arr

    be = LlamafileBackend(KTConfig(kt_num_threads=2), isa=isa)
    packed = be.pack_blocks(raw(I, H, types[0]), raw(I, H, types[1]), raw(H, I, types[2]), types, H, I)
    assert packed.native_layer is not None
    r = 3
    lora = ExpertLoRA(torch.randn(E, r, H, generator=g) * H ** -0.5, torch.randn(E, 2 * I, r, generator=g) * 0.1,
                      torch.randn(E, r, I, generator=g) * I ** -0.5, torch.randn(E, H, r, generator=g) * 0.1, 0.5, 2.0)
    for T in (1, 3, 40):
        x = torch.randn(T, H, generator=g)
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
        ids[0, 1] = -1  # a dropped slot
        w = torch.rand(T, K, generator=g)
        gy = torch.randn(T, H, generator=g)
        for ad in (None, lora):
            fused, ctx_f = be.forward(packed, x, ids, w, ad, save=True)
            phased, ctx_p = be._forward_phased(packed, x, ids, w, ad, save=True)
            torch.testing.assert_close(fused, phased, rtol=0, atol=0)
            torch.testing.assert_close(be.forward(packed, x, ids, w, ad)[0], fused, rtol=0, atol=0)  # no saving
            for name in ("g", "u", "h", "out", "ax", "ah"):
                a, b = getattr(ctx_f, name), getattr(ctx_p, name)
                assert (a is None) == (b is None) == (ad is None and name in ("ax", "ah")), name
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
            gf, gp = be.backward(packed, ctx_f, gy, ad), be.backward(packed, ctx_p, gy, ad)
            for a, b in zip(gf[:2] + gf[2].tensors(), gp[:2] + gp[2].tensors()):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ["scalar", "auto"])
def test_lora_gradients_do_not_depend_on_the_thread_count(isa):
    """1, 2 and 3 threads, bit for bit: output, grad_x, router-weight grads and every LoRA gradient. Each backward
    task writes its expert's LoRA gradients on a piece of the columns; here the pieces are 256 columns whatever the
    threads (and the shared routine's bits do not depend on the pieces, tests/test_expert_lora_leaves.py), so this
    fails where a change makes the pieces or any sum follow the thread count in a way that moves bits, as amx_bf16's
    share of columns did with the shared outer under its own compiler flags."""
    from ktcore.experts import ExpertLoRA
    from ktcore_llamafile.backend import LlamafileBackend

    g = torch.Generator().manual_seed(11)
    E, H, I, K, T, r = 4, 256, 200, 2, 60, 3
    types = ("q8_0",) * 3
    gate, up, down = (torch.randint(0, 256, (E, n, B.row_bytes(k, "q8_0")), generator=g, dtype=torch.uint8)
                      for n, k in ((I, H), (I, H), (H, I)))
    for arr in (gate, up, down):  # small finite fp16 scales
        blocks = arr.view(-1, B.block_info("q8_0")[1])
        blocks[:, 0:2] = (torch.randn(blocks.shape[0], generator=g) * 1e-2).half().view(torch.uint8).view(-1, 2)
    lora = ExpertLoRA(torch.randn(E, r, H, generator=g) * H ** -0.5, torch.randn(E, 2 * I, r, generator=g) * 0.1,
                      torch.randn(E, r, I, generator=g) * I ** -0.5, torch.randn(E, H, r, generator=g) * 0.1, 0.5, 2.0)
    x, gy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    runs = []
    for threads in (1, 2, 3):
        be = LlamafileBackend(KTConfig(kt_num_threads=threads), isa=isa)
        packed = be.pack_blocks(gate, up, down, types, H, I)
        y, ctx = be.forward(packed, x, ids, w, lora, save=True)
        gx, gw, gl = be.backward(packed, ctx, gy, lora)
        runs.append([y, gx, gw, *gl.tensors()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
