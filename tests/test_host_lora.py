"""``kt_expert_lora_device: host``: the routed experts' LoRA factors, their gradients and AdamW state in host memory
(``ktcore.model.host_lora``), against the default ``model`` (the factors on the model's device).

On the CPU the model's device is the host, so ``host`` must train exactly as ``model`` does; the CUDA tests (skipped
without a GPU) check where each tensor lives, the same training within bf16 tolerance, the adapter files, TRL, and
that the GPU's peak memory drops by at least the expert LoRA's bytes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from ktcore_tiny import backend_unusable, tiny_qwen3_moe
from peft import PeftModel, get_peft_model

import ktcore
from ktcore.config import ConfigError, config_from_dict
from ktcore.model.host_lora import HostLoRALinear, _refuse_distributed, expert_lora_factors, keep_on_host
from ktcore.model.peft_expert_lora import peft_wrapping
from ktcore.plugins import threads
from ktcore.plugins.threads import apply_budget, give_optimizer_steps_the_cores, rank_cores, usable_cores
from ktcore.testing import relative_error
from test_equivalence import lora_config

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    tiny_qwen3_moe(seed=3).save_pretrained(path)
    return path


def load(model_dir, device, lora_device, backend="torch", dtype=torch.float32):
    return ktcore.load_model(model_dir, {"kt_backend": backend, "kt_expert_lora_device": lora_device},
                             device=device, dtype=dtype, progress=False)


def with_lora(base, through_ktcore=True):
    """PEFT LoRA as ktcore's frontends make it (``peft_wrapping``), or as a user's own ``get_peft_model``."""
    torch.manual_seed(7)
    if through_ktcore:
        with peft_wrapping(base):
            return get_peft_model(base, lora_config())
    return get_peft_model(base, lora_config())


def batches(n, device, vocab=96):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (2, 16), generator=g).to(device) for _ in range(n)]


def train(model, steps=2, device="cpu"):
    """AdamW steps on fixed batches: the losses, the optimizer, and the trainable tensors before training."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for ids in batches(steps, device):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if len(losses) < steps:
            optimizer.zero_grad(set_to_none=True)
    return losses, optimizer, before


def expert_lora_params(model) -> list:
    return [p for f in expert_lora_factors(model) for p in f.parameters()]


def test_key_is_validated_in_one_line():
    assert config_from_dict({"use_kt": True, "kt_config": {"kt_expert_lora_device": "host"}}).kt.kt_expert_lora_device \
        == "host"
    assert config_from_dict({"use_kt": True}).kt.kt_expert_lora_device == "model"
    with pytest.raises(ConfigError) as err:
        config_from_dict({"use_kt": True, "kt_config": {"kt_expert_lora_device": "gpu"}})
    message = str(err.value)
    assert "kt_expert_lora_device" in message and "host" in message and "\n" not in message


@pytest.mark.parametrize("through_ktcore", [True, False], ids=["peft_wrapping", "user-get_peft_model"])
def test_host_on_a_cpu_model_trains_exactly_as_model(model_dir, through_ktcore):
    runs = {}
    for lora_device in ("model", "host"):
        model = with_lora(load(model_dir, "cpu", lora_device), through_ktcore)
        runs[lora_device] = (model, *train(model))
    model, losses, optimizer, _ = runs["host"]
    factors = expert_lora_factors(model)
    assert len(factors) == 2 * 2 * 2  # 2 MoE layers x (gate_up, down) x (A, B)
    assert all(isinstance(f, HostLoRALinear) for f in factors)  # moved at creation or before the first forward
    assert not any(isinstance(f, HostLoRALinear) for f in expert_lora_factors(runs["model"][0]))
    assert losses == runs["model"][1]
    got, want = runs["host"][0].state_dict(), runs["model"][0].state_dict()
    for name in (n for n, p in runs["model"][0].named_parameters() if p.requires_grad):
        assert torch.equal(got[name], want[name]), name


def test_dtype_moves_still_apply_to_host_factors(model_dir):
    model = with_lora(load(model_dir, "cpu", "host"))
    model.to(torch.float64)
    assert {p.dtype for p in expert_lora_params(model)} == {torch.float64}
    model.float()
    params = expert_lora_params(model)
    assert {p.dtype for p in params} == {torch.float32} and {p.device.type for p in params} == {"cpu"}
    assert keep_on_host(model) == 0  # already there: nothing to do again


def test_optimizer_steps_get_the_cores_and_give_them_back(monkeypatch):
    """The budget a model on a GPU gets (apply_budget: torch on the cores a one-thread pool leaves) is lifted for
    an optimizer step that updates host parameters, and only then, and comes back after it."""
    if usable_cores() < 2:
        pytest.skip("one usable core: there is nothing to raise the thread count to")
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_budget", None)  # the budget this test sets is undone with it
    give_optimizer_steps_the_cores()
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    seen = []
    optimizer.register_step_pre_hook(lambda *args: seen.append(torch.get_num_threads()))  # after the global hook
    try:
        torch.set_num_threads(usable_cores())
        budget = apply_budget([SimpleNamespace(num_threads=usable_cores() - 1)], "cuda")  # a pool of all but one
        assert budget == 1 and torch.get_num_threads() == 1
        param.grad = torch.ones(4)
        optimizer.step()
        assert seen == [rank_cores()] and torch.get_num_threads() == 1
        param.grad = None  # nothing to update on the host: the budget stays as it is
        optimizer.step()
        assert seen[-1] == 1
        torch.set_num_threads(1)
        monkeypatch.setattr(threads, "_budget", None)  # one thread the user chose, not ktcore: left alone
        param.grad = torch.ones(4)
        optimizer.step()
        assert seen[-1] == 1
    finally:
        torch.set_num_threads(before)


def test_several_processes_are_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        _refuse_distributed()
    assert "kt_expert_lora_device" in str(err.value) and "\n" not in str(err.value)


def test_host_adapter_files_are_peft_files(model_dir, tmp_path):
    for lora_device in ("model", "host"):
        model = with_lora(load(model_dir, "cpu", lora_device))
        train(model)
        model.save_pretrained(tmp_path / lora_device)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "host" / name).read_bytes() == (tmp_path / "model" / name).read_bytes(), name


# ---- CUDA: the model on the GPU, expert LoRA in host memory -------------------------------------------------------

def _cuda_backends():
    return [pytest.param(b, marks=pytest.mark.skipif(bool(backend_unusable(b)), reason=f"{b}: {backend_unusable(b)}"))
            for b in ("torch", "amx_bf16")]


def _updates(model, before) -> dict:
    return {n: p.detach().float().cpu() - before[n] for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("backend", _cuda_backends())
@pytest.mark.parametrize("through_ktcore", [True, False], ids=["peft_wrapping", "user-get_peft_model"])
def test_cuda_host_lora_trains_as_model_with_less_gpu_memory(model_dir, tmp_path, backend, through_ktcore):
    runs, peaks = {}, {}
    for lora_device in ("model", "host"):
        base = load(model_dir, "cuda", lora_device, backend, torch.bfloat16)
        model = with_lora(base, through_ktcore)
        model.to("cuda")  # what HF Trainer and accelerate do; the host factors stay where they are
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        runs[lora_device] = (model, *train(model, device="cuda"))
        torch.cuda.synchronize()
        peaks[lora_device] = torch.cuda.max_memory_allocated() - start
    model, losses, optimizer, before = runs["host"]
    expert = expert_lora_params(model)
    assert len(expert) == 8 and all(isinstance(f, HostLoRALinear) for f in expert_lora_factors(model))
    for p in expert:  # parameters, gradients and AdamW's state on the host
        assert p.device.type == "cpu" and p.grad is not None and p.grad.device.type == "cpu"
        assert p.grad.norm() > 0
        assert {t.device.type for t in optimizer.state[p].values() if t.dim()} == {"cpu"}
    others = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in expert)]
    assert others and {p.device.type for p in others} == {"cuda"}
    # the same arithmetic but for where AdamW runs: bf16 tolerance on the losses and on what training changed
    ref_losses = runs["model"][1]
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    ref_updates, updates = _updates(runs["model"][0], runs["model"][3]), _updates(model, before)
    for name, want in ref_updates.items():
        assert want.norm() > 0, name
        assert relative_error(updates[name], want) <= 1e-2, name
    lora_bytes = sum(p.numel() * p.element_size() for p in expert)
    assert peaks["model"] - peaks["host"] >= lora_bytes, (peaks, lora_bytes)

    # adapters: the same PEFT layout either way, each loading into a model of the other kind
    from safetensors import safe_open

    for lora_device, (m, *_rest) in runs.items():
        m.save_pretrained(tmp_path / lora_device)
    layouts = {}
    for lora_device in runs:
        with safe_open(str(tmp_path / lora_device / "adapter_model.safetensors"), "pt") as f:
            layouts[lora_device] = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert layouts["host"] == layouts["model"]
    ids = batches(1, "cuda")[0]
    for saved, loads_as in (("host", "model"), ("model", "host")):
        base = load(model_dir, "cuda", loads_as, backend, torch.bfloat16)
        with peft_wrapping(base):  # as ktcore's adapter loading does
            reloaded = PeftModel.from_pretrained(base, str(tmp_path / saved))
        if loads_as == "host":
            assert {p.device.type for p in expert_lora_params(reloaded)} == {"cpu"}
        with torch.no_grad():
            got = reloaded(input_ids=ids).logits.float()
            want = runs[saved][0].eval()(input_ids=ids).logits.float()
        assert relative_error(got, want) <= 1e-2, (saved, loads_as)


@pytest.mark.gpu
@pytest.mark.slow
@CUDA
def test_cuda_ktcore_train_trl_keeps_expert_lora_on_host(tmp_path):
    """``ktcore train --frontend trl`` (SFTTrainer: Trainer's model.to, accelerate's prepare, clipping, AdamW):
    every optimizer step sees the expert LoRA and its state on the host; losses and adapter as with ``model``."""
    from click.testing import CliRunner
    from safetensors.torch import load_file
    from test_train_e2e import _config
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ktcore.commands.cli import main
    from ktcore.commands.demo import build_byte_tokenizer, reverse_task

    model_path, data = tmp_path / "tiny", tmp_path / "data"
    tokenizer = build_byte_tokenizer()
    tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(model_path)
    tokenizer.save_pretrained(model_path)
    data.mkdir()
    (data / "rev.json").write_text(json.dumps(reverse_task(32, 0, seed=1, length=4)[0]))
    (data / "dataset_info.json").write_text(json.dumps({"rev": {"file_name": "rev.json"}}))
    seen, summaries = [], {}

    def record(optimizer, args, kwargs):
        seen.append(sorted({(p.device.type, *(t.device.type for t in optimizer.state[p].values() if t.dim()))
                            for g in optimizer.param_groups for p in g["params"]}))

    handle = register_optimizer_step_post_hook(record)
    try:
        for lora_device in ("model", "host"):
            seen.clear()
            run = tmp_path / f"run-{lora_device}"
            run.mkdir()
            cfg = _config(run, model_path, data, dataset="rev", max_steps=3, bf16=True, output_dir=str(run / "out"),
                          kt_config={"kt_backend": "torch", "kt_expert_lora_device": lora_device})
            result = CliRunner().invoke(main, ["train", str(cfg), "--frontend", "trl"])
            assert result.exit_code == 0, (result.output, result.exception)
            lines = result.stdout.splitlines()
            summaries[lora_device] = json.loads("\n".join(lines[max(i for i, x in enumerate(lines) if x == "{"):]))
            where = {("cpu", "cpu", "cpu")} if lora_device == "host" else set()
            assert len(seen) == 3 and all(where <= set(map(tuple, s)) for s in seen), seen
            assert all(("cuda", "cuda", "cuda") in set(map(tuple, s)) for s in seen), seen
    finally:
        handle.remove()
    host, model = summaries["host"]["losses"], summaries["model"]["losses"]
    assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(host, model)), (host, model)
    got = load_file(str(tmp_path / "run-host" / "out" / "adapter_model.safetensors"))
    want = load_file(str(tmp_path / "run-model" / "out" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(got[k].shape == want[k].shape and got[k].dtype == want[k].dtype
                                             for k in want)
