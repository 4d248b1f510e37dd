"""Block layouts: our dequantisation equals gguf.quants.dequantize, our quantisers match gguf's (Q4_K: ggml's)."""

import zlib

import numpy as np
import pytest
import torch
from ggml_oracle import ggml_quantize_q4_k, round_trip

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from ktcore_llamafile import blocks as B  # noqa: E402

EXACT = ["f32", "f16", "bf16", "q4_0", "q4_1", "q8_0"]
KQUANTS = ["q4_k", "q5_k", "q6_k"]


def _random_blocks(name, n, rng, edge):
    """Random bytes with valid (finite) fp16 scales; edge: 'random' | 'zeros' | 'max'."""
    elems, nbytes = B.block_info(name)
    if name == "f32":
        vals = rng.standard_normal(n * elems).astype(np.float32)
        if edge == "zeros":
            vals[:] = 0
        elif edge == "max":
            vals[::2] = np.finfo(np.float32).max
            vals[1::2] = -np.finfo(np.float32).max
        return vals.view(np.uint8).reshape(n, nbytes)
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    if edge == "zeros":
        raw[:] = 0
    elif edge == "max":
        raw[:] = 0xFF if name != "q8_0" else 0x80
    half = raw.view(np.uint16) if nbytes % 2 == 0 else None
    fp16 = {"q4_0": [0], "q4_1": [0, 2], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
    big = np.float16(60000.0).view(np.uint16)
    if name == "f16":
        vals = rng.standard_normal(raw.size // 2).astype(np.float16) if edge == "random" else \
            np.full(raw.size // 2, 0 if edge == "zeros" else big, np.uint16).view(np.float16)
        return vals.view(np.uint8).reshape(n, nbytes)
    if name == "bf16":
        vals = rng.standard_normal(raw.size // 2).astype(np.float32).view(np.uint32) >> 16
        if edge == "max":
            vals[:] = 0x7F7F
        elif edge == "zeros":
            vals[:] = 0
        return vals.astype(np.uint16).view(np.uint8).reshape(n, nbytes)
    del half
    for off in fp16.get(name, []):
        scale = rng.standard_normal(n).astype(np.float16) if edge == "random" else \
            np.full(n, 0.0 if edge == "zeros" else 60000.0, np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n, 2)
    return raw


@pytest.mark.parametrize("edge", ["random", "zeros", "max"])
@pytest.mark.parametrize("name", EXACT + KQUANTS)
def test_dequantize_matches_gguf(name, edge):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{edge}".encode()))
    blocks = _random_blocks(name, 64, rng, edge)
    ours = B.dequantize_rows(torch.from_numpy(blocks.copy()), name).numpy()
    ref = dequantize(blocks.reshape(-1), Q[name.upper()]).reshape(ours.shape).astype(np.float32)
    if name in EXACT:
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    else:  # within one ulp of fp32
        np.testing.assert_array_max_ulp(ours, ref, maxulp=1)


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "bf16", "f16", "q4_k"])
@pytest.mark.parametrize("edge", ["random", "zeros", "max", "ties"])
def test_quantisers(name, edge):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    if edge == "zeros":
        x[:] = 0
    elif edge == "max":
        x[:, ::3] = 6.0e4
        x[:, 1::3] = -6.0e4
    elif edge == "ties":  # many equal magnitudes and exact halves
        x = np.round(x * 4) / 4
    ours = B.quantize_rows(torch.from_numpy(x), name).numpy()
    # our blocks dequantise identically with gguf
    back = B.dequantize_rows(torch.from_numpy(ours), name).numpy()
    ref = dequantize(ours.reshape(-1), Q[name.upper()]).reshape(back.shape)
    if name == "q4_k":  # gguf-py has no Q4_K quantiser: ggml's own reference quantiser, bit for bit
        np.testing.assert_array_max_ulp(back, ref.astype(np.float32), maxulp=1)
        assert np.array_equal(ours, ggml_quantize_q4_k(x))
    else:
        assert np.array_equal(back.view(np.uint32), ref.astype(np.float32).view(np.uint32))
        theirs = np.ascontiguousarray(quantize(x, Q[name.upper()])).view(np.uint8).reshape(ours.shape)
        assert np.array_equal(ours, theirs)


def test_q4_k_scales_use_their_whole_range():
    """Q4_K: the super-block scale d is the largest sub-block scale / 63, so that sub-block's 6-bit scale is
    exactly 63 (likewise the mins with dmin); a relative error near 4-bit quantisation's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    b = B.quantize_rows(torch.from_numpy(x), "q4_k").numpy()
    assert b.shape == (16, 144)
    scales, mins = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    assert (scales.max(axis=1) == 63).all() and (mins.max(axis=1) == 63).all()
    back = B.dequantize_rows(torch.from_numpy(b), "q4_k").numpy()
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < 0.1  # measured 0.072


@pytest.mark.parametrize("name", ["f32", "bf16", "q8_0", "q4_k"])
def test_padding_rows_not_a_block_multiple(name):
    """Rows of 37 elements are zero-padded to whole blocks: they come back as gguf's round trip of the padded row
    (f32: exactly the input)."""
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(0))
    back = B.dequantize_rows(B.quantize_rows(x, name), name, 37)
    assert back.shape == (3, 37)
    assert torch.equal(back, x if name == "f32" else round_trip(x, name))


@pytest.mark.parametrize("name", ["q8_0", "q4_k"])
def test_rows_split_over_cores_give_the_same_blocks(name, monkeypatch):
    """quantize_rows over several threads (row ranges) writes exactly the blocks one call writes, the last range
    included (a wrong offset or an off-by-one range would leave rows unwritten or shifted)."""
    w = torch.randn(37, 512, generator=torch.Generator().manual_seed(0))
    whole = B.quantize_rows(w, name)
    monkeypatch.setattr(B, "PARALLEL_ELEMENTS", 512 * 5)  # 7 row ranges of 5-6 rows
    monkeypatch.setattr(B, "usable_cores", lambda: 7)
    assert torch.equal(B.quantize_rows(w, name), whole)
