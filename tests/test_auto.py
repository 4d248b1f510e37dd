"""``auto`` placement and the hybrid re-balancer (``ktcore/model/auto.py``).

Oracles: brute force over every split for the cost model's choice; the best fixed placement at each tokens/step
(the issue's 5% rule); a synthetic machine whose true times are known for the re-balancer (it must reach that
machine's best split and stay there); the ``cpu`` placement of the same weights and adapter for the training
signal of every choice (CPU, and on CUDA within bf16 tolerance of the fp32 truth)."""

import copy
import json
import math
import random
import types
from dataclasses import dataclass, replace

import pytest
import torch
from peft import get_peft_model
from test_equivalence import (assert_as_close_as_plain_bf16, assert_same_training_signal, batch, lora_config,
                              peft_pair, tiny_model_of)

import ktcore
from ktcore.commands.bench_train import SHAPES, make_config
from ktcore.model.auto import FEWEST, MODEL, MOST, TRIAL_STEPS, AutoLayer, AutoPlacement, _Call
from ktcore.model.checkpointing import checkpoint_non_experts
from ktcore.model.cost import (GIB, LayerTimes, Rates, Setting, _host_memory, auto_split, choice_name, layer_times,
                               load_rates, predict)
from ktcore.model.shape import model_shape

# a machine where the choice follows the tokens on the tiny models: the CPU wins at a few tokens, the (slow) bus
# with its fixed copy wins at many; no fixed GPU time per layer
SWITCHING = {"cpu_expert_gflops": 1.0, "dram_gbps": 100.0, "cpu_cores": 2, "h2d_gbps": 0.01, "gpu_tflops": 1.0,
             "gpu_layer_ms": 0.0}
H200 = load_rates("examples/rates/h200.json")


def model_choice(auto, state, tokens):
    """The cost model's split of a call: outside training no step is tried (``StepTrials``)."""
    with torch.no_grad():
        return auto.decide(state, tokens)


@pytest.fixture(scope="module")
def dsv2lite():
    return model_shape(make_config(SHAPES["deepseek-v2-lite"], layers=6))


def rates_file(tmp_path, **values):
    text = json.dumps({**SWITCHING, **values})
    path = tmp_path / f"rates-{len(list(tmp_path.glob('rates-*')))}.json"
    path.write_text(text)
    return str(path)


# -- the cost model's choice ---------------------------------------------------------------------------------------
def test_best_split_is_the_minimum_over_every_split():
    rng = random.Random(0)
    for _ in range(500):
        times = LayerTimes(*(rng.uniform(0, 1) * rng.choice([1e-3, 1, 1e3]) for _ in range(4)))
        experts = rng.choice([2, 8, 64, 256])
        lo = rng.randrange(experts)
        hi = rng.randrange(lo, experts + 1)
        n, seconds = times.best_split(experts, lo, hi)
        assert lo <= n <= hi
        assert seconds == pytest.approx(min(times.at(m / experts) for m in range(lo, hi + 1)), rel=1e-12)


def test_auto_takes_more_of_the_cpu_at_few_tokens(dsv2lite):
    """H200 rates, DeepSeek-V2-Lite: the CPU's share falls as the tokens grow (its time grows with them, the
    copies do not), down to gpu_stream at 32K."""
    shares = [predict(dsv2lite, Setting(tokens=t), H200, "auto").cpu_share for t in (64, 512, 2048, 8192, 32768)]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0.4 and shares[-1] == 0.0
    assert predict(dsv2lite, Setting(tokens=32768), H200, "auto").choice == "gpu_stream"


@pytest.mark.parametrize("rates", [H200, Rates(cpu_expert_gflops=10, dram_gbps=10, cpu_cores=2, h2d_gbps=50,
                                                gpu_tflops=500),
                                   Rates(cpu_expert_gflops=1e6, dram_gbps=1e4, cpu_cores=64, h2d_gbps=0.1,
                                         gpu_tflops=500)], ids=["h200", "slow-cpu", "slow-bus"])
def test_auto_is_within_5_percent_of_the_best_fixed_placement(dsv2lite, rates):
    """At every tokens/step, auto (a run switching between them, through the re-balancer's hysteresis) against
    cpu, gpu_stream and hybrid at every fixed share a run can take (speed only: GPU memory unbounded here)."""
    rates = replace(rates, gpu_mem_gib=None)
    auto = AutoPlacement(dsv2lite, Setting(tokens=4096), rates)
    experts = dsv2lite.experts
    state = AutoLayer("layer", 0, experts, 0, experts, types.SimpleNamespace(timeline=None))
    auto.add(state)
    for tokens in (16, 2048, 32768, 512, 8192, 2048, 64, 131072, 4096):
        step = Setting(tokens=tokens)
        fixed = [predict(dsv2lite, step, rates, "cpu").step_s, predict(dsv2lite, step, rates, "gpu_stream").step_s]
        times = layer_times(dsv2lite, step, rates)
        other = (dsv2lite.layers - dsv2lite.moe_layers) * times.dense_s
        fixed += [other + dsv2lite.moe_layers * times.at(n / experts) for n in range(1, experts)]
        n = model_choice(auto, state, tokens)
        chosen = other + dsv2lite.moe_layers * times.at(n / experts)
        assert chosen <= 1.05 * min(fixed), (tokens, choice_name(n, experts))
        assert predict(dsv2lite, step, rates, "auto").step_s <= min(fixed) * (1 + 1e-12)


def test_auto_narrows_to_what_host_ram_holds_twice(dsv2lite):
    """Host RAM between one and two copies of the experts: a window of experts held twice that fits, centred on
    the best split; below one copy nothing fits."""
    step, experts = Setting(tokens=2048), dsv2lite.experts
    both = _host_memory(dsv2lite, step, 1.0, 1.0, 1.0) / GIB
    one = predict(dsv2lite, step, H200, "hybrid").host_gib
    cost, lo, hi = auto_split(dsv2lite, step, replace(H200, host_ram_gib=(both + one) / 2))
    assert 0 < hi - lo < experts and lo <= round(cost.cpu_share * experts) <= hi
    assert cost.fits and cost.host_gib <= (both + one) / 2 and "host RAM holds both copies" in cost.choice
    free, _, _ = auto_split(dsv2lite, step, H200)
    assert cost.step_s <= free.step_s * 1.05  # the window holds the best split at these tokens
    assert (auto_split(dsv2lite, step, H200)[1:]) == (0, experts)
    starved, _, _ = auto_split(dsv2lite, step, replace(H200, host_ram_gib=one * 0.5))
    assert not starved.fits and "host RAM" in starved.why_not


# -- the re-balancer -------------------------------------------------------------------------------------------------
class Clock:
    """The synthetic machine's clock: ``feed`` advances it by each step's true time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def feed(auto, state, tokens, truth: LayerTimes, noise=None):
    """One call on a synthetic machine whose times are ``truth``: the backend's seconds for the CPU's share
    (forward + backward), the GPU's forward of its share and the copy of its experts, as the layer measures them."""
    n = auto.decide(state, tokens)
    share = n / state.experts
    jitter = (lambda: 1 + noise.uniform(-0.05, 0.05)) if noise else (lambda: 1.0)
    auto.clock.now += truth.at(share) * jitter()  # the step's time: the layer is the whole model
    if n:
        state.cpu_calls.append((tokens, n))
        state.layer.timeline.cpu_span("experts", share * truth.cpu_s * jitter())
    if n < state.experts:
        state.gpu_calls.append(_Call(tokens, n, (1 - share) * truth.compute_s / 2 * jitter(),
                                     (n, (1 - share) * truth.copy_s / 2 * jitter())))
    return n


def rebalanced(shape, rates):
    auto = AutoPlacement(shape, Setting(tokens=4096), rates)
    auto.clock = Clock()
    state = AutoLayer("layer", 0, shape.experts, 1, shape.experts - 1, types.SimpleNamespace(timeline=None))
    auto.add(state)
    return auto, state


def test_rebalancer_converges_to_the_machines_split_without_oscillating(dsv2lite):
    """The rates make the CPU 4x slower and the copies and GPU 2x faster than this machine's: the split starts far
    off (11 of 64 experts on the CPU against the machine's 41), moves monotonically to the machine's best split
    and stays there."""
    auto, state = rebalanced(dsv2lite, H200)
    tokens = 2048
    model = layer_times(dsv2lite, Setting(tokens=tokens), H200)
    truth = model.scaled(cpu=0.25, copy=2.0, compute=2.0)
    best, best_s = truth.best_split(dsv2lite.experts, 1, dsv2lite.experts - 1)
    splits = [feed(auto, state, tokens, truth) for _ in range(30)]
    assert abs(splits[0] - best) >= 5  # it started far from the answer
    assert truth.at(splits[-1] / dsv2lite.experts) <= best_s * 1.02
    assert len(set(splits[15:])) == 1  # settled
    moves = [b - a for a, b in zip(splits, splits[1:]) if b != a]
    assert all(m < 0 for m in moves) or all(m > 0 for m in moves)  # one direction: no overshoot
    factors = state.factors.get(tokens)
    assert factors["cpu"] == pytest.approx(0.25, rel=0.02) and factors["copy"] == pytest.approx(2.0, rel=0.02)


def test_rebalancer_holds_still_under_noise(dsv2lite):
    """+-5% noise on every timing: within 5% of the machine's best split, and few changes once settled."""
    auto, state = rebalanced(dsv2lite, H200)
    tokens = 8192
    truth = layer_times(dsv2lite, Setting(tokens=tokens), H200).scaled(cpu=0.5, copy=1.5, compute=1.0)
    _, best_s = truth.best_split(dsv2lite.experts, 1, dsv2lite.experts - 1)
    noise = random.Random(1)
    splits = [feed(auto, state, tokens, truth, noise) for _ in range(60)]
    assert all(truth.at(n / dsv2lite.experts) <= best_s * 1.05 for n in splits[20:])
    assert sum(a != b for a, b in zip(splits[20:], splits[21:])) <= 4


@dataclass(frozen=True)
class SplitCost(LayerTimes):
    """A machine where splitting a layer costs what no part shows (the CPU share slowed by the copies, the host
    thread that launches the GPU's work starved by the backend's pool): ``split_s`` more per step."""

    split_s: float = 0.0

    def at(self, share: float) -> float:
        return super().at(share) + (self.split_s if 0 < share < 1 else 0.0)


def test_measured_steps_overrule_the_cost_model(dsv2lite):
    """On the H200 machine the cost model's hybrid splits at 2K tokens ran 1.8x slower than gpu_stream, which every
    part's factor missed. On a synthetic machine with such a cost, auto tries gpu_stream (the window's end with the
    fewest CPU experts) and its own splits for TRIAL_STEPS steps each, skips cpu (predicted over PRUNE times
    slower), keeps gpu_stream and says so once; calls outside training neither count nor change the trial."""
    tokens, experts = 2048, dsv2lite.experts
    auto = AutoPlacement(dsv2lite, Setting(tokens=4096), H200)
    auto.clock = Clock()
    state = AutoLayer("layer", 0, experts, 0, experts, types.SimpleNamespace(timeline=None))
    auto.add(state)
    truth = SplitCost(*vars(layer_times(dsv2lite, Setting(tokens=tokens), H200)).values(), split_s=0.025)
    assert auto.candidates(tokens) == [FEWEST, MODEL]
    assert 0 < model_choice(auto, state, tokens) < experts  # the cost model alone would split
    splits = []
    for step in range(3 * TRIAL_STEPS):
        splits.append(feed(auto, state, tokens, truth))
        outside = model_choice(auto, state, tokens)  # an evaluation: the kept policy, else the cost model's
        assert outside == 0 if auto.trials.kept else 0 < outside < experts
    assert splits[:TRIAL_STEPS] == [0] * TRIAL_STEPS and all(0 < n < experts for n in splits[TRIAL_STEPS:-3])
    assert splits[-3:] == [0, 0, 0] and auto.trials.kept == {11: FEWEST}
    assert truth.at(0) < truth.at(splits[TRIAL_STEPS] / experts)
    assert auto.trials.verdict(tokens).endswith(f": keeps {FEWEST}") and MODEL in auto.trials.verdict(tokens)


def test_splits_that_do_not_fit_the_gpu_are_not_taken(dsv2lite):
    """A GPU whose memory holds the step only with most experts on the CPU: the split stays at or above the fewest
    CPU experts that fit, although streaming more would be faster."""
    tokens, experts = 8192, dsv2lite.experts
    free = AutoPlacement(dsv2lite, Setting(tokens=4096), H200)
    state = AutoLayer("layer", 0, experts, 0, experts, types.SimpleNamespace(timeline=None))
    free.add(state)
    fast = model_choice(free, state, tokens)
    limit = (predict(dsv2lite, Setting(tokens=tokens), H200, "cpu").gpu_gib
             + predict(dsv2lite, Setting(tokens=tokens), H200, "gpu_stream").gpu_gib) / 2
    tight = AutoPlacement(dsv2lite, Setting(tokens=4096), replace(H200, gpu_mem_gib=limit))
    state = AutoLayer("layer", 0, experts, 0, experts, types.SimpleNamespace(timeline=None))
    tight.add(state)
    n = model_choice(tight, state, tokens)
    floor = tight.gpu_floor(tokens, 0, experts)
    assert fast < floor <= n < experts
    step = Setting(tokens=tokens)
    gpu = predict(dsv2lite, step, H200, "cpu").gpu_gib + (1 - n / experts) * (
        predict(dsv2lite, step, H200, "gpu_stream").gpu_gib - predict(dsv2lite, step, H200, "cpu").gpu_gib)
    assert gpu <= limit * 1.001  # GPU memory is linear in the share between the two ends


def test_factor_steps_are_bounded(dsv2lite):
    auto, state = rebalanced(dsv2lite, H200)
    state.factors.observe(2048, "cpu", 100.0)
    assert state.factors.get(2048)["cpu"] == 2.0
    assert state.factors.get(8192)["cpu"] == 2.0  # the nearest measured tokens until these are measured
    state.factors.observe(8192, "cpu", 0.01)
    assert state.factors.get(8192)["cpu"] == 1.0 and state.factors.get(2048)["cpu"] == 2.0


# -- the model: every choice trains as the cpu placement does -------------------------------------------------------
def auto_model(plain, tmp_path, placement="auto", **kt):
    return ktcore.wrap_model(copy.deepcopy(plain), {"kt_config": {
        "kt_backend": "torch", "kt_expert_placement": placement, "kt_rates": rates_file(tmp_path), **kt}})


@pytest.mark.parametrize("family,ring", [("qwen3_moe", 1), ("deepseek_v2", 2)])
def test_every_choice_matches_the_cpu_placement(tmp_path, family, ring):
    """cpu, gpu_stream and hybrid splits (both copies of every expert), forced in turn on the same PEFT model, and
    the choice the cost model makes itself: the same loss, logits and LoRA gradients as the cpu placement (ring 1:
    backward fetches each layer again, from any first expert)."""
    plain = tiny_model_of(family)
    ours = auto_model(plain, tmp_path, kt_stream_ring=ring)
    experts = ours.model.layers[-1].mlp.experts.num_experts
    auto = ours.ktcore.auto
    assert [(s.lo, s.hi) for s in auto.layers.values()] == [(0, experts)] * 2
    assert len(ours.ktcore.layers) == 2 and len(ours.ktcore.stream.host) == 2
    a, b = peft_pair(ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"}), ours)
    for choice in ("cpu", "gpu_stream", 1, experts - 1, experts // 2, None):
        auto.force(choice)
        assert_same_training_signal(a, b, *batch(5))
        want = {"cpu": "cpu", "gpu_stream": "gpu_stream"}.get(choice, f"hybrid {choice}/{experts}")
        if choice is not None:
            assert set(auto.chosen[24].values()) == {want}


def test_checkpointed_layers_recompute_with_the_forwards_split(tmp_path):
    """Whole-layer checkpointing replays the CPU's share and recomputes the stream's: both at the split of the
    forward, although the forced split changes between the forward and the backward."""
    plain = tiny_model_of("deepseek_v2")
    on_cpu = ktcore.wrap_model(copy.deepcopy(plain), {"kt_backend": "torch"})
    ours = auto_model(plain, tmp_path, kt_stream_ring=1)
    checkpoint_non_experts(on_cpu)
    checkpoint_non_experts(ours)
    a, b = peft_pair(on_cpu, ours)
    a.train(), b.train()
    ids, mask = batch(6)
    ref = a(ids, attention_mask=mask, labels=ids)
    ref.loss.backward()
    ours.ktcore.auto.force(3)
    got = b(ids, attention_mask=mask, labels=ids)
    ours.ktcore.auto.force("cpu")  # a new decision would replay the CPU's share as the whole output
    got.loss.backward()
    assert got.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    grads = {n: p.grad for n, p in a.named_parameters() if p.requires_grad}
    for name, p in b.named_parameters():
        if p.requires_grad:
            assert (p.grad - grads[name]).norm() <= 1e-4 * grads[name].norm(), name


def test_auto_switches_with_the_tokens_and_says_so_once(tmp_path, capsys):
    """A few tokens: the CPU; many: the stream takes (nearly) all. One line per change of choice, naming the
    layers, the tokens and the predicted times; returning to tokens already seen says nothing again."""
    plain = tiny_model_of("qwen3_moe")
    ours = auto_model(plain, tmp_path)
    auto, experts = ours.ktcore.auto, 6
    capsys.readouterr()
    with torch.no_grad():
        for shape in ((1, 8), (8, 128), (1, 8)):
            ours(torch.randint(0, 96, shape))
    assert set(auto.chosen[8].values()) == {"cpu"}
    assert all(choice in ("gpu_stream", f"hybrid 1/{experts}") for choice in auto.chosen[1024].values())
    lines = [line for line in capsys.readouterr().err.splitlines() if "auto placement" in line]
    assert len(lines) == 2, lines
    assert lines[0].startswith("ktcore: auto placement: model.layers.0-2.mlp.experts, 8 tokens: cpu, predicted ")
    assert "1024 tokens" in lines[1] and "ms per layer and step (" in lines[1]


def test_training_steps_try_each_candidate_then_keep_one(tmp_path, capsys):
    """A real model on the switching rates at 256 tokens (where the cost model splits, and neither window end is
    pruned): the training steps take the fewest CPU experts, the most, then the cost model's split, TRIAL_STEPS
    each, then keep the fastest measured and say so in one line; an evaluation between them changes nothing.
    The cost model's split is whatever its factors say once they have learnt from the ends' measured calls (on a
    loaded machine a window end too), so it is checked against the model at that step, not against a range."""
    ours = auto_model(tiny_model_of("qwen3_moe"), tmp_path)
    auto = ours.ktcore.auto
    first = auto.layers[min(auto.layers)]
    assert auto.candidates(256) == [FEWEST, MOST, MODEL]
    model = get_peft_model(ours, lora_config())
    ids = torch.randint(0, 96, (2, 128))
    policies, taken, modelled = [], [], []
    for _ in range(3 * TRIAL_STEPS + 2):
        loss = model(ids, labels=ids).loss
        policies.append(auto.policy)
        taken.append(first.n)
        modelled.append(auto._split(first, 256, MODEL))
        loss.backward()
        with torch.no_grad():
            model(ids)
    assert policies[:3 * TRIAL_STEPS] == [FEWEST] * TRIAL_STEPS + [MOST] * TRIAL_STEPS + [MODEL] * TRIAL_STEPS
    assert taken[:2 * TRIAL_STEPS] == [0] * TRIAL_STEPS + [6] * TRIAL_STEPS
    assert taken[2 * TRIAL_STEPS:3 * TRIAL_STEPS] == modelled[2 * TRIAL_STEPS:3 * TRIAL_STEPS]
    kept = auto.trials.kept[8]
    assert auto.settled(256) and policies[3 * TRIAL_STEPS:] == [kept] * 2
    settled = zip(taken[3 * TRIAL_STEPS:], modelled[3 * TRIAL_STEPS:])
    assert all(n == {FEWEST: 0, MOST: 6, MODEL: m}[kept] for n, m in settled)
    lines = [line for line in capsys.readouterr().err.splitlines() if "measured steps" in line]
    assert len(lines) == 1 and lines[0].startswith("ktcore: auto placement, 256 tokens, measured steps: ")
    assert lines[0].endswith(f": keeps {kept}") and all(p in lines[0] for p in (FEWEST, MOST, MODEL))
    assert lines[0].endswith(auto.trials.verdict(256)) and auto.trials.verdict(64) is None


def test_hybrid_without_a_share_is_rebalanced(tmp_path):
    """kt_expert_placement hybrid without kt_hybrid_cpu_share: auto restricted to splits 1..E-1."""
    plain = tiny_model_of("qwen3_moe")
    ours = auto_model(plain, tmp_path, "hybrid")
    assert [(s.lo, s.hi) for s in ours.ktcore.auto.layers.values()] == [(1, 5)] * 2
    a, b = peft_pair(plain, ours)
    assert_same_training_signal(a, b, *batch(3))
    assert all(c.startswith("hybrid") for c in ours.ktcore.auto.chosen[24].values())


def test_short_host_ram_narrows_the_window_in_one_line(tmp_path, capsys):
    """Host RAM too small for both copies of every expert: one line, a narrower window, still the same training
    signal at the choices it allows."""
    plain = tiny_model_of("qwen3_moe")
    shape = model_shape(plain.config)
    step = Setting(tokens=4096)
    both = _host_memory(shape, step, 1.0, 1.0, 1.0) / GIB
    one = _host_memory(shape, step, 0.5) / GIB
    ours = auto_model(plain, tmp_path, kt_rates=rates_file(tmp_path, host_ram_gib=(both + one) / 2))
    windows = {(s.lo, s.hi) for s in ours.ktcore.auto.layers.values()}
    assert len(windows) == 1 and 0 < (lambda w: w[1] - w[0])(*windows) < 6
    err = capsys.readouterr().err
    assert err.count("host RAM") == 1 and "holds both copies of" in err
    a, b = peft_pair(plain, ours)
    for choice in ("cpu", "gpu_stream"):  # clipped to the window's ends
        ours.ktcore.auto.force(choice)
        assert_same_training_signal(a, b, *batch(4))


def test_no_gpu_in_the_rates_is_the_cpu_placement(tmp_path, capsys):
    plain = tiny_model_of("qwen3_moe")
    ours = ktcore.wrap_model(copy.deepcopy(plain), {"kt_config": {"kt_backend": "torch", "kt_expert_placement": "auto",
                                                                  "kt_rates": rates_file(tmp_path, h2d_gbps=None)}})
    assert ours.ktcore.auto is None and ours.ktcore.stream is None and len(ours.ktcore.layers) == 2
    assert "no GPU to stream to" in capsys.readouterr().err


# -- CUDA ------------------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("placement,choice", [("auto", "cpu"), ("auto", "gpu_stream"), ("auto", 2), ("auto", None),
                                              ("hybrid", None)])
def test_auto_on_cuda_bf16(tmp_path, family, placement, choice):
    """Each forced choice, auto's own from the rates measured at load (no kt_rates), and the re-balanced hybrid:
    as close to the fp32 truth as plain transformers in bf16 (loss and every LoRA gradient)."""
    plain = tiny_model_of(family)
    plain.save_pretrained(tmp_path / "model")
    truth = copy.deepcopy(plain).to("cuda")
    plain_bf16 = copy.deepcopy(plain).to("cuda", torch.bfloat16)
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "torch", "kt_expert_placement": placement,
                                                                "kt_stream_ring": 1}},
                             device="cuda", dtype=torch.bfloat16, progress=False)
    auto = ours.ktcore.auto
    assert auto.rates.has_gpu and all(t.is_pinned() for layer in ours.ktcore.stream.host for part in layer
                                           for t in part)
    auto.force(choice)
    truth, plain_bf16 = peft_pair(truth, plain_bf16)
    torch.manual_seed(7)
    ours = get_peft_model(ours, lora_config())
    ids, mask = (t.cuda() for t in batch(8))
    assert_as_close_as_plain_bf16(truth, plain_bf16, ours, ids, mask)


@pytest.mark.gpu
@cuda
def test_auto_switches_on_cuda_and_learns_from_events(tmp_path):
    """On CUDA, with the switching rates: a few tokens take the CPU, many the stream; the layer's copy and GPU
    compute times come back from CUDA events (read once complete, no synchronisation) into its factors."""
    plain = tiny_model_of("qwen3_moe")
    plain.save_pretrained(tmp_path / "model")
    ours = ktcore.load_model(tmp_path / "model", {"kt_config": {"kt_backend": "torch", "kt_expert_placement": "auto",
                                                                "kt_rates": rates_file(tmp_path)}},
                             device="cuda", dtype=torch.bfloat16, progress=False)
    auto = ours.ktcore.auto
    model = get_peft_model(ours, lora_config())
    for shape in ((1, 8), (8, 128), (8, 128)):
        ids = torch.randint(0, 96, shape, device="cuda")
        model(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()  # the test's: the events are complete when the next call reads them
    assert set(auto.chosen[8].values()) == {"cpu"}
    assert all(c in ("gpu_stream", "hybrid 1/6") for c in auto.chosen[1024].values())
    measured = [s.factors.by_bucket.get(10, {}) for s in auto.layers.values()]
    assert all("compute" in f and "copy" in f for f in measured), measured
    assert all(math.isfinite(v) and v > 0 for f in measured for v in f.values())


@pytest.mark.parametrize("placement,kt", [("auto", {}), ("hybrid", {}), ("hybrid", {"kt_hybrid_cpu_share": 0.5})])
def test_host_expert_lora_leaves_split_layers_with_the_model(tmp_path, placement, kt):
    """kt_expert_lora_device: host keeps on the host only the LoRA of layers a CPU backend computes whole: an auto
    or hybrid layer's GPU share computes with the same factors on the GPU, so they must stay on the model's device."""
    from peft import get_peft_model

    from ktcore.model.host_lora import expert_lora_factors
    from ktcore.model.peft_expert_lora import peft_wrapping
    from test_equivalence import lora_config

    ours = auto_model(tiny_model_of("qwen3_moe"), tmp_path, placement, kt_expert_lora_device="host", **kt)
    with peft_wrapping(ours):
        peft_model = get_peft_model(ours, lora_config())
    assert expert_lora_factors(peft_model) == []
    whole = ktcore.wrap_model(tiny_model_of("qwen3_moe"), {"kt_backend": "torch", "kt_expert_lora_device": "host"})
    with peft_wrapping(whole):
        assert len(expert_lora_factors(get_peft_model(whole, lora_config()))) == 2 * 2 * 2  # layers x params x A,B
