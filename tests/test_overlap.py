"""CPU and device at once (ktcore.model.overlap, ktcore.experts.staging): the deferred experts path gives the same bits as
waiting at once, hands the backward to the backend before the shared experts' backward, and refuses a
shared-experts module that does not run after the routed experts."""

import dataclasses
import threading
from typing import Optional

import pytest
import torch
from archs import tiny_model
from ktcore_tiny import backend_unusable
from peft import LoraConfig, get_peft_model

import ktcore
from ktcore.experts import ExpertJob
from ktcore.experts.probe import Shape, make_problem
from ktcore.model.overlap import install_overlap, set_overlap
from ktcore.experts.timeline import attach

SHARED_FAMILIES = ["deepseek_v2", "deepseek_v3"]  # the families whose MoE block runs shared experts last


def lora_model(family, backend="torch", cpu_activation="retain"):
    model = ktcore.wrap_model(tiny_model(family), {"kt_backend": backend, "kt_cpu_activation": cpu_activation})
    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                        target_modules=["q_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return model, get_peft_model(model, config)


def step(peft_model, ids):
    peft_model.zero_grad()
    out = peft_model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().clone(), {n: p.grad.clone() for n, p in peft_model.named_parameters()
                                         if p.requires_grad}


@pytest.mark.parametrize("backend,cpu_activation", [("torch", "retain"), ("torch", "recompute"),
                                                    ("llamafile", "retain"), ("amx_bf16", "retain")])
@pytest.mark.parametrize("family", SHARED_FAMILIES)
def test_deferred_experts_give_the_same_bits_as_waiting_at_once(family, backend, cpu_activation):
    why = backend_unusable(backend)
    if why:
        pytest.skip(f"{backend} cannot run here: {why}")
    model, peft_model = lora_model(family, backend, cpu_activation)
    assert all(layer.overlap is not None for layer in model.ktcore.layers.values())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    set_overlap(model, False)
    logits, grads = step(peft_model, ids)
    set_overlap(model, True)
    logits_deferred, grads_deferred = step(peft_model, ids)
    assert torch.equal(logits, logits_deferred)
    assert sum("experts" in n for n in grads) == 2 * 2 * 2  # 2 MoE layers x (gate_up, down) x (A, B)
    for name in grads:
        assert grads[name].norm() > 0, name
        assert torch.equal(grads[name], grads_deferred[name]), name


def test_deferred_backward_reaches_the_backend_before_the_shared_experts_backward(monkeypatch):
    """Autograd runs newer nodes first; the deferred result's node is newer than the shared experts', so the
    CPU backward starts before their backward (and after it when waiting at once)."""
    model, peft_model = lora_model("deepseek_v2")
    order = []
    submit = ExpertJob.submit_backward

    def recording_submit(job, grad_y):
        order.append(("experts", job.layer.name))
        return submit(job, grad_y)

    monkeypatch.setattr(ExpertJob, "submit_backward", recording_submit)
    for name in model.ktcore.layers:
        shared = model.get_submodule(name.replace(".experts", ".shared_experts")).down_proj
        shared.register_full_backward_pre_hook(lambda module, grad, name=name: order.append(("shared", name)))
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    for enabled, first in ((False, "shared"), (True, "experts")):
        order.clear()
        set_overlap(model, enabled)
        step(peft_model, ids)
        for name in model.ktcore.layers:
            kinds = [kind for kind, n in order if n == name]
            assert kinds[0] == first and sorted(kinds) == ["experts", "shared"], (enabled, order)


def test_a_shared_experts_module_that_does_not_run_after_the_experts_is_refused():
    model = ktcore.wrap_model(tiny_model("deepseek_v2"), {"kt_backend": "torch"})
    wrong = dataclasses.replace(model.ktcore.arch, shared_experts_module="model.layers.{layer}.input_layernorm")
    for layer in model.ktcore.layers.values():
        layer.overlap = None
    install_overlap(model, wrong, model.ktcore.layers, lambda name: int(name.split(".")[2]))
    set_overlap(model, True)
    with pytest.raises(RuntimeError, match="shared_experts_module is wrong"):
        model(torch.randint(0, 96, (1, 6)))


def test_timeline_records_the_backend_and_the_waiting():
    model, peft_model = lora_model("deepseek_v2")
    set_overlap(model, True)
    with attach(model) as timeline:
        step(peft_model, torch.randint(0, 96, (1, 16)))
        spent = timeline.resolve()
    assert spent["cpu_experts_s"] > 0 and spent["host_wait_s"] > 0
    assert spent["gpu_copy_s"] == spent["gpu_lora_copy_s"] == spent["gpu_wait_s"] == 0  # no GPU here
    assert all(layer.timeline is None for layer in model.ktcore.layers.values())


def cuda_lora_model(model_dir, backend="torch"):
    """The tiny model saved in model_dir on the GPU in bf16, with LoRA r=4 on q/o and the routed experts."""
    model = ktcore.load_model(model_dir, {"kt_backend": backend}, device="cuda", dtype=torch.bfloat16,
                              progress=False)
    torch.manual_seed(7)
    return model, get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                                   target_parameters=["mlp.experts.gate_up_proj",
                                                                      "mlp.experts.down_proj"]))


def _synchronisations(model_dir):
    """For one LoRA training step of the model saved in model_dir (after a warm-up step): the device-wide and
    stream synchronisations the CUDA runtime saw, the sync-debug warnings raised from ktcore's own files, and
    those raised from anywhere."""
    import warnings
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    _, peft_model = cuda_lora_model(model_dir)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(5)).cuda()

    def train_step():
        peft_model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()  # warm-up: allocator pools, pinned buffers, side stream
    torch.cuda.synchronize()
    package = str(Path(ktcore.__file__).parent)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    names = ("cudaDeviceSynchronize", "cudaStreamSynchronize")
    runtime = sum(1 for e in prof.events() if e.name in names)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return runtime, [s for s in syncs if s.startswith(package)], syncs  # runtime: with the test's own sync


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_a_training_step_does_not_synchronise_the_device_per_layer(tmp_path):
    """A LoRA step of a DeepSeek-V2 with 2 and with 4 MoE layers: ktcore's own code raises no sync-debug
    warning, and the CUDA runtime sees as many device or stream synchronisations with 4 layers as with 2."""
    counts, seen = {}, {}
    for layers in (3, 5):  # the first layer is dense
        tiny_model("deepseek_v2", num_hidden_layers=layers).save_pretrained(tmp_path / str(layers))
        counts[layers], ours, seen[layers] = _synchronisations(tmp_path / str(layers))
        assert ours == [], ours
    assert counts[3] >= 1  # the profiler sees synchronisations: the test's own torch.cuda.synchronize()
    assert counts[5] == counts[3], (counts, seen)  # seen: where sync-debug mode caught them, any code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_the_timeline_counts_the_gpu_idle_while_the_backend_computes(tmp_path):
    """On CUDA the compute stream runs dry while the driving thread blocks on the backend's result, before it
    can queue its wait: that time is GPU idle too. In a tiny model the GPU work per layer is a few small
    kernels, so most of the backend's time is the GPU idling; counting only from where the wait was queued
    gives a few copy times (about 1% of it)."""
    tiny_model("deepseek_v2", num_hidden_layers=3).save_pretrained(tmp_path / "model")
    model, peft_model = cuda_lora_model(tmp_path / "model")
    ids = torch.randint(0, 96, (1, 256), generator=torch.Generator().manual_seed(5)).cuda()
    peft_model(ids, labels=ids).loss.backward()  # warm-up
    torch.cuda.synchronize()
    with attach(model) as timeline:
        peft_model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        spent = timeline.resolve()
    assert spent["cpu_experts_s"] > 0
    assert spent["gpu_wait_s"] > 0.5 * spent["cpu_experts_s"], spent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("backend", ["amx_bf16", "amx_int8"])
def test_native_results_reach_the_gpu_without_a_host_copy(tmp_path, monkeypatch, backend):
    """A native backend serving a model on a GPU writes y, grad_x, grad_w and the expert-LoRA gradients straight
    into pinned memory (``pin_outputs``), so the staging copies them to the device as they are: a host memcpy of
    each result would sit on the CPU's critical path between two layers' kernels."""
    why = backend_unusable(backend)
    if why:
        pytest.skip(f"{backend} cannot run here: {why}")
    from ktcore.experts.staging import CudaStaging

    copied = []
    pin = CudaStaging.pin

    def spying_pin(self, t, dtype=None):
        out = pin(self, t, dtype)
        if t is not None and out is not t:
            copied.append(tuple(t.shape))
        return out

    monkeypatch.setattr(CudaStaging, "pin", spying_pin)
    tiny_model("deepseek_v2", num_hidden_layers=3).save_pretrained(tmp_path / "model")
    model, peft_model = cuda_lora_model(tmp_path / "model", backend)
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(5)).cuda()
    peft_model(ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    assert all(p.grad is not None for n, p in peft_model.named_parameters() if "experts" in n and p.requires_grad)
    assert all(layer.backend.pin_outputs for layer in model.ktcore.layers.values())
    assert copied == [], copied


# -- the expert-LoRA gradients apart from the input gradient ----------------------------------------------------
def _held_lora_grads(backend, gate: threading.Event, fail: Optional[str] = None):
    """backend's backward_parts with its LoRA gradients held at ``gate`` (or failing with ``fail``)."""
    parts = backend.backward_parts

    def held(packed, ctx, grad_y, lora=None):
        grad_x, grad_w, lora_grads = parts(packed, ctx, grad_y, lora)

        def later():
            if not gate.wait(30):
                raise TimeoutError("the test never opened the gate")
            if fail:
                raise RuntimeError(fail)
            return lora_grads()

        return grad_x, grad_w, later

    backend.backward_parts = held


def test_the_input_gradient_comes_back_while_the_expert_lora_gradients_are_computed():
    """submit_backward_parts: (grad_x, grad_w) are there while the LoRA gradients are still held back, and both
    parts equal one plain backward."""
    backend = ktcore.get_backend("torch", {"kt_backend": "torch"}, need_backward=True, need_lora=True)
    weights, x, ids, w, lora = make_problem(Shape("p", 6, 2, 24, 16, (9,)), 9, torch.float32, lora_rank=3)
    packed = backend.pack(weights)
    grad_y = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    want = backend.backward(packed, backend.forward(packed, x, ids, w, lora, save=True)[1], grad_y, lora)
    gate = threading.Event()
    _held_lora_grads(backend, gate)
    first, rest = backend.submit_backward_parts(packed, backend.forward(packed, x, ids, w, lora, save=True)[1],
                                                grad_y, lora)
    grad_x, grad_w = first.result(timeout=30)
    assert not rest.done()
    gate.set()
    got = rest.result(timeout=30)
    assert torch.equal(grad_x, want[0]) and torch.equal(grad_w, want[1])
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want[2].tensors()))


@pytest.mark.parametrize("fail", ["main", "lora"])
def test_a_failing_backward_part_raises_from_the_training_step(fail):
    """Whichever part of the backend's backward fails, loss.backward() raises its error (nothing hangs, nothing
    is lost): the input gradient's in ExpertsFunction's node, the LoRA gradients' in ExpertLoRAGradients'."""
    model, peft_model = lora_model("deepseek_v2")
    for layer in model.ktcore.layers.values():
        backend = layer.backend = type(layer.backend)(layer.backend.config)
        gate = threading.Event()
        gate.set()
        if fail == "lora":
            _held_lora_grads(backend, gate, fail="the lora part failed")
        else:
            def broken(*args, **kwargs):
                raise RuntimeError("the main part failed")

            backend.backward_parts = broken
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match=f"the {fail} part failed"):
        peft_model(ids, labels=ids).loss.backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_expert_lora_gradients_are_awaited_off_the_gpus_backward_thread(tmp_path, monkeypatch):
    """With the model on a GPU, autograd runs ExpertsFunction's backward on the GPU's own thread and
    ExpertLoRAGradients' (reached through a CPU scalar) on the thread that called backward(): the wait for the
    LoRA gradients never holds up the device's backward. Every layer's factors still get their gradients."""
    threads = {"input": set(), "lora": set()}
    finish, finish_lora = ExpertJob.finish_backward, ExpertJob.finish_lora_backward

    def recording(kind, method):
        def record(job):
            threads[kind].add(threading.get_ident())
            return method(job)
        return record

    monkeypatch.setattr(ExpertJob, "finish_backward", recording("input", finish))
    monkeypatch.setattr(ExpertJob, "finish_lora_backward", recording("lora", finish_lora))
    tiny_model("deepseek_v2", num_hidden_layers=4).save_pretrained(tmp_path / "model")
    _, peft_model = cuda_lora_model(tmp_path / "model")
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(5)).cuda()
    peft_model(ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    assert threads["lora"] == {threading.get_ident()}
    assert threading.get_ident() not in threads["input"] and len(threads["input"]) == 1
    experts = {n: p for n, p in peft_model.named_parameters() if "experts" in n and p.requires_grad}
    assert len(experts) == 3 * 2 * 2 and all(p.grad is not None for p in experts.values())
    # PEFT starts B at zero, so only B's gradients are nonzero after one step
    assert all(p.grad.norm() > 0 for n, p in experts.items() if "lora_B" in n)
