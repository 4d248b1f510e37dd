"""amx_bf16 against ktcore's contract suite, plus thread/pool invariance, odd shapes and capability checks.

The AMX classes skip (with the reason) only where this process cannot use AMX. The ``portable`` classes run
the very same orchestration, packing and transposition code with plain C++ kernels, so they run anywhere.
"""

import pytest
import torch

import ktcore
import ktcore.plugins.hw
import ktcore.plugins
from ktcore.testing import ExpertBackendContract
from ktcore.testing.contract import Case, relative_error
from ktcore.testing.phases import check_lora_gradients_come_last, check_phase_clock

from ktcore_amx_bf16 import _ext
from ktcore_amx_bf16.backend import AMXBF16Backend

AMX_REASON = _ext.amx_unavailable_reason()
needs_amx = pytest.mark.skipif(bool(AMX_REASON), reason=f"this CPU/process cannot use AMX: {AMX_REASON}")
AVX512_REASON = _ext.avx512_bf16_unavailable_reason()
needs_avx512 = pytest.mark.skipif(bool(AVX512_REASON), reason=f"this CPU cannot use AVX-512 BF16: {AVX512_REASON}")


class _KernelsMixin:
    """The contract on one of the backend's kernel tables (``kernels``)."""

    kernels = "portable"

    def make_backend(self, **kt):
        from ktcore.config import as_kt_config

        return AMXBF16Backend(as_kt_config({"kt_backend": "amx_bf16", **self.kt_config, **kt}), kernels=self.kernels)


@needs_amx
class TestAMXBF16Contract(ExpertBackendContract):
    backend_name = "amx_bf16"
    weight_dtype = torch.bfloat16
    input_dtype = torch.float32
    rtol_out = 1e-2
    rtol_grad = 2e-2


@needs_amx
class TestAMXBF16ContractBF16Input(TestAMXBF16Contract):
    input_dtype = torch.bfloat16


@needs_amx
class TestAMXBF16ContractTwoPools(TestAMXBF16Contract):
    kt_config = {"kt_tp_enabled": True, "kt_threadpool_count": 2, "kt_num_threads": 2}


class TestPortableContract(_KernelsMixin, ExpertBackendContract):
    backend_name = "amx_bf16"
    weight_dtype = torch.bfloat16
    # worst measured (portable kernels, both classes): 3.2e-3 / 5.6e-3, activations rounded to bf16 by the kernels
    rtol_out = 1e-2
    rtol_grad = 2e-2


class TestPortableContractTwoPools(TestPortableContract):
    input_dtype = torch.bfloat16
    kt_config = {"kt_tp_enabled": True, "kt_threadpool_count": 2, "kt_num_threads": 2}


@needs_avx512
class TestAVX512Contract(TestPortableContract):  # the same bounds: the kernels round the same activations to bf16
    kernels = "avx512"


@needs_avx512
class TestAVX512ContractTwoPools(TestPortableContractTwoPools):
    kernels = "avx512"


# -- extra shapes: many tokens per expert (tile path with row remainders), odd H/I, K=1, T=1 -----------------
EXTRA = [
    Case(4, 72, 40, 150, 2, rank=3, label="tiles-odd-H72-I40"),
    Case(3, 100, 50, 70, 1, rank=2, label="odd-H100-I50-K1"),
    Case(6, 64, 96, 1, 3, label="T1"),
    Case(12, 37, 23, 5, 1, unrouted=1, label="zero-or-one-token"),
    Case(2, 256, 160, 300, 2, rank=8, label="bigger"),
]


def _problem(case, seed=0, dtype=torch.float32):
    return ExpertBackendContract.problem(type("P", (), {"weight_dtype": torch.bfloat16, "input_dtype": dtype})(),
                                         case, seed=seed, lora=True)


def _check(backend, case, dtype=torch.float32):
    weights, x, ids, w, lora = _problem(case, dtype=dtype)
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    packed = backend.pack(weights)
    y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    gx, gw, lg = backend.backward(packed, ctx, grad_y, lora)
    ref = ExpertBackendContract()
    ref.activation = "silu"
    ry, rgx, rgw, rlg = ref.reference(weights, x, ids, w, lora, grad_y)
    assert y.dtype == x.dtype and gx.dtype == grad_y.dtype
    assert relative_error(y, ry) <= 1e-2
    assert relative_error(gx, rgx) <= 2e-2
    assert relative_error(gw, rgw) <= 2e-2
    for got, want in zip([t for t in lg.tensors() if t is not None], rlg):
        assert got.shape == want.shape
        assert relative_error(got, want) <= 2e-2
    return y, gx, gw, lg


def _run(backend, case):
    weights, x, ids, w, lora = _problem(case)
    packed = backend.pack(weights)
    y, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    g = backend.backward(packed, ctx, torch.ones_like(x), lora)
    return y, g[0], g[1], [t for t in g[2].tensors()]


def _backend(kernels, **kt):
    from ktcore.config import as_kt_config

    return AMXBF16Backend(as_kt_config({"kt_backend": "amx_bf16", **kt}), kernels=kernels)


KERNELS = [pytest.param("amx", marks=needs_amx), pytest.param("avx512", marks=needs_avx512), "portable"]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", EXTRA, ids=lambda c: c.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_extra_shapes(kernels, case, dtype):
    _check(_backend(kernels), case, dtype)


@pytest.mark.parametrize("kernels", KERNELS)
def test_thread_count_invariance(kernels):
    case = EXTRA[0]
    one = _run(_backend(kernels, kt_num_threads=1), case)
    two = _run(_backend(kernels, kt_num_threads=2), case)
    for a, b in zip(one[:3], two[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(one[3], two[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_thread_pools_match_single_pool(kernels):
    case = EXTRA[4]
    single = _run(_backend(kernels, kt_num_threads=2), case)
    tp = _backend(kernels, kt_num_threads=2, kt_tp_enabled=True, kt_threadpool_count=2)
    assert tp.num_pools == 2
    split = _run(tp, case)
    for a, b in zip(single[:3], split[:3]):
        assert relative_error(b, a) < 1e-5


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("pools", [2, 3])
def test_backward_unit_groups_with_pools(kernels, pools):
    """A backward task covers up to 4 adjacent output units, fewer when a pool would get under 4 tasks per thread.
    H=300 (10 units of gate/up, every pool) and I=200 (7 units of down, split over the pools) leave partial
    groups; with one thread per pool (4 experts with tokens) the groups are up to 4 units wide, with 8 threads
    per pool single units. Both must match the reference, and each other exactly (same pools, same sums)."""
    case = Case(4, 300, 200, 40, 2, rank=2, label="unit-groups")
    runs = []
    for per_pool in (1, 8):
        b = _backend(kernels, kt_num_threads=per_pool * pools, kt_tp_enabled=True, kt_threadpool_count=pools)
        assert b.num_pools == pools
        y, gx, gw, lg = _check(b, case)
        runs.append([y, gx, gw] + [t for t in lg.tensors() if t is not None])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_saved_activations_reuse_only_memory_of_dead_contexts(kernels):
    """A context's g, u and h go back to the backend's pool when the context dies, and the next forward takes
    them; a context still alive keeps its own, so its backward is unchanged by forwards that ran after it."""
    b = _backend(kernels)
    weights, x, ids, w, lora = _problem(EXTRA[4])
    _, x2, ids2, w2, _ = _problem(EXTRA[4], seed=1)
    packed = b.pack(weights)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    _, ctx = b.forward(packed, x, ids, w, lora, save=True)
    want = b.backward(packed, ctx, gy, lora)
    saved = {t.data_ptr() for t in (ctx.g, ctx.u, ctx.h)}
    del ctx
    _, ctx = b.forward(packed, x, ids, w, lora, save=True)
    assert {t.data_ptr() for t in (ctx.g, ctx.u, ctx.h)} == saved
    _, later = b.forward(packed, x2, ids2, w2, lora, save=True)
    assert saved.isdisjoint(t.data_ptr() for t in (later.g, later.u, later.h))
    got = b.backward(packed, ctx, gy, lora)
    for a, c in zip(want[:2] + tuple(want[2].tensors()), got[:2] + tuple(got[2].tensors())):
        torch.testing.assert_close(c, a, rtol=0, atol=0)


@pytest.mark.perf
def test_training_steps_do_not_fault_in_fresh_memory():
    """Steady state: a forward+backward pair touches memory it has touched before. Fresh saved activations
    cost a page fault per 4 KiB (thousands per step here); 100 leaves room for torch's small tensors."""
    resource = pytest.importorskip("resource")
    b = _backend("portable", kt_num_threads=2)
    case = Case(4, 128, 2048, 512, 2, label="saved-21MB")
    weights, x, ids, w, _ = _problem(case)
    packed = b.pack(weights)

    def step():
        _, ctx = b.forward(packed, x, ids, w, None, save=True)
        b.backward(packed, ctx, x, None)

    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 100


def test_num_threads_from_config():
    import os

    assert _backend("portable", kt_num_threads=3).num_threads == 3
    assert _backend("portable").num_threads == len(os.sched_getaffinity(0))  # default: every core we may run on


def test_other_activation_is_a_clear_error():
    weights, *_ = _problem(EXTRA[3])
    with pytest.raises(ValueError, match="silu"):
        _backend("portable").pack(weights, activation="gelu")


def test_forward_only_returns_no_context():
    b = _backend("portable")
    weights, x, ids, w, lora = _problem(EXTRA[0])
    y, ctx = b.forward(b.pack(weights), x, ids, w, None, save=False)
    assert ctx is None and y.shape == x.shape


@pytest.fixture
def fresh_registry():
    ktcore.plugins.reset_registry()
    ktcore.plugins.hw._detect.cache_clear()
    yield
    ktcore.plugins.reset_registry()
    ktcore.plugins.hw._detect.cache_clear()


def test_listed_without_loading_extension(fresh_registry):
    from ktcore.plugins import get_registry

    specs = get_registry().specs("expert_backend")
    assert "amx_bf16" in specs
    spec = specs["amx_bf16"]
    assert spec.priority == 20 and set(spec.weight_formats) == {"auto", "bf16"}
    # the avx512 kernels' features: AMX is used where present, not required
    assert set(spec.required_cpu_features) == {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}


def test_unavailable_without_avx512_bf16_flags(monkeypatch, fresh_registry):
    from ktcore.plugins.select import resolve_backend

    monkeypatch.setenv("KTCORE_CPU_FLAGS", "avx2,fma")
    ktcore.plugins.hw._detect.cache_clear()
    choice = resolve_backend("auto")
    assert choice.spec is not None and choice.spec.name != "amx_bf16"
    reason = choice.reasons["amx_bf16"]
    assert reason and "avx512_bf16" in reason
    with pytest.raises(Exception, match="amx_bf16"):
        ktcore.get_backend("amx_bf16", {"kt_backend": "amx_bf16"})


def test_probe_names_the_missing_cpu_features(monkeypatch, fresh_registry):
    """probe() reads the CPU flags (KTCORE_CPU_FLAGS stands in for /proc/cpuinfo) before touching the extension."""
    from ktcore_amx_bf16.plugin import probe

    monkeypatch.setenv("KTCORE_CPU_FLAGS", "avx2,fma,avx512f,avx512_bf16")
    ktcore.plugins.hw._detect.cache_clear()
    assert probe() == "CPU lacks avx512bw, avx512vl"
    monkeypatch.setenv("KTCORE_CPU_FLAGS", "avx2,fma")
    ktcore.plugins.hw._detect.cache_clear()
    assert probe() == "CPU lacks avx512f, avx512bw, avx512vl, avx512_bf16"


@pytest.mark.perf
@needs_amx
def test_measurements():
    from ktcore_amx_bf16 import measure

    assert measure.read_bandwidth_gbps(64 << 20) > 0.1
    assert measure.amx_peak_gflops(0.05) > 1.0


def test_read_seconds_reads_the_given_memory_and_checks_its_alignment():
    from ktcore_amx_bf16.measure import Meter

    meter = Meter(2, "portable")
    buf = torch.ones(32 << 20, dtype=torch.int16)  # 64 MiB: page-aligned
    secs = meter.read_seconds(buf.data_ptr(), buf.nbytes)
    assert 0 < secs < buf.nbytes / 0.1e9  # at least 0.1 GB/s
    for addr, nbytes in ((buf.data_ptr() + 2, 256), (buf.data_ptr(), 255)):
        with pytest.raises(ValueError, match="64-byte aligned"):
            meter.read_seconds(addr, nbytes)


def test_the_backend_does_not_load_the_measurement_extension():
    import subprocess
    import sys

    code = ("import sys, torch; from ktcore_amx_bf16.backend import AMXBF16Backend; "
            "from ktcore.config import KTConfig; AMXBF16Backend(KTConfig(), kernels='portable'); "
            "print('ktcore_amx_bf16._measure' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.perf
def test_read_seconds_reads_at_least_100_mb_s():
    eng = _ext.Engine(2, 1, "portable")
    buf = torch.ones(32 << 20, dtype=torch.int16)  # 64 MiB: page-aligned
    assert 0 < eng.read_seconds(buf.data_ptr(), buf.nbytes) < buf.nbytes / 0.1e9


@pytest.mark.skipif(not AMX_REASON, reason="checks the error on CPUs without AMX")
def test_amx_kernels_refused_without_amx():
    with pytest.raises(RuntimeError, match="cannot run its amx kernels here"):
        _backend("amx")


def test_doctor_report_says_which_kernels():
    """Where AMX cannot run: no peak, the reason, and avx512 where the CPU has AVX-512 BF16 (what auto runs)."""
    from ktcore_amx_bf16.doctor import report

    got = report(0.05)
    if AMX_REASON:
        assert got["amx_bf16_peak_gflops"] is None and got["amx_bf16_peak_source"]
        assert got["amx_bf16_kernels"] == (None if AVX512_REASON else "avx512")
        if not AVX512_REASON:
            assert _backend("auto").kernels == "avx512"
    else:
        assert got["amx_bf16_peak_gflops"] > 100 and got["amx_bf16_kernels"] == "amx"


def test_phase_clock_times_each_phase_only_while_on():
    check_phase_clock(_backend("portable", kt_num_threads=2), _problem(EXTRA[0]))


def test_the_lora_gradient_phases_run_only_in_the_second_part_of_backward_parts():
    check_lora_gradients_come_last(_backend("portable", kt_num_threads=2), _problem(EXTRA[0]))
