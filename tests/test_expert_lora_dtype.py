"""Expert LoRA reaches a CPU backend as PEFT's own fp32 parameters, not as PEFT's per-forward casts to the model's
dtype (``ktcore.model.peft_expert_lora._get_delta_factors``).

PEFT 0.21 casts every factor ``.to(param.dtype)`` before folding it into the parameter; on a bf16 model that was a
cast of each factor per forward (again in a checkpointed recompute) and one of its gradient in backward, on the host
at torch's budgeted thread, and the backend's fp32 gradients were rounded to bf16 on the way to the fp32
parameters. These tests run a bf16 model on the CPU through a native backend (fp32 LoRA arithmetic) and check what
reaches the parameters against float64, that no cast or copy of a factor runs, and that what PEFT does around it
(disabled adapters, loading an adapter, more than one adapter) still works or is still refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ktcore_tiny import backend_unusable, tiny_qwen3_moe
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

import ktcore
from ktcore.experts import ExpertLoRA
from ktcore.model import peft_expert_lora
from ktcore.model.placeholder import ExpertWeightsUnavailable
from ktcore.model.wrap import canonical_weights
from ktcore.testing import relative_error
from ktcore.testing.contract import dense_reference

E, R = 5, 3  # experts, LoRA rank: factor shapes no other tensor of the tiny model has
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _native_backends():
    return [pytest.param(b, marks=pytest.mark.skipif(bool(backend_unusable(b)), reason=f"{b}: {backend_unusable(b)}"))
            for b in ("llamafile", "amx_bf16")]


def _plain():
    return tiny_qwen3_moe(seed=12, num_experts=E, moe_intermediate_size=40)


def _lora_config(**kw):
    return LoraConfig(r=R, lora_alpha=2 * R, target_parameters=EXPERT_PARAMS, init_lora_weights=False, **kw)


def _bf16_peft(backend, plain=None, **wrap):
    base = ktcore.wrap_model(copy.deepcopy(plain or _plain()).to(torch.bfloat16), {"kt_backend": backend, **wrap})
    torch.manual_seed(7)
    return get_peft_model(base, _lora_config())


def _ids(seed=3, shape=(4, 24)):
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


def _experts_modules(model):
    """(name, module) of the transformers experts modules (inside PEFT's ParamWrappers)."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Experts")]


def _peft_views(wrapper):
    """PEFT 0.21's (A [E, r, in], B [E, out, r]) views of a ParamWrapper's factors, and the same views of their
    gradients, and its scaling (the parameter is [E, out, in]: not transposed)."""
    a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight

    def views(ta, tb):
        return ta.reshape(E, -1, ta.shape[-1]), tb.reshape(tb.shape[0], -1, E).permute(2, 0, 1)

    return views(a, b), views(a.grad, b.grad), wrapper.scaling["default"]


@pytest.mark.parametrize("backend", _native_backends())
def test_backend_fp32_lora_gradients_reach_the_parameters_unrounded(backend):
    """Each MoE layer's expert-LoRA gradients on the fp32 parameters against float64 autograd of the same layer on
    the same bf16 inputs, routing and output gradient (recorded at the experts module), with the bf16 expert
    weights exactly and the fp32 factors. The backend's LoRA arithmetic is fp32: measured 1.4e-7..2.1e-7 relative
    (the gradients through PEFT's bf16 casts were 1.5e-3..1.8e-3 off, every element a bf16 value). amx_bf16 feeds
    its fp32 LoRA arithmetic the bf16 rows its tile multiplies read (the activation and the gate/up output
    gradient), as a bf16 model's own autograd would: 1.7e-3 off on an AMX host, still no element a bf16 value."""
    bound = 2e-2 if backend == "amx_bf16" else 1e-5  # 12x and 50x the error measured on each
    plain = _plain()
    bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    weights = {n: canonical_weights(m, m.gate_up_proj.detach(), m.down_proj.detach())
               for n, m in _experts_modules(bf16)}
    model = _bf16_peft(backend, plain)
    seen = {}
    for name, module in _experts_modules(model):
        def record(mod, args, out, name=name):
            inputs = seen[name] = [t.detach().clone() for t in args]
            out.register_hook(lambda grad: inputs.append(grad.detach().clone()))
        module.register_forward_hook(record)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(seen) == 2
    for name, (x, top_ids, top_w, grad_y) in seen.items():
        layer = name.removeprefix("base_model.model.").split(".experts")[0] + ".experts"
        down = model.base_model.model.get_submodule(layer)  # ParamWrapper(down_proj) of ParamWrapper(gate_up_proj)
        gu_factors, gu_grads, gu_scale = _peft_views(down.base_layer)
        d_factors, d_grads, d_scale = _peft_views(down)
        lora = ExpertLoRA(*(t.detach().double().requires_grad_(True) for t in (*gu_factors, *d_factors)),
                          gate_up_scale=gu_scale, down_scale=d_scale)
        y = dense_reference(weights[layer], x.double(), top_ids, top_w.double(), lora)
        want = torch.autograd.grad(y, list(lora.tensors()), grad_y.double())
        for part, got, ref in zip(("gate_up A", "gate_up B", "down A", "down B"), (*gu_grads, *d_grads), want):
            assert got.dtype == torch.float32, part
            assert relative_error(got, ref) <= bound, (name, part, relative_error(got, ref))
            # through a bf16 cast every gradient element is a bf16 value; fp32 ones almost never are (2^-16)
            assert (got == got.bfloat16().float()).float().mean() < 0.05, (name, part)


class _CopiesOf(TorchDispatchMode):
    """Records every cast or copy (``_to_copy``, ``copy_``, ``clone``) that reads or writes a tensor of one of
    ``shapes`` on this thread (forward, and backward: autograd runs CPU backward on the calling thread)."""

    OPS = (torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.clone)

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self.OPS:
            touched = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
            if any(tuple(t.shape) in self.shapes for t in touched):
                self.seen.append((str(func), [(tuple(t.shape), t.dtype, t.device.type) for t in touched]))
        return out


def _factor_shapes(model) -> set:
    """Every shape a factor or its gradient takes on the way between PEFT's parameters and the backend: the
    parameters, their [E, r, in] / [out, r, E] / [E, out, r] views, and the transposes."""
    shapes = set()
    for name, p in model.named_parameters():
        if "experts" in name and "lora_A" in name:
            shapes |= {tuple(p.shape), (E, R, p.shape[1]), (E, p.shape[1], R)}
        elif "experts" in name and "lora_B" in name:
            shapes |= {tuple(p.shape), (p.shape[0], R, E), (E, p.shape[0], R), (E, R, p.shape[0])}
    return shapes


@pytest.mark.parametrize("checkpointing", ["none", "transformers", "ktcore"])
@pytest.mark.parametrize("backend", _native_backends())
def test_no_cast_or_copy_of_the_factors_runs(backend, checkpointing):
    """One training step of a bf16 model: no cast or copy of an expert-LoRA factor or of its gradient, in forward,
    backward, or the forward a checkpointed layer recomputes in backward (PEFT's path cast each factor there
    again). Gradients still arrive, in fp32."""
    from ktcore.model.checkpointing import checkpoint_non_experts

    base = ktcore.wrap_model(_plain().to(torch.bfloat16), {"kt_backend": backend})
    if checkpointing == "transformers":
        base.gradient_checkpointing_enable({"use_reentrant": False})
    elif checkpointing == "ktcore":
        checkpoint_non_experts(base)
    torch.manual_seed(7)
    model = get_peft_model(base, _lora_config())
    shapes = _factor_shapes(model)
    assert len(shapes) >= 8
    ids = _ids()
    with _CopiesOf(shapes) as copies:
        model(input_ids=ids, labels=ids).loss.backward()
    assert copies.seen == []
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and p.requires_grad]
    assert len(grads) == 8 and all(g is not None and g.dtype == torch.float32 and g.norm() > 0 for g in grads)


def test_the_copy_probe_sees_peft_casting():
    """The probe above is able to fail: on a bf16 model whose experts are not a CPU backend's (plain transformers),
    PEFT's own ParamWrapper casts the factors in forward and their gradients in backward."""
    plain = _plain().to(torch.bfloat16)
    torch.manual_seed(7)
    model = get_peft_model(plain, _lora_config())
    with _CopiesOf(_factor_shapes(model)) as copies:
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
    assert any("_to_copy" in op and {dtype for _, dtype, _ in seen} == {torch.float32, torch.bfloat16}
               for op, seen in copies.seen), copies.seen


def test_factors_are_the_parameters_in_peft_layout():
    """The factors handed to the backend are views of PEFT's own lora_A/lora_B weights (same storage), with the
    values, shapes and scaling of PEFT's own ``get_delta_factors`` (which casts them): the mapping ktcore copies
    from PEFT 0.21 has not drifted."""
    model = _bf16_peft("torch")
    ids = _ids(shape=(1, 8))
    model(input_ids=ids)  # the pre-hook installs the replacement before the first ParamWrapper runs
    original = peft_expert_lora._peft_get_delta_factors
    assert original  # PEFT 0.21 factor folding, replaced
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert len(wrappers) == 4
    for wrapper in wrappers:
        lhs, rhs, scaling = wrapper.get_delta_factors("default")
        want_lhs, want_rhs, want_scaling = original(wrapper, "default")
        assert lhs.dtype == rhs.dtype == torch.float32 and want_lhs.dtype == torch.bfloat16
        assert scaling == want_scaling and lhs.shape == want_lhs.shape and rhs.shape == want_rhs.shape
        assert torch.equal(lhs.bfloat16(), want_lhs) and torch.equal(rhs.bfloat16(), want_rhs)
        storages = {wrapper.lora_A["default"].weight.data_ptr(), wrapper.lora_B["default"].weight.data_ptr()}
        assert {lhs.data_ptr(), rhs.data_ptr()} == storages  # views of the parameters, not copies
        assert lhs.requires_grad and rhs.requires_grad


def test_other_models_keep_peft_casts():
    """The replacement applies to experts a CPU backend computes only: a plain transformers model's ParamWrapper in
    the same process still gets PEFT's cast factors (in the parameter's dtype)."""
    _bf16_peft("torch")(input_ids=_ids(shape=(1, 8)))  # installs the replacement
    plain = get_peft_model(_plain().to(torch.bfloat16), _lora_config())
    wrapper = next(m for m in plain.modules() if type(m).__name__ == "ParamWrapper")
    lhs, rhs, _ = wrapper.get_delta_factors("default")
    assert lhs.dtype == rhs.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", _native_backends())
def test_disabled_adapters_and_a_loaded_adapter(backend, tmp_path):
    """DPO's reference model is the policy with its adapters disabled: the base model's logits exactly. An adapter
    trained on the bf16 model, saved and loaded with ``PeftModel.from_pretrained`` (what a resume does): fp32
    factors again, the same logits bit for bit, and training goes on (gradients on the loaded parameters)."""
    plain = _plain()
    model = _bf16_peft(backend, plain)
    ids = _ids()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    bare = ktcore.wrap_model(copy.deepcopy(plain).to(torch.bfloat16), {"kt_backend": backend})
    with torch.no_grad():
        want_base = bare(input_ids=ids).logits
        with model.disable_adapter():
            disabled = model(input_ids=ids).logits
        with_lora = model(input_ids=ids).logits
    assert torch.equal(disabled, want_base)
    assert relative_error(with_lora.float(), want_base.float()) > 1e-2  # the adapter does change the output

    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(bare, str(tmp_path), is_trainable=True)
    assert {p.dtype for n, p in loaded.named_parameters() if "lora" in n} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, with_lora)
    loaded(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in loaded.named_parameters() if "experts" in n and p.requires_grad]
    assert len(grads) == 8 and all(g is not None and g.dtype == torch.float32 and g.norm() > 0 for g in grads)


def test_placeholder_still_refuses_two_active_adapters():
    """Two adapters active at once on the experts: PEFT materialises their summed [E, out, in] delta, which the
    placeholder refuses in one line, as before (the uncast factors are for a single active adapter only)."""
    model = _bf16_peft("torch")
    model.add_adapter("second", _lora_config())
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ExpertWeightsUnavailable, match="materialising the full"):
        model(input_ids=_ids(shape=(1, 8)))


def test_placeholder_still_refuses_a_second_fold():
    """A placeholder that already carries factors refuses another ``baddbmm`` (a second LoRA folded onto the same
    parameter), with fp32 factors as with bf16 ones."""
    from ktcore.model.placeholder import ExpertWeightPlaceholder

    placeholder = ExpertWeightPlaceholder((E, 8, 6), torch.bfloat16, "cpu")
    lhs, rhs = torch.randn(E, 8, R), torch.randn(E, R, 6)
    folded = torch.baddbmm(placeholder, lhs, rhs, alpha=0.5)
    assert folded.lora[0] is lhs and folded.lora[1] is rhs and folded.dtype == torch.bfloat16
    with pytest.raises(ExpertWeightsUnavailable, match="one active LoRA adapter"):
        torch.baddbmm(folded, lhs, rhs)
    with pytest.raises(ExpertWeightsUnavailable, match="one active LoRA adapter"):
        torch.baddbmm(placeholder, lhs, rhs, beta=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("lora_device", ["model", "host"])
@pytest.mark.parametrize("backend", _native_backends())
def test_cuda_expert_lora_gradients_stay_fp32(tmp_path, backend, lora_device):
    """The model on a GPU, in bf16: with the factors on the GPU (``model``: staged to the host and back in fp32, the
    choice ``_get_delta_factors`` documents) or in host memory, the expert-LoRA gradients that reach the fp32
    parameters are the backend's fp32 ones, not bf16 values, and no factor is cast on the way."""
    from ktcore.model.peft_expert_lora import peft_wrapping

    _plain().save_pretrained(tmp_path)
    base = ktcore.load_model(tmp_path, {"kt_backend": backend, "kt_expert_lora_device": lora_device}, device="cuda",
                             dtype=torch.bfloat16, progress=False)
    torch.manual_seed(7)
    with peft_wrapping(base):
        model = get_peft_model(base, _lora_config())
    shapes = _factor_shapes(model)
    ids = _ids().cuda()
    with _CopiesOf(shapes) as copies:
        model(input_ids=ids, labels=ids).loss.backward()
    casts = [(op, seen) for op, seen in copies.seen if "_to_copy" in op and len({dtype for _, dtype, _ in seen}) > 1]
    # the staging's device copies keep the dtype; CUDA backward runs on autograd's device thread, which this
    # thread-local probe does not see: there the gradients' values below are the check
    assert casts == []
    grads = [p.grad for n, p in model.named_parameters() if "experts" in n and p.requires_grad]
    assert len(grads) == 8
    for g in grads:
        assert g.dtype == torch.float32 and g.norm() > 0
        assert (g == g.bfloat16().float()).float().mean() < 0.05
