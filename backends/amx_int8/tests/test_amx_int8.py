"""amx_int8 against ktcore's contract suite (two oracles), its quantiser against numpy, determinism, and the kernel
tables against each other.

Oracles. "dequantised": the float64 dense reference on the weights that ``ktcore.experts.int8`` (Python, not the
backend's native quantiser) rounds to int8-sym-channel-v1; what remains is the per-row activation quantisation.
"bf16 budget": the reference on the bf16 weights themselves, within the issue's int8 error budget (output 3e-2,
gradients 5e-2). The VNNI classes skip only on CPUs without AVX-512 VNNI, the AMX classes where this process cannot
use AMX INT8; the portable classes run the same orchestration with plain C++ kernels anywhere.
"""

import numpy as np
import pytest
import torch

from ktcore.config import as_kt_config
from ktcore.experts import ExpertWeights
from ktcore.testing import ExpertBackendContract
from ktcore.testing.contract import Case, relative_error
from ktcore.testing.phases import check_lora_gradients_come_last, check_phase_clock
from ktcore.experts.int8 import Int8Experts

from ktcore_amx_int8 import _ext
from ktcore_amx_int8.backend import AMXInt8Backend

AMX_REASON = _ext.amx_unavailable_reason()
VNNI_REASON = _ext.vnni_unavailable_reason()
needs_amx = pytest.mark.skipif(bool(AMX_REASON), reason=f"this CPU/process cannot use AMX INT8: {AMX_REASON}")
needs_vnni = pytest.mark.skipif(bool(VNNI_REASON), reason=f"no AVX-512 VNNI here: {VNNI_REASON}")
KERNELS = [pytest.param("amx", marks=needs_amx), pytest.param("vnni", marks=needs_vnni), "portable"]
INT8 = {"kt_backend": "amx_int8", "kt_expert_weight_format": "int8"}


def backend(kernels, **kt):
    return AMXInt8Backend(as_kt_config({**INT8, **kt}), kernels=kernels)


class _Int8Contract(ExpertBackendContract):
    backend_name = "amx_int8"
    weight_dtype = torch.bfloat16
    kt_config = {"kt_expert_weight_format": "int8"}
    kernels = "portable"

    def make_backend(self, **kt):
        return backend(self.kernels, **{**self.kt_config, **kt})


class _Dequantised(_Int8Contract):
    # Not tighter than the bf16 budget: what remains against these weights is the per-row int8 rounding of the
    # activations and gradient rows, about 1% (VNNI = portable to the bit, fp32 and bf16 inputs, every contract and
    # EXTRA case): outputs <= 1.2e-2, gradients <= 1.5e-2 but for the routing-weight gradient of T1 (one token, three
    # numbers): 5.2e-2.
    rtol_out = 3e-2
    rtol_grad = 6e-2

    def oracle_weights(self, weights):
        return Int8Experts.quantize(weights).dequantize(torch.float64)


class _BF16Budget(_Int8Contract):
    # issue 22's int8 error budget; measured worst: outputs 1.5e-2, gradients 4.0e-2 (the routing-weight gradient of
    # T1; every other <= 1.8e-2)
    rtol_out = 3e-2
    rtol_grad = 5e-2
    # its oracle is the unquantised weights, not what the codes stand for: _Dequantised checks unpack
    test_unpack_gives_the_weights_it_computes_with = None


class TestPortableDequantised(_Dequantised):
    pass


class TestPortableDequantisedTwoPools(_Dequantised):
    input_dtype = torch.bfloat16
    kt_config = {"kt_expert_weight_format": "int8", "kt_tp_enabled": True, "kt_threadpool_count": 2,
                 "kt_num_threads": 2}


class TestPortableBF16Budget(_BF16Budget):
    pass


@needs_vnni
class TestVNNIDequantised(_Dequantised):
    kernels = "vnni"


@needs_vnni
class TestVNNIBF16Budget(_BF16Budget):
    kernels = "vnni"


@needs_vnni
class TestVNNIBF16BudgetBF16Input(_BF16Budget):
    kernels = "vnni"
    input_dtype = torch.bfloat16


@needs_amx
class TestAMXDequantised(_Dequantised):
    kernels = "amx"


@needs_amx
class TestAMXBF16Budget(_BF16Budget):
    kernels = "amx"


@needs_amx
class TestAMXBF16BudgetTwoPools(_BF16Budget):
    kernels = "amx"
    kt_config = {"kt_expert_weight_format": "int8", "kt_tp_enabled": True, "kt_threadpool_count": 2}


# -- more shapes: many rows per expert (the AMX tiles' 32-row groups and remainders), odd H and I, K=1, T=1 -------
EXTRA = [
    Case(4, 72, 40, 150, 2, rank=3, label="tiles-odd-H72-I40"),
    Case(3, 100, 50, 70, 1, rank=2, label="odd-H100-I50-K1"),
    Case(6, 64, 96, 1, 3, label="T1"),
    Case(12, 37, 23, 5, 1, unrouted=1, label="zero-or-one-token"),
    Case(2, 256, 160, 300, 2, rank=8, label="bigger"),
]


def _problem(case, dtype=torch.float32, seed=0):
    spec = type("P", (), {"weight_dtype": torch.bfloat16, "input_dtype": dtype})()
    return ExpertBackendContract.problem(spec, case, seed=seed, lora=True)


def _run(b, case, dtype=torch.float32, grad_seed=3):
    weights, x, ids, w, lora = _problem(case, dtype)
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(grad_seed)).to(dtype)
    packed = b.pack(weights)
    y, ctx = b.forward(packed, x, ids, w, lora, save=True)
    gx, gw, lg = b.backward(packed, ctx, grad_y, lora)
    return [y, gx, gw, *(t for t in lg.tensors() if t is not None)], (weights, x, ids, w, lora, grad_y)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", EXTRA, ids=lambda c: c.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
@pytest.mark.parametrize("oracle", [_Dequantised, _BF16Budget], ids=["dequantised", "bf16-budget"])
def test_extra_shapes(kernels, case, dtype, oracle):
    got, (weights, x, ids, w, lora, grad_y) = _run(backend(kernels), case, dtype)
    ref = oracle()
    want = ref.reference(weights, x, ids, w, lora, grad_y)
    ref.assert_matches_reference((got[0], got[1], got[2], got[3:]), want, x, w)


# -- the quantiser -----------------------------------------------------------------------------------------------
def numpy_quantize(w: np.ndarray):
    """int8-sym-channel-v1 written independently: float32 scales amax / 127, codes rint(w / scale) (numpy's rint
    rounds half to even), clipped to [-127, 127], 0 in an all-zero row."""
    w = w.astype(np.float32)
    scales = (np.abs(w).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(w / safe[..., None]), -127, 127).astype(np.int8)
    return codes, scales


def _weights(e, h, i, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(e, i, h, generator=g), torch.randn(e, i, h, generator=g) * 3, torch.randn(e, h, i, generator=g)]
    ws[0][0, 1] = 0  # an all-zero channel: scale 0, codes 0
    # ties: with amax 127 the scale is exactly 1, so x.5 sits halfway between two codes (half to even: 0, 2, 2, -2)
    ws[2][-1, 2, :5] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5])
    ws[2][-1, 2, 5:] = 0
    return ExpertWeights(*(t.to(dtype) for t in ws))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 23), (2, 128, 64), (1, 200, 130)], ids=str)
def test_native_quantiser_matches_numpy_and_python(kernels, dtype, shape):
    """Each table's row quantiser (the AVX-512 one of vnni and amx is its own code) quantises weights as an
    independent numpy version and the Python scheme do, to the bit: ties, an all-zero channel, odd widths."""
    weights = _weights(*shape, dtype)
    b = backend(kernels)
    got = b.unpack(b.pack(weights))
    python = Int8Experts.quantize(weights)
    for name in ("gate", "up", "down"):
        codes, scales = getattr(got, name)
        want_codes, want_scales = numpy_quantize(getattr(weights, name).float().numpy())
        np.testing.assert_array_equal(codes.numpy(), want_codes, err_msg=name)
        np.testing.assert_array_equal(scales.numpy(), want_scales, err_msg=name)
        torch.testing.assert_close(codes, getattr(python, name)[0], rtol=0, atol=0)
        torch.testing.assert_close(scales, getattr(python, name)[1], rtol=0, atol=0)
    assert got.down[0][-1, 2, :5].tolist() == [127, 0, 2, 2, -2]
    assert got.gate[1][0, 1] == 0 and not got.gate[0][0, 1].any()


class _Store:
    """An expert source that holds int8 codes, as the packed store offers them (``read_int8``)."""

    def __init__(self, int8):
        self.int8 = int8
        self.reads = 0

    def read_int8(self):
        self.reads += 1
        return self.int8


def test_pack_source_takes_int8_codes_as_they_are():
    case = EXTRA[0]
    weights, x, ids, w, lora = _problem(case)
    b = backend("portable")
    source = _Store(Int8Experts.quantize(weights))
    from_source = b.pack_source(source)
    assert source.reads == 1
    unpacked = b.unpack(from_source)
    for name in ("gate", "up", "down"):
        for got, want in zip(getattr(unpacked, name), getattr(source.int8, name)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    y1, _ = b.forward(from_source, x, ids, w, lora)
    y2, _ = b.forward(b.pack(weights), x, ids, w, lora)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)  # same codes and scales as quantising the bf16 weights


def test_pack_source_of_a_dense_source_is_none():
    class Dense:
        def read(self, dtype):
            raise AssertionError("pack_source must not read dense weights")

    assert backend("portable").pack_source(Dense()) is None


def test_pack_int8_refuses_wrong_codes():
    weights = _problem(EXTRA[0])[0]
    int8 = Int8Experts.quantize(weights)
    int8.down = (int8.down[0].to(torch.int16), int8.down[1])
    with pytest.raises(ValueError, match=r"down has torch.int16 codes .* expected int8"):
        backend("portable").pack_int8(int8)


def test_other_format_or_activation_is_a_clear_error():
    b = backend("portable", kt_expert_weight_format="bf16")
    with pytest.raises(ValueError, match="kt_expert_weight_format to int8"):
        b.pack(_problem(EXTRA[0])[0])
    with pytest.raises(ValueError, match="silu activation only"):
        backend("portable").pack(_problem(EXTRA[0])[0], activation="gelu")


# -- determinism -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels", KERNELS)
def test_thread_count_invariance(kernels):
    one, _ = _run(backend(kernels, kt_num_threads=1), EXTRA[4])
    two, _ = _run(backend(kernels, kt_num_threads=2), EXTRA[4])
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", [pytest.param("amx", marks=needs_amx), pytest.param("vnni", marks=needs_vnni)])
@pytest.mark.parametrize("case", EXTRA, ids=lambda c: c.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_kernel_tables_agree_to_the_bit(kernels, case, dtype):
    """Integer products are exact and the float routines are one source compiled without contraction, or (the
    AVX-512 row quantiser) the same IEEE operations in the same order per element: the AVX-512 tables must return
    the portable table's bits (a wrong block offset, VNNI's sign compensation, a tile remainder or a quantiser
    lane shows as a difference here), from fp32 and bf16 token rows."""
    got, _ = _run(backend(kernels), case, dtype)
    want, _ = _run(backend("portable"), case, dtype)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_thread_pools_match_single_pool(kernels):
    single, _ = _run(backend(kernels, kt_num_threads=2), EXTRA[4])
    tp = backend(kernels, kt_num_threads=2, kt_tp_enabled=True, kt_threadpool_count=2)
    assert tp.num_pools == 2
    split, _ = _run(tp, EXTRA[4])
    for a, b in zip(single, split):
        assert relative_error(b, a) < 1e-5  # partial sums over halves of K add up in another order


# -- kernels selection -------------------------------------------------------------------------------------------
def test_kernels_override(monkeypatch):
    monkeypatch.setenv("KTCORE_AMX_INT8_KERNELS", "portable")
    assert AMXInt8Backend(as_kt_config(INT8)).kernels == "portable"
    monkeypatch.setenv("KTCORE_AMX_INT8_KERNELS", "fast")
    with pytest.raises(ValueError, match="KTCORE_AMX_INT8_KERNELS='fast'"):
        AMXInt8Backend(as_kt_config(INT8))


def test_auto_kernels_are_amx_or_vnni():
    if AMX_REASON and VNNI_REASON:
        with pytest.raises(RuntimeError, match="cannot run here"):
            backend("auto")
        return
    assert backend("auto").kernels == ("amx" if not AMX_REASON else "vnni")


@pytest.mark.skipif(not AMX_REASON, reason="this process can use AMX")
def test_amx_kernels_refused_without_amx():
    with pytest.raises(RuntimeError, match="amx_int8 backend cannot run here: .*'amx' kernels unavailable"):
        backend("amx")


def test_phase_clock_times_each_phase_only_while_on():
    check_phase_clock(backend("portable", kt_num_threads=2), _problem(EXTRA[0]))


def test_the_lora_gradient_phases_run_only_in_the_second_part_of_backward_parts():
    check_lora_gradients_come_last(backend("portable", kt_num_threads=2), _problem(EXTRA[0]))
