"""DPO through the TRL frontend on a tiny Qwen3-MoE whose routed experts run in ktcore's torch backend (fp32, CPU).

* the LLaMA-Factory demo preference data trains: loss falls, reward accuracy and margin rise;
* each ``pref_loss`` computes its own formula (checked by hand on the logged log-probs of real batches);
* the reference log-probs TRL uses during training are the base model's (a fresh ktcore model without PEFT),
  after the policy has moved -- and a reference that leaves expert LoRA on fails that comparison;
* ``precompute_ref_log_probs`` stores the same base-model log-probs before step one;
* gradient checkpointing with CPU experts runs each expert forward once (transformers' whole-layer
  checkpointing would run it twice).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

pytest.importorskip("trl", reason="the TRL frontend needs trl (pip install -e frontends/trl)")
pytest.importorskip("ktcore_trl", reason="the TRL frontend package is not installed (pip install -e frontends/trl)")

from ktcore_tiny import tiny_qwen3_moe  # noqa: E402
from ktcore.config import config_from_dict  # noqa: E402
from ktcore.commands.demo import build_byte_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

KT = {"use_kt": True, "kt_config": {"kt_backend": "torch"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe_dpo")
    tokenizer = build_byte_tokenizer()
    model = tiny_qwen3_moe(vocab_size=len(tokenizer), max_position_embeddings=256)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _cfg(tmp_path, model_dir, data_dir, **keys):
    base = dict(model_name_or_path=str(model_dir), stage="dpo", lora_target="all", lora_rank=8,
                dataset_dir=str(data_dir), dataset="dpo_en_demo", max_samples=8, template="default", cutoff_len=64,
                output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, learning_rate=3e-3, max_steps=6,
                lr_scheduler_type="constant", logging_steps=100, save_steps=1000, seed=0, pref_beta=0.1, **KT)
    base.update(keys)
    return config_from_dict(base, quiet=True)


def _train(cfg):
    """(trainer, summary-like params) after training, in this process."""
    from ktcore_trl import train

    tokenizer, dataset, resume = train.prepare(cfg)
    trainer, params = train.build_trainer(cfg, tokenizer, dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, params


def _mean(xs):
    return sum(xs) / len(xs)


def test_dpo_demo_data_learns(tmp_path, model_dir, shared_data):
    """Batch 2 x accumulation 2, attention-only checkpointing: the demo pairs are learnt."""
    from ktcore_trl.train import run

    cfg = _cfg(tmp_path, model_dir, shared_data, max_samples=16, max_steps=24, gradient_accumulation_steps=2,
               gradient_checkpointing=True)
    summary = run(cfg)
    assert summary["steps"] == 24 and summary["stage"] == "dpo" and summary["examples"] == 16
    losses, acc, margins = summary["losses"], summary["rewards_accuracies"], summary["rewards_margins"]
    k = 6
    print(f"DPO demo: loss {_mean(losses[:k]):.4f} -> {_mean(losses[-k:]):.4f}, reward accuracy "
          f"{_mean(acc[:k]):.3f} -> {_mean(acc[-k:]):.3f}, margin {_mean(margins[:k]):.4f} -> {_mean(margins[-k:]):.4f}")
    assert abs(losses[0] - math.log(2)) < 1e-2, "step one: policy == reference, so the sigmoid loss is ~log 2"
    assert _mean(losses[-k:]) < _mean(losses[:k]) - 0.05, losses
    assert _mean(acc[-k:]) > _mean(acc[:k]) + 0.2, acc
    assert _mean(margins[-k:]) > _mean(margins[:k]) + 0.1, margins
    assert summary["expert_lora_params"] > 0 and summary["tokens"] > 0 and summary["tokens_per_s"] > 0


def _hand_loss(kind: str, beta: float, mb: dict) -> float:
    """The per-pair preference loss formulas, computed here from the logged numbers (batch size 1: means ==
    values)."""
    chosen_ratio = mb["logps/chosen"] - mb["ref_chosen"][0]
    rejected_ratio = mb["logps/rejected"] - mb["ref_rejected"][0]
    delta = chosen_ratio - rejected_ratio
    if kind == "sigmoid":  # -log sigmoid(beta * delta)
        return math.log1p(math.exp(-beta * delta))
    if kind == "hinge":  # max(0, 1 - beta * delta)
        return max(0.0, 1.0 - beta * delta)
    if kind == "ipo":  # (length-normalised delta - 1 / (2 beta))^2, as TRL computes IPO
        ipo_delta = chosen_ratio / mb["chosen_tokens"][0] - rejected_ratio / mb["rejected_tokens"][0]
        return (ipo_delta - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_pref_loss_formula(tmp_path, model_dir, shared_data, kind):
    beta = 0.25
    trainer, _ = _train(_cfg(tmp_path, model_dir, shared_data, pref_loss=kind, pref_beta=beta,
                             per_device_train_batch_size=1, max_steps=4, max_samples=4))
    assert trainer.router_aux_loss_coef == 0.0  # DPO: the preference loss alone (as LLaMA-Factory's DPO)
    step_one = trainer.micro_batches[0]  # policy == reference: delta = 0
    assert step_one["loss"] == pytest.approx(_hand_loss(kind, beta, step_one), rel=1e-6)
    moved = [mb for mb in trainer.micro_batches if mb["step"] >= 2]
    assert moved
    for mb in moved:
        assert abs(mb["logps/chosen"] - mb["ref_chosen"][0]) > 1e-4, "the policy should have moved"
        preference = mb["loss"]
        assert preference == pytest.approx(_hand_loss(kind, beta, mb), rel=1e-5, abs=1e-6), (kind, mb)
        for other in {"sigmoid", "ipo", "hinge"} - {kind}:  # the formulas are really different
            assert abs(_hand_loss(other, beta, mb) - preference) > 1e-3


# ---- the reference --------------------------------------------------------------------------------------------


def _fresh_base(model_dir):
    import ktcore

    return ktcore.load_model(model_dir, config_from_dict(KT, quiet=True), dtype=torch.float32, progress=False).eval()


def _sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the completion tokens (chosen rows first, then rejected), from plain logits."""
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    token_logps = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (token_logps * completion[:, 1:]).sum(dim=1).chunk(2)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@contextlib.contextmanager
def _attention_lora_only_disabled(peft_model, adapter_name=None):
    """BROKEN on purpose: disables the LoRA of linear layers but leaves PEFT's expert LoRA (ParamWrapper) on."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def test_reference_is_the_base_model(tmp_path, model_dir, shared_data, monkeypatch):
    import trl.trainer.dpo_trainer as dpo_module

    trainer, _ = _train(_cfg(tmp_path, model_dir, shared_data, per_device_train_batch_size=3, max_steps=5,
                             learning_rate=5e-3, max_samples=6))
    ref = trainer.last_reference  # recorded during the last training step
    assert ref["input_ids"].shape[0] == 6  # batch of 3 pairs: chosen rows then rejected rows
    base = _fresh_base(model_dir)
    base_chosen, base_rejected = _sequence_logps(base, ref)
    err = max(_rel(ref["chosen"], base_chosen), _rel(ref["rejected"], base_rejected))
    trainer.model.eval()
    policy_chosen, _ = _sequence_logps(trainer.model, ref)
    moved = _rel(policy_chosen, base_chosen)
    print(f"reference vs fresh base model: rel err {err:.2e}; policy moved by {moved:.2e}")
    assert moved > 1e-3, "the policy must have moved for this comparison to mean something"
    assert err <= 1e-5

    # The broken variant: the same reference pass, but with expert LoRA left on. It must fail the comparison.
    batch = {k: ref[k] for k in ("input_ids", "attention_mask", "completion_mask")}
    monkeypatch.setattr(dpo_module, "use_adapter", _attention_lora_only_disabled)
    broken_chosen, broken_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
    broken_err = max(_rel(broken_chosen, base_chosen), _rel(broken_rejected, base_rejected))
    print(f"broken reference (expert LoRA left on): rel err {broken_err:.2e}")
    assert broken_err > 1e-5 * 100, "leaving expert LoRA on must visibly break the reference"
    monkeypatch.undo()
    # and the right context on the same batch, after the broken call, is the base model again
    fixed_chosen, _ = trainer.compute_ref_log_probs(trainer.model, batch)
    assert _rel(fixed_chosen, base_chosen) <= 1e-5


def test_precomputed_reference_is_the_base_model(tmp_path, model_dir, shared_data):
    cfg = _cfg(tmp_path, model_dir, shared_data, precompute_ref_log_probs=True, per_device_train_batch_size=2,
               max_steps=3, max_samples=4)
    trainer, _ = _train(cfg)
    columns = trainer.train_dataset.column_names
    assert "ref_chosen_logps" in columns and "ref_rejected_logps" in columns
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    base_chosen, base_rejected = _sequence_logps(_fresh_base(model_dir), batch)
    stored_chosen = torch.tensor(trainer.train_dataset["ref_chosen_logps"][:4])
    stored_rejected = torch.tensor(trainer.train_dataset["ref_rejected_logps"][:4])
    assert max(_rel(stored_chosen, base_chosen), _rel(stored_rejected, base_rejected)) <= 1e-5
    # training used them: every micro-batch's reference values are the stored ones
    stored = set(round(v, 4) for v in trainer.train_dataset["ref_chosen_logps"])
    assert all(round(v, 4) in stored for mb in trainer.micro_batches for v in mb["ref_chosen"])


# ---- gradient checkpointing with CPU experts ----------------------------------------------------------------


def _counting_model(model_dir, how: str):
    """A ktcore model + expert LoRA, with checkpointing ``how`` (none, ktcore, transformers); counts expert calls."""
    from peft import get_peft_model

    from ktcore_trl.train import lora_config

    from ktcore.model.checkpointing import checkpoint_non_experts

    cfg = config_from_dict({**KT, "lora_target": "all", "kt_cpu_activation": "retain"}, quiet=True)
    base = _fresh_base(model_dir)
    if how == "ktcore":
        assert checkpoint_non_experts(base) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    elif how == "transformers":
        base.gradient_checkpointing_enable({"use_reentrant": False})
    torch.manual_seed(0)  # the same LoRA A init in every variant
    model = get_peft_model(base, lora_config(base, cfg))
    with torch.no_grad():  # non-zero LoRA B so every LoRA factor gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    calls = {"forward": 0, "backward": 0}
    backend = base.ktcore.backend
    forward, backward = backend.forward, backend.backward

    def count_forward(*args, **kwargs):
        calls["forward"] += 1
        return forward(*args, **kwargs)

    def count_backward(*args, **kwargs):
        calls["backward"] += 1
        return backward(*args, **kwargs)

    backend.forward, backend.backward = count_forward, count_backward
    return model, calls, (backend, forward, backward)


def _step(model):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_runs_cpu_experts_once(model_dir):
    # torch stops a non-reentrant recompute early once every saved tensor is back; in Qwen3-MoE nothing after
    # the routed experts saves a tensor, so whole-layer recompute happens to stop before them. Architectures with
    # work after the experts (DeepSeek's shared experts) run them again; early stop off shows that case here.
    from torch.utils.checkpoint import set_checkpoint_early_stop

    results = {}
    for how in ("none", "ktcore", "transformers"):
        model, calls, (backend, forward, backward) = _counting_model(model_dir, how)
        try:
            with set_checkpoint_early_stop(False):
                results[how] = (*_step(model), dict(calls))
        finally:
            backend.forward, backend.backward = forward, backward
    loss, grads, calls = results["none"]
    assert calls == {"forward": 2, "backward": 2}  # two MoE layers
    k_loss, k_grads, k_calls = results["ktcore"]
    assert k_calls == calls, "ktcore's checkpointing must not re-run the CPU experts (they are replayed)"
    assert k_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == k_grads.keys() and any("experts" in n for n in grads)
    for name in grads:
        torch.testing.assert_close(k_grads[name], grads[name], rtol=1e-5, atol=1e-7)
    t_calls = results["transformers"][2]
    print(f"CPU expert forwards per step: none {calls['forward']}, ktcore checkpointing {k_calls['forward']}, "
          f"transformers' whole-layer checkpointing {t_calls['forward']}")
    assert t_calls["forward"] == 2 * calls["forward"], "what the frontend avoids: whole-layer recompute"


# ---- bad DPO input: one line, before any model is loaded ----------------------------------------------------


@pytest.mark.parametrize("keys, expected", [
    ({"dataset": "identity"}, "dataset 'identity' is an SFT dataset but stage 'dpo' needs preference pairs"),
    ({"cutoff_len": 1}, "no preference pair keeps two different answers after cutoff_len=1"),
    ({"pref_beta": 0.0}, "pref_beta must be > 0"),
])
def test_bad_dpo_inputs(tmp_path, model_dir, shared_data, monkeypatch, keys, expected):
    import ktcore_trl.train as train
    from ktcore.config import ConfigError
    from ktcore.frontends import run_frontend

    def refuse(cfg):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(train, "load_base_model", refuse)
    with pytest.raises(ConfigError) as err:
        run_frontend("trl", _cfg(tmp_path, model_dir, shared_data, **keys))
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)
