"""``auto`` placement: per MoE layer and per call, the fastest split of its experts between the CPU backend and the
GPU stream, by the cost model (``model/cost.py``) corrected by what the layer's own calls measured.

Residency. An auto layer's CPU backend packs experts ``..hi`` and the stream keeps experts ``lo..`` pinned in HF's
layout (``lo = 0, hi = E``, both copies of every expert, when host RAM holds them: ``cost.auto_window``), so a call
takes any ``n`` in ``lo..hi`` without loading anything: the first ``n`` experts on the CPU and the rest streamed
(``model/hybrid.py``); ``n = E`` is the cpu placement, ``n = 0`` gpu_stream. A ``hybrid`` layer without
``kt_hybrid_cpu_share`` is the same with ``1 <= n <= E - 1``: its split re-balanced as the run goes.

Choice. ``cost.LayerTimes`` of the layer at the call's tokens (from the rates: ``kt_rates``, or ``ktcore doctor``'s
probes run at load) times three factors the layer learns from its previous calls, each measured over predicted:
the backend's seconds for the layer (``LayerClock``: forward and backward), the copy of its experts (CUDA events on
the side stream) and the GPU's forward of its share (CUDA events on the compute stream, read once they have
completed: nothing synchronises). Factors are kept per power of two of the tokens (a fixed cost per call is not a
rate) and move halfway (geometrically) to each measurement, at most 2x per call: they converge without
overshooting. A call takes a new split only when it is predicted at least 2% faster than the layer's last one, so
noise does not flip it (and auto stays within 2% of the best split the factors predict). Splits whose step the
cost model does not fit in the GPU's memory (``gpu_mem_gib`` of the rates) are not taken. One line on stderr per
change of choice: the layer range, the tokens, the choice and its predicted time beside the others'.

Measured steps decide. A split can be slower than every part's factor says: on the H200 machine the cost model's
hybrid splits ran 1.8x slower than gpu_stream at 2K tokens/step (the cause not isolated yet: the copies' use of
host memory slowing the CPU share, or the host thread that launches the GPU's work competing with the backend's
pool, are candidates). So for each power of two of the tokens, each layer's window ends (fewest CPU experts that fit
the GPU, and most) and then the cost model's splits are tried for ``TRIAL_STEPS`` training steps each, the first of
each not counted, and the fastest is kept for those tokens, said in one line. A step is timed from one forward of
the first auto layer to the next (CUDA events on the compute stream: nothing synchronises); the least counted step
decides, not the median, since an evaluation or an accumulation's optimizer step can lengthen one. An end predicted
``PRUNE`` times slower than the model's splits is not tried: the exploration costs a few steps, never a slow run.
"""

from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..experts import replay
from ..experts.timeline import LayerClock
from .cost import (FORMAT_BYTES, LayerTimes, Rates, Setting, auto_split, choice_name, fewest_cpu_experts,
                   layer_times)
from .hybrid import cpu_share, gpu_share
from .peft_expert_lora import expert_lora_of

HYSTERESIS = 0.02  # a new split must be predicted this much faster than the layer's last one
TRIAL_STEPS = 3  # training steps per candidate while the tokens' choice is tried, the first not counted
PRUNE = 3.0  # a candidate predicted this many times slower than the cost model's splits is not tried
MODEL, FEWEST, MOST = "the cost model's splits", "fewest CPU experts", "most CPU experts"
STEP_BOUND = 2.0  # a factor moves at most this ratio per measurement
REFERENCE_TOKENS = 4096  # where the window of experts held twice is centred when host RAM cannot hold all twice
PARTS = ("cpu", "copy", "compute")


def _span(first: str, last: str) -> str:
    """model.layers.1-26.mlp.experts for the layers from first to last."""
    a, b = re.split(r"(\d+)", first), re.split(r"(\d+)", last)
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) == len(b) and len(differ) == 1:
        i = differ[0]
        return "".join(a[:i] + [f"{a[i]}-{b[i]}"] + a[i + 1:])
    return first if first == last else f"{first} .. {last}"


def bucket(tokens: int) -> int:
    return round(math.log2(max(tokens, 1)))


class Factors:
    """Measured over predicted seconds of each part of a layer, per power of two of its tokens."""

    def __init__(self):
        self.by_bucket: dict[int, dict[str, float]] = {}

    def get(self, tokens: int) -> dict[str, float]:
        """Each part's factor at ``tokens``: its own bucket's, else the nearest measured one's, else 1."""
        b = bucket(tokens)
        out = {}
        for part in PARTS:
            measured = [k for k, v in self.by_bucket.items() if part in v]
            out[part] = self.by_bucket[min(measured, key=lambda k: (abs(k - b), k))][part] if measured else 1.0
        return out

    def observe(self, tokens: int, part: str, ratio: float) -> None:
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        old = self.get(tokens)[part]
        step = min(STEP_BOUND, max(1 / STEP_BOUND, math.sqrt(ratio / old)))
        self.by_bucket.setdefault(bucket(tokens), {})[part] = old * step


def _seconds(timed) -> float:
    """A (start, end) pair of CUDA events' seconds, or seconds measured on the host."""
    return timed[0].elapsed_time(timed[1]) / 1e3 if isinstance(timed, tuple) else timed


def _events(timed) -> tuple:
    return timed if isinstance(timed, tuple) else ()


@dataclass
class _Call:
    """The GPU's share of one forward of an auto layer: its timings, read once complete."""

    tokens: int
    n: int
    compute: object  # the GPU's forward of its share: (start, end) CUDA events, or seconds on the CPU
    copy: Optional[tuple] = None  # (first expert copied, its copy's events or seconds) when this call's was timed

    def ready(self) -> bool:
        return all(e.query() for e in (*_events(self.compute), *(_events(self.copy[1]) if self.copy else ())))


@dataclass
class _Step:
    """One training step under a candidate: timed from its first auto forward to the next step's."""

    bucket: int
    policy: str
    start: object  # a CUDA event, or perf_counter seconds
    counted: bool
    end: object = None


class StepTrials:
    """Per power of two of the tokens: the candidates still to try, the measured steps, and the one kept."""

    def __init__(self):
        self.kept: dict[int, str] = {}
        self.queue: dict[int, list[str]] = {}  # bucket -> candidates not yet tried enough, the current first
        self.seconds: dict[int, dict[str, list[float]]] = {}
        self.started: dict[tuple[int, str], int] = {}  # (bucket, policy) -> steps started
        self.steps: list[_Step] = []  # steps whose time is not read yet
        self.verdicts: dict[int, str] = {}  # bucket -> what its candidates' steps measured, and the one kept
        self.told: list[tuple[int, str]] = []  # (tokens, verdict) to say
        self.tokens_of: dict[int, int] = {}  # bucket -> the tokens of its last training step

    def settled(self, tokens: int) -> bool:
        """Whether the training steps of ``tokens`` have kept their candidate."""
        return bucket(tokens) in self.kept

    def verdict(self, tokens: int) -> Optional[str]:
        """What the candidates' steps at ``tokens`` measured and which was kept; None where nothing was tried."""
        return self.verdicts.get(bucket(tokens))

    def step(self, tokens: int, now, candidates) -> str:
        """A training step of ``tokens`` starts at ``now`` (a recorded CUDA event, or seconds): it ends the last
        one, counts the steps whose time is known, keeps the fastest candidate of a bucket whose candidates all
        have their steps measured, and returns this step's policy (``candidates()``: a new bucket's, pruned)."""
        if self.steps and self.steps[-1].end is None:
            self.steps[-1].end = now
        self._count()
        b = bucket(tokens)
        self.tokens_of[b] = tokens
        if b not in self.kept and b not in self.queue:
            self.queue[b] = candidates()
            if len(self.queue[b]) < 2:
                self.kept[b] = self.queue.pop(b)[0]
        if b in self.kept:
            return self.kept[b]
        queue = self.queue[b]
        policy = queue[0]
        n = self.started.get((b, policy), 0)
        self.started[b, policy] = n + 1
        self.steps.append(_Step(b, policy, now, counted=n > 0))
        if n + 1 >= TRIAL_STEPS and len(queue) > 1:
            queue.pop(0)  # its steps are started; the next step tries the next candidate
        return policy

    def _count(self) -> None:
        pending = []
        for step in self.steps:
            if step.end is None or not _complete(step.start, step.end):
                pending.append(step)
            elif step.counted and step.bucket in self.queue:
                seconds = (_seconds((step.start, step.end)) if isinstance(step.start, torch.cuda.Event)
                           else step.end - step.start)
                self.seconds.setdefault(step.bucket, {}).setdefault(step.policy, []).append(seconds)
        self.steps = pending
        for b, queue in list(self.queue.items()):
            measured = self.seconds.get(b, {})
            if len(queue) == 1 and len(measured.get(queue[0], ())) >= TRIAL_STEPS - 1:
                self.kept[b] = best = min(measured, key=lambda p: min(measured[p]))
                del self.queue[b]
                self.verdicts[b] = ", ".join(f"{p} {min(v):.3f} s" for p, v in measured.items()) + f": keeps {best}"
                self.told.append((self.tokens_of[b], self.verdicts[b]))


def _complete(start, end) -> bool:
    return not isinstance(start, torch.cuda.Event) or (start.query() and end.query())


class AutoLayer:
    """One auto layer: its window of CPU-expert counts, its learnt factors, its last split."""

    def __deepcopy__(self, memo):
        return self  # a deep-copied model shares its ExpertLayers, and so what their calls measured

    def __init__(self, name: str, index: int, experts: int, lo: int, hi: int, layer):
        self.name, self.index, self.experts, self.lo, self.hi = name, index, experts, lo, hi
        self.layer = layer  # the ExpertLayer of experts ..hi
        self.factors = Factors()
        self.n: Optional[int] = None  # the split of the last forward (a recomputed layer takes it again)
        self.tokens: Optional[int] = None  # ... and its tokens
        self.logged: dict[int, int] = {}  # tokens bucket -> the split logged last
        self.gpu_calls: list[_Call] = []  # calls whose GPU timings are not read yet
        self.cpu_calls: list[tuple[int, int]] = []  # (tokens, n) of the calls since the backend's seconds were read
        layer.timeline = LayerClock()


class AutoPlacement:
    """The choice of every auto layer of one model (``model.ktcore.auto``)."""

    def __deepcopy__(self, memo):
        return self

    def __init__(self, shape, setting: Setting, rates: Rates):
        self.shape, self.setting, self.rates = shape, setting, rates
        self.stream = None  # set by ``attach`` once the model's stream is built
        self.layers: dict[int, AutoLayer] = {}  # stream index -> layer
        self.forced = None
        self.tokens: Optional[int] = None  # of the last call
        self.chosen: dict[int, dict[str, str]] = {}  # tokens -> layer name -> its choice at the last such call
        self._times: dict[int, LayerTimes] = {}
        self._floors: dict[tuple, int] = {}
        self._changes: list[tuple] = []
        self.trials = StepTrials()
        self.policy = MODEL  # of the current call
        self.clock = time.perf_counter  # a model on the CPU times its steps on the host

    def attach(self, stream) -> None:
        self.stream = stream
        stream.planner = self.planned

    def add(self, layer: AutoLayer) -> None:
        self.layers[layer.index] = layer

    def window(self, lo: int, hi: int, what: str) -> AutoWindow:
        """CPU experts ``lo..hi`` narrowed to what host RAM holds twice (``cost.auto_window``), said in one line."""
        from ..plugins.threads import _note

        if not self.rates.has_gpu:
            _note(f"{what}: the rates have no GPU to stream to (kt_rates, or none here): the CPU backend computes "
                  f"{'every' if hi == self.shape.experts else hi} of each layer's experts")
            return AutoWindow(hi, hi, self)
        _, a, b = auto_split(self.shape, self.setting, self.rates, lo, hi)
        if (a, b) != (lo, hi):
            _note(f"{what}: host RAM ({self.rates.host_ram_gib:g} GiB) holds both copies of {b - a} of each layer's "
                  f"{self.shape.experts} experts, not {hi - lo}: each layer's CPU takes {a}..{b} of them (centred on "
                  f"the best split at {self.setting.tokens} tokens/step; `ktcore plan` says more)")
        return AutoWindow(a, b, self)

    # -- the choice --------------------------------------------------------------------------------------------
    def force(self, choice) -> None:
        """Every auto layer takes ``choice`` from now on (within its window): "cpu", "gpu_stream", a number of CPU
        experts, or None to choose again (the tests compare placements with it)."""
        self.forced = {"cpu": math.inf, "gpu_stream": 0}.get(choice, choice)

    def model_times(self, tokens: int) -> LayerTimes:
        if tokens not in self._times:
            self._times[tokens] = layer_times(self.shape, replace(self.setting, tokens=tokens), self.rates)
        return self._times[tokens]

    def times(self, state: AutoLayer, tokens: int) -> LayerTimes:
        f = state.factors.get(tokens)
        return self.model_times(tokens).scaled(f["cpu"], f["copy"], f["compute"])

    def split(self, state: AutoLayer, tokens: int) -> int:
        """The CPU experts of ``state``'s layer for a call of ``tokens`` (no side effects)."""
        if self.forced is not None:
            return int(min(state.hi, max(state.lo, self.forced)))
        if not self.rates.has_gpu:  # nothing to stream to
            return state.hi
        return self._split(state, tokens, self.policy)

    def _split(self, state: AutoLayer, tokens: int, policy: str) -> int:
        lo = self.gpu_floor(tokens, state.lo, state.hi)
        if policy != MODEL:
            return lo if policy == FEWEST else state.hi
        times = self.times(state, tokens)
        n, best = times.best_split(state.experts, lo, state.hi)
        last = state.n
        if last is not None and lo <= last != n and times.at(last / state.experts) <= best * (1 + HYSTERESIS):
            return last
        return n

    def gpu_floor(self, tokens: int, lo: int, hi: int) -> int:
        """The fewest CPU experts whose step the cost model fits in the GPU's memory at ``tokens``."""
        key = (tokens, lo, hi)
        if key not in self._floors:
            self._floors[key] = fewest_cpu_experts(self.shape, replace(self.setting, tokens=tokens), self.rates, lo, hi)
        return self._floors[key]

    def try_again(self) -> None:
        """Forget the kept choices: the next training steps try the candidates again (the work changed)."""
        self.trials = StepTrials()

    def settled(self, tokens: int) -> bool:
        """Whether training steps of ``tokens`` take a kept policy (nothing to try: forced, or no GPU)."""
        return self.forced is not None or not self.rates.has_gpu or self.trials.settled(tokens)

    def candidates(self, tokens: int) -> list[str]:
        """The policies to try at ``tokens``: each window end that gives other splits than the cost model's and is
        predicted less than ``PRUNE`` times their time, then the cost model's splits."""
        layers = list(self.layers.values())
        splits = {p: tuple(self._split(s, tokens, p) for s in layers) for p in (MODEL, FEWEST, MOST)}
        seconds = {p: sum(self.times(s, tokens).at(n / s.experts) for s, n in zip(layers, splits[p]))
                   for p in splits}
        ends = []
        for policy in (FEWEST, MOST):
            if splits[policy] not in {splits[c] for c in (MODEL, *ends)} and seconds[policy] < PRUNE * seconds[MODEL]:
                ends.append(policy)
        return [*ends, MODEL]  # the model's last: by then its factors have learnt from the ends' calls

    def _step_policy(self, tokens: int, cuda: bool) -> str:
        """The policy of a call of the first auto layer: a training step's is tried or kept (and the step timed),
        another call (evaluation, generation, a reference model's forward) takes the kept one."""
        if not torch.is_grad_enabled():
            return self.trials.kept.get(bucket(tokens), MODEL)
        if cuda:
            now = torch.cuda.Event(enable_timing=True)
            now.record()
        else:
            now = self.clock()
        return self.trials.step(tokens, now, lambda: self.candidates(tokens))

    def decide(self, state: AutoLayer, tokens: int, cuda: bool = False) -> int:
        self._learn(state)
        if state.index == min(self.layers) and self.forced is None and self.rates.has_gpu:
            self.policy = self._step_policy(tokens, cuda)
        self.tokens = tokens
        n = self.split(state, tokens)
        state.n, state.tokens = n, tokens
        self.chosen.setdefault(tokens, {})[state.name] = choice_name(n, state.experts)
        if state.logged.get(bucket(tokens)) != n:
            state.logged[bucket(tokens)] = n
            self._changes.append((state, tokens, n))
        if state.index == max(self.layers):
            self._log()
        return n

    def planned(self, index: int) -> Optional[int]:
        """The first expert layer ``index`` will stream at the current tokens (what the stream prefetches)."""
        state = self.layers.get(index)
        if state is None or self.tokens is None:
            return None
        return state.n if state.tokens == self.tokens else self.split(state, self.tokens)

    # -- learning from the layer's own calls ---------------------------------------------------------------------
    def _learn(self, state: AutoLayer) -> None:
        """Fold the timings of the layer's earlier calls into its factors: the backend's seconds since the last
        call (its forward and backward are complete by the next forward: autograd waited for them), and the GPU
        timings whose events have completed."""
        experts = state.experts
        if state.cpu_calls:
            seconds = state.layer.timeline.take()
            predicted = sum(n / experts * self.model_times(t).cpu_s for t, n in state.cpu_calls)
            if seconds and predicted:
                state.factors.observe(state.cpu_calls[-1][0], "cpu", seconds / predicted)
            state.cpu_calls = []
        done = [c for c in state.gpu_calls if c.ready()]
        state.gpu_calls = [c for c in state.gpu_calls if not c.ready()][-4:]
        for call in done:
            model = self.model_times(call.tokens)
            share = call.n / experts
            state.factors.observe(call.tokens, "compute", _seconds(call.compute) / ((1 - share) * model.compute_s / 2))
            if call.copy is not None:
                first, timed = call.copy
                predicted = (1 - first / experts) * model.copy_s * self._copies_per_step()
                state.factors.observe(call.tokens, "copy", _seconds(timed) / predicted)

    def _copies_per_step(self) -> float:
        """One copy's share of the model's per-step copy seconds (backward copies again unless the ring holds all)."""
        return 1.0 if self.setting.ring >= self.shape.moe_layers else 0.5

    # -- the log -----------------------------------------------------------------------------------------------
    def _log(self) -> None:
        """One line per run of consecutive layers whose choice changed alike in this pass."""
        from ..plugins.threads import is_main_rank

        changes, self._changes = self._changes, []
        told, self.trials.told = self.trials.told, []
        runs = []
        for state, tokens, n in changes:
            if runs and runs[-1][2:] == [tokens, n] and runs[-1][1].index == state.index - 1:
                runs[-1][1] = state
            else:
                runs.append([state, state, tokens, n])
        if not is_main_rank():
            return
        for tokens, line in told:
            print(f"ktcore: auto placement, {tokens} tokens, measured steps: {line}", file=sys.stderr)
        for first, last, tokens, n in runs:
            experts, times = first.experts, self.times(first, tokens)
            others = ", ".join(f"{choice_name(m, experts)} {times.at(m / experts) * 1e3:.1f}"
                               for m in sorted({first.lo, first.hi}) if m != n)
            layers = _span(first.name, last.name)
            print(f"ktcore: auto placement: {layers}, {tokens} tokens: {choice_name(n, experts)}, predicted "
                  f"{times.at(n / experts) * 1e3:.1f} ms per layer and step" + (f" ({others})" if others else ""),
                  file=sys.stderr)


@dataclass(frozen=True)
class AutoWindow:
    """plan_placement's value for an auto layer (or a re-balanced hybrid one): CPU experts ``lo..hi``."""

    lo: int
    hi: int
    auto: "AutoPlacement"


def rates_for(kt, backend, device) -> Rates:
    """``kt_rates`` (a rates file as ``ktcore plan --rates`` takes), or this machine's, measured now with ``backend``
    (``ktcore doctor``'s probes: about 2 s); a model on the CPU has nothing to stream to."""
    from .cost import load_rates

    if kt.kt_rates:
        return load_rates(kt.kt_rates)
    from ..experts.probe import measure_rates
    from ..plugins.threads import backend_threads

    rates = Rates(**measure_rates(backend, backend_threads(kt.kt_num_threads)))
    return rates if torch.device(device).type == "cuda" else replace(rates, h2d_gbps=None, gpu_tflops=None)


def make_auto(model, kt, backend, device) -> "AutoPlacement":
    from ..plugins.select import experts_format
    from .shape import model_shape

    fmt = experts_format(kt)
    fmt = fmt if fmt in FORMAT_BYTES else "bf16"
    setting = Setting(tokens=REFERENCE_TOKENS, weight_format=fmt, recompute=kt.kt_cpu_activation == "recompute",
                      cache_depth=kt.kt_max_cache_depth, ring=kt.kt_stream_ring,
                      stream_recompute=kt.kt_stream_activation == "recompute")
    return AutoPlacement(model_shape(model.config), setting, rates_for(kt, backend, device))


class AutoPoint:
    """An auto layer's overlap: a cpu call defers as the cpu placement does (``inner``, the block's shared-experts
    hooks, or none), a split call as hybrid does (collected at the end of the experts call)."""

    def __init__(self, inner=None):
        self.inner = inner
        self.split = False
        self._pending = None

    def __deepcopy__(self, memo):
        return self

    @property
    def enabled(self):
        return None if self.inner is None else self.inner.enabled

    @enabled.setter
    def enabled(self, value):
        if self.inner is not None:
            self.inner.enabled = value

    def defers(self, x) -> bool:
        if self.split:
            return x.is_cuda
        return self.inner is not None and self.inner.defers(x)

    def hold(self, job, y) -> None:
        if self.split:
            self._pending = (job, y)
        else:
            self.inner.hold(job, y)

    def collect(self, y):
        from ..experts import ExpertsResult

        if self._pending is None:
            return y
        job, y = self._pending
        self._pending = None
        return ExpertsResult.apply(job, y)


def auto_forward(module, auto: AutoPlacement, state: AutoLayer, hidden_states, top_k_index, top_k_weights):
    """One call of an auto layer: its split for these tokens (the forward's again when a checkpointed layer is
    recomputed), the CPU's share submitted first and the stream's share enqueued beside it."""
    tokens = hidden_states.shape[0]
    recompute = replay.recomputing() and state.n is not None
    n = state.n if recompute else auto.decide(state, tokens, hidden_states.is_cuda)
    lora = expert_lora_of(module)
    experts = module.num_experts
    y_cpu = None
    if n > 0:
        state.layer.overlap.split = n < experts
        if not recompute:
            state.cpu_calls.append((tokens, n))
        y_cpu = cpu_share(module, state.layer, n, state.hi, hidden_states, top_k_index, top_k_weights, lora)
        if n == experts:
            return y_cpu
    on_cuda = hidden_states.is_cuda
    marks = []

    def fetched():
        if on_cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())

    y_gpu = gpu_share(module, auto.stream, state.index, n, hidden_states, top_k_index, top_k_weights, lora, fetched)
    if not recompute:
        if on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            state.gpu_calls.append(_Call(tokens, n, (marks[0], end), auto.stream.take_copy(state.index)))
        else:
            state.gpu_calls.append(_Call(tokens, n, time.perf_counter() - marks[0]))
    return y_gpu if y_cpu is None else state.layer.overlap.collect(y_cpu) + y_gpu
