"""Expert LoRA factors cross into the native backends as addresses and strides (ktcore.experts.native_lora): PEFT's strided
views and bf16 factors must give the bits of contiguous fp32 factors with the same values, and the gradients must
come back in each factor's own dtype and layout. Runs amx_bf16 on its portable kernels and, where installed, llamafile
(both read the factors through ktcore/include/ktcore/expert_lora.hpp)."""

import pytest
import torch

from ktcore.config import KTConfig
from ktcore.experts import ExpertLoRA
from ktcore.testing import ExpertBackendContract
from ktcore.testing.contract import Case


def _amx():
    from ktcore_amx_bf16.backend import AMXBF16Backend

    return AMXBF16Backend(KTConfig(kt_backend="amx_bf16", kt_num_threads=2), kernels="portable")


def _llamafile():
    pytest.importorskip("ktcore_llamafile._ext")
    from ktcore_llamafile.backend import LlamafileBackend

    return LlamafileBackend(KTConfig(kt_expert_weight_format="q8_0", kt_num_threads=2))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' strides swapped (as PEFT's transposed views have them)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("make_backend", [_amx, _llamafile], ids=["amx_bf16-portable", "llamafile"])
def test_strided_and_bf16_factors_match_contiguous_fp32(make_backend):
    contract = ExpertBackendContract()
    contract.weight_dtype = torch.bfloat16
    weights, x, ids, w, lora = contract.problem(Case(6, 96, 40, 50, 2, rank=5, label="layouts"))
    lora = lora.map(lambda t: t.bfloat16().float())  # values a bf16 factor holds exactly
    backend = make_backend()
    packed = backend.pack(weights)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))

    def run(ad):
        y, ctx = backend.forward(packed, x, ids, w, ad, save=True)
        gx, gw, grads = backend.backward(packed, ctx, gy, ad)
        return [y, gx, gw], list(grads.tensors())

    want, want_grads = run(lora)
    for name, variant in (("strided", lora.map(_strided)), ("bf16", lora.map(lambda t: t.bfloat16()))):
        got, got_grads = run(variant)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        for g, ref, factor in zip(got_grads, want_grads, variant.tensors()):
            assert g.dtype == factor.dtype and g.shape == factor.shape, name
            torch.testing.assert_close(g, ref.to(factor.dtype), rtol=0, atol=0, msg=name)


def test_mismatched_factor_shapes_are_a_clear_error():
    contract = ExpertBackendContract()
    contract.weight_dtype = torch.bfloat16
    weights, x, ids, w, lora = contract.problem(Case(4, 64, 32, 8, 2, rank=4, label="bad"))
    backend = _amx()
    bad = ExpertLoRA(lora.gate_up_a, lora.gate_up_b[:, :, :3], lora.down_a, lora.down_b)
    with pytest.raises(ValueError, match="gate_up"):
        backend.forward(backend.pack(weights), x, ids, w, bad)
