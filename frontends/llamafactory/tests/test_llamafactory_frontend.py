"""The LLaMA-Factory frontend end to end: LLaMA-Factory's run_exp trains SFT and DPO on a ktcore model.

Runs in .venv-llamafactory (scripts/setup_llamafactory.sh); elsewhere every test skips with the reason.
"""

import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import base_keys, write_yaml


def _run(tmp_path, **keys):
    from ktcore.config import load_config
    from ktcore_llamafactory.train import run_with_trainer

    cfg = load_config(write_yaml(tmp_path / "train.yaml", **keys))
    return run_with_trainer(cfg)


def _mean(xs):
    return sum(xs) / len(xs)


# ---- plumbing that needs no training --------------------------------------------------------------------------


def test_plugin_registered_lazily():
    from ktcore.frontends import resolve_frontend

    spec = resolve_frontend("llamafactory")
    assert spec.stages == ("sft", "dpo") and spec.run == "ktcore_llamafactory.train:run"


def test_use_kt_env(monkeypatch):
    from ktcore.config import config_from_dict
    from ktcore_llamafactory.train import apply_env

    cfg = config_from_dict({"use_kt": False}, quiet=True)
    monkeypatch.delenv("USE_KT", raising=False)
    assert apply_env(cfg).use_kt is False
    monkeypatch.setenv("USE_KT", "1")
    assert apply_env(cfg).use_kt is True


def test_unsupported_stage_and_precompute_fail_before_loading(tmp_path, tiny_model_dir, shared_data):
    from ktcore.config import ConfigError, config_from_dict
    from ktcore_llamafactory.train import check_config

    cfg = config_from_dict(base_keys(tiny_model_dir, shared_data, tmp_path / "out", stage="dpo",
                                     precompute_ref_log_probs=True), quiet=True)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs"):
        check_config(cfg)
    cfg = config_from_dict(base_keys(tmp_path / "nowhere", shared_data, tmp_path / "out"), quiet=True)
    with pytest.raises(ConfigError, match="model_name_or_path"):
        check_config(cfg)


def test_integration_surface(tiny_model_dir):
    """load_kt_pretrained_model(config, model_args), get_kt_peft_model(model, peft_kwargs),
    load_kt_peft_model(model_args, model): the names LLaMA-Factory's KT releases call, backed by ktcore."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    import ktcore_llamafactory as kl

    model_args = SimpleNamespace(model_name_or_path=str(tiny_model_dir), compute_dtype=torch.float32,
                                 adapter_name_or_path=None)
    model = kl.load_kt_pretrained_model(AutoConfig.from_pretrained(tiny_model_dir), model_args)
    assert getattr(model, "ktcore", None) is not None  # routed experts live in the ktcore backend
    peft_model = kl.get_kt_peft_model(model, {"r": 4, "target_modules": ["all"], "lora_alpha": 8,
                                              "lora_dropout": 0.0})
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any(".experts." in n for n in names) and any("q_proj" in n for n in names)


# ---- training ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir, shared_data):
    tmp = tmp_path_factory.mktemp("sft")
    keys = base_keys(tiny_model_dir, shared_data, tmp / "out", dataset="identity,alpaca_en_demo", max_samples=8,
                     max_steps=24, plot_loss=True)
    summary, trainer = _run(tmp, **keys)
    return summary, trainer, keys


def test_run_prints_no_model_config(tmp_path, tiny_model_dir, shared_data):
    """LLaMA-Factory's default INFO logging dumped the model config at every config load (4 times before the
    first step); the frontend runs it at WARN unless LLAMAFACTORY_VERBOSITY says otherwise. A subprocess: what a
    user of `ktcore train --frontend llamafactory` sees on the terminal."""
    import os
    import subprocess
    import sys

    keys = base_keys(tiny_model_dir, shared_data, tmp_path / "out", dataset="identity", max_samples=4, max_steps=2)
    config = write_yaml(tmp_path / "train.yaml", **keys)
    env = {k: v for k, v in os.environ.items() if k != "LLAMAFACTORY_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-m", "ktcore.commands.cli", "train", str(config), "--frontend",
                           "llamafactory"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Model config" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "loading configuration file" not in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_sft_loss_falls(sft_run):
    summary, _, _ = sft_run
    losses = summary["losses"]
    assert summary["frontend"] == "llamafactory" and summary["steps"] == 24 and len(losses) == 24
    assert all(math.isfinite(x) for x in losses)
    assert _mean(losses[-4:]) < 0.85 * _mean(losses[:4]), losses
    assert summary["expert_lora_params"] > 0 and summary["kt_backend"]
    assert Path(summary["loss_plot"]).is_file()


def test_sft_adapter_loads_back(sft_run):
    """The saved adapter (expert LoRA included) loads into a fresh ktcore model and into plain transformers +
    PEFT, and both give the trained model's logits."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    import ktcore
    from ktcore_llamafactory.integration import load_kt_peft_model

    summary, trainer, keys = sft_run
    out = Path(summary["output_dir"])
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        saved = list(f.keys())
    assert any("experts" in k for k in saved) and any("q_proj" in k for k in saved)

    ids = torch.tensor([[5, 77, 100, 32, 200, 66, 101, 44, 12, 90]])
    trained = trainer.model.eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits

        from types import SimpleNamespace

        base = ktcore.load_model(keys["model_name_or_path"], {"kt_backend": "torch"}, dtype=torch.float32,
                                 progress=False)
        reloaded = load_kt_peft_model(SimpleNamespace(adapter_name_or_path=[str(out)]), base, is_trainable=False)
        got_kt = reloaded(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(keys["model_name_or_path"], dtype=torch.float32)
        got_plain = PeftModel.from_pretrained(plain, str(out)).eval()(input_ids=ids).logits
        plain_base = AutoModelForCausalLM.from_pretrained(keys["model_name_or_path"], dtype=torch.float32)
        untrained = plain_base(input_ids=ids).logits
    assert (want - untrained).abs().max() > 1e-2  # the adapter changed the model
    torch.testing.assert_close(got_kt, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_plain, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["fused_expert", "gguf"])
def test_load_kt_peft_model_reads_every_adapter_format(sft_run, tmp_path, fmt):
    """The trained adapter converted to the fused-expert directory or a GGUF LoRA file loads through
    load_kt_peft_model (ktcore's adapter dispatch) and gives the trained model's logits."""
    from types import SimpleNamespace

    import ktcore
    from ktcore import adapters
    from ktcore_llamafactory.integration import load_kt_peft_model

    summary, trainer, keys = sft_run
    base_dir = keys["model_name_or_path"]
    dst = tmp_path / ("adapter.gguf" if fmt == "gguf" else "adapter")
    adapters.convert(summary["output_dir"], dst, fmt, base=base_dir)
    assert adapters.sniff(dst) == fmt
    ids = torch.tensor([[5, 77, 100, 32, 200, 66, 101, 44, 12, 90]])
    with torch.no_grad():
        want = trainer.model.eval()(input_ids=ids).logits
        base = ktcore.load_model(base_dir, {"kt_backend": "torch"}, dtype=torch.float32, progress=False)
        args = SimpleNamespace(adapter_name_or_path=[str(dst)], model_name_or_path=base_dir)
        got = load_kt_peft_model(args, base, is_trainable=False)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, tiny_model_dir, shared_data):
    tmp = tmp_path_factory.mktemp("dpo")
    keys = base_keys(tiny_model_dir, shared_data, tmp / "out", stage="dpo", dataset="dpo_en_demo", max_samples=8,
                     per_device_train_batch_size=4, max_steps=16, pref_beta=0.1, pref_loss="sigmoid",
                     learning_rate=5e-3, cutoff_len=192)
    summary, trainer = _run(tmp, **keys)
    return summary, trainer, keys


def test_dpo_rewards_rise(dpo_run):
    summary, _, _ = dpo_run
    losses, acc, margins = summary["losses"], summary["reward_accuracies"], summary["reward_margins"]
    assert summary["steps"] == 16 and len(losses) == 16
    assert abs(losses[0] - math.log(2)) < 1e-5  # step one: policy == reference
    assert _mean(losses[-4:]) < losses[0] - 0.05, losses
    assert _mean(acc[-4:]) > _mean(acc[:2]), acc
    assert _mean(margins[-4:]) > _mean(margins[:2]) + 0.05, margins
    assert summary["expert_lora_params"] > 0


@contextmanager
def _expert_lora_left_on(model):
    """The deliberately broken reference: PEFT disables every adapter, then expert LoRA is switched back on."""
    from peft.tuners.lora.layer import ParamWrapper

    with model.disable_adapter():
        wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
        assert wrappers, "no expert LoRA in the model"
        for m in wrappers:
            m.enable_adapters(True)
        yield


def _reference_matches_base(trainer, base_model, batch, broken=False) -> float:
    """Largest relative error between the trainer's reference log-probs and the base model's."""
    model = trainer.model
    with torch.no_grad():
        if broken:
            with _expert_lora_left_on(model):
                out = trainer.concatenated_forward(model, batch, is_ref_model=True)
            ref = (out["chosen_logps"], out["rejected_logps"])
        else:
            ref = trainer.compute_reference_log_probs(model, batch)
        want = trainer.concatenated_forward(base_model, batch, is_ref_model=True)
    err = 0.0
    for got, exp in zip(ref, (want["chosen_logps"], want["rejected_logps"])):
        err = max(err, float(((got - exp).abs() / exp.abs().clamp_min(1e-12)).max()))
    return err


def test_dpo_reference_is_base_model(dpo_run):
    """After the policy has moved, LLaMA-Factory's reference (the PEFT model under disable_adapter()) gives the
    base model's log-probs: every adapter off, expert LoRA included. Leaving expert LoRA on fails the check."""
    import ktcore

    summary, trainer, keys = dpo_run
    model = trainer.model.eval()
    lora_b = [p for n, p in model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert lora_b and max(float(p.detach().abs().max()) for p in lora_b) > 0  # expert LoRA has moved
    base = ktcore.load_model(keys["model_name_or_path"], {"kt_backend": "torch"}, dtype=torch.float32,
                             progress=False).eval()
    batch = next(iter(trainer.get_train_dataloader()))
    batch = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    assert _reference_matches_base(trainer, base, batch) <= 1e-5
    broken = _reference_matches_base(trainer, base, batch, broken=True)
    assert broken > 1e-4, f"expert LoRA left on should move the log-probs, relative error {broken}"


# ---- this environment and LLaMA-Factory's pinned transformers ------------------------------------------------


def test_native_backends_and_adapter_formats_are_installed_here():
    """The LLaMA-Factory environment gets the plugins that do not link torch, as .venv does: kt_backend amx_bf16
    or llamafile works here, and ktcore chat reads every adapter format."""
    from ktcore.plugins import get_registry

    registry = get_registry()
    assert {"amx_bf16", "llamafile"} <= set(registry.specs("expert_backend"))
    assert {"peft", "fused_expert", "gguf"} <= set(registry.specs("adapter_format"))


def test_a_second_load_with_the_same_config_object(tiny_model_dir):
    """LLaMA-Factory may build twice from one patched config: the first load must leave it as it was."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    import ktcore_llamafactory as kl

    config = AutoConfig.from_pretrained(tiny_model_dir)
    model_args = SimpleNamespace(model_name_or_path=str(tiny_model_dir), compute_dtype=torch.float32,
                                 adapter_name_or_path=None)
    first = kl.load_kt_pretrained_model(config, model_args)
    second = kl.load_kt_pretrained_model(config, model_args)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(first(ids).logits, second(ids).logits, rtol=0, atol=0)


def test_deepseek_v2_with_group_limited_greedy_routing_trains(tmp_path):
    """DeepSeek-V2's group-limited routing through LLaMA-Factory's transformers: a LoRA step runs and gives the
    expert LoRA gradients (transformers 5.6.0's router reads a num_experts its MoE block lacks)."""
    from types import SimpleNamespace

    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    import ktcore_llamafactory as kl

    config = DeepseekV2Config(vocab_size=64, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
                              topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(tmp_path / "dsv2")
    model_args = SimpleNamespace(model_name_or_path=str(tmp_path / "dsv2"), compute_dtype=torch.float32,
                                 adapter_name_or_path=None)
    model = kl.load_kt_pretrained_model(DeepseekV2Config.from_pretrained(tmp_path / "dsv2"), model_args)
    peft_model = kl.get_kt_peft_model(model, {"r": 4, "target_modules": ["all"], "lora_alpha": 8,
                                              "lora_dropout": 0.0})
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    peft_model(ids, labels=ids).loss.backward()
    # lora_B starts at zero (PEFT's init), so the first step moves B: its gradient is nonzero on every expert LoRA
    b_grads = [p.grad for n, p in peft_model.named_parameters() if ".experts." in n and "lora_B" in n]
    assert len(b_grads) == 2 and all(g is not None and torch.count_nonzero(g) > 0 for g in b_grads)


def test_llamafactory_keys_reach_llamafactory(tmp_path, tiny_model_dir, shared_data, monkeypatch):
    """A LLaMA-Factory key ktcore has none of its own for goes to LLaMA-Factory's own argument parser as given."""
    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")  # as the frontend runs it (peft 0.21, see the setup script)
    from llamafactory.hparams import get_train_args

    from ktcore.config import config_from_dict
    from ktcore_llamafactory.train import llamafactory_args

    cfg = config_from_dict(base_keys(tiny_model_dir, shared_data, tmp_path / "out", flash_attn="disabled",
                                     adam_beta2=0.95), quiet=True)
    model_args, _, training_args, *_ = get_train_args(llamafactory_args(cfg))
    assert model_args.flash_attn == "disabled" and training_args.adam_beta2 == 0.95


def test_the_key_list_is_the_installed_llamafactorys(monkeypatch):
    import dataclasses

    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")
    import llamafactory
    import llamafactory.hparams as hparams

    from ktcore.llamafactory_keys import LLAMAFACTORY_KEYS, LLAMAFACTORY_VERSION

    classes = ("ModelArguments", "DataArguments", "TrainingArguments", "FinetuningArguments", "GeneratingArguments",
               "EvaluationArguments", "RayArguments")
    installed = {f.name for c in classes for f in dataclasses.fields(getattr(hparams, c)) if f.init}
    assert llamafactory.__version__ == LLAMAFACTORY_VERSION
    assert installed == LLAMAFACTORY_KEYS  # scripts/llamafactory_keys.py prints the installed set


def test_deepseek_v2_dense_and_shared_mlp_lora(tmp_path):
    """`gate_proj`/`up_proj`/`down_proj` in LLaMA-Factory's lora_target, on a DeepSeek-V2 (whose transformers-4
    names PEFT would move onto the routed experts): rank-r LoRA on the dense MLP's and the shared experts' Linears,
    beside the routed experts', all with gradients, saved under the Linears' own keys."""
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    import ktcore_llamafactory as kl

    config = DeepseekV2Config(vocab_size=64, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(tmp_path / "dsv2")
    model_args = SimpleNamespace(model_name_or_path=str(tmp_path / "dsv2"), compute_dtype=torch.float32,
                                 adapter_name_or_path=None)
    model = kl.load_kt_pretrained_model(DeepseekV2Config.from_pretrained(tmp_path / "dsv2"), model_args)
    peft_model = kl.get_kt_peft_model(model, {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules":
                                              ["q_proj", "gate_proj", "up_proj", "down_proj", "experts"]})
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    peft_model(ids, labels=ids).loss.backward()
    peft_model.save_pretrained(tmp_path / "adapter")
    state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_B" in n}
    for module in ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj",
                   "layers.1.mlp.shared_experts.gate_proj", "layers.1.mlp.shared_experts.down_proj"):
        assert state[f"base_model.model.model.{module}.lora_A.weight"].shape[0] == 4, module
        grad = next(g for n, g in grads.items() if f".{module}." in n)
        assert grad is not None and torch.count_nonzero(grad) > 0, module
    assert state["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"].shape[0] == 4 * 8
