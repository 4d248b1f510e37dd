"""Checks of a native backend's engine phases, shared by the amx_bf16 and amx_int8 suites: the phase clock
(``ktcore/include/ktcore/phase_clock.hpp``) and the expert-LoRA gradient phases that ``backward_parts`` leaves for
its second part."""

from __future__ import annotations

import torch

# Every phase of a forward + backward with expert LoRA, as benchmarks/bench_expert_lora.py --phases prints them
LORA_PHASES = {f"{d} {p}: {what}" for d, p, whats in (("fwd", "gate_up", ("lora A x", "gemm")),
                                                       ("fwd", "down", ("lora A h", "gemm")),
                                                       ("bwd", "down", ("lora B^T g", "gemm", "lora dA", "lora dB")),
                                                       ("bwd", "gate_up", ("lora B^T g", "gemm", "lora dA", "lora dB")))
               for what in whats} | {"bwd act"}
GRADIENT_PHASES = {p for p in LORA_PHASES if p.endswith(("dA", "dB"))}


def _step(backend, packed, problem):
    _, x, ids, w, lora = problem
    _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    return backend.backward(packed, ctx, torch.ones_like(x), lora)


def check_phase_clock(backend, problem) -> None:
    """Off, the clock records nothing; on, one forward + backward with expert LoRA records each of its phases once,
    in positive seconds; a read starts over. ``problem``: (weights, x, ids, w, lora) with LoRA."""
    engine = backend._engine
    packed = backend.pack(problem[0])
    _step(backend, packed, problem)
    assert engine.phase_times() == {}
    engine.phase_clock(True)
    _step(backend, packed, problem)
    times = engine.phase_times()
    engine.phase_clock(False)
    assert LORA_PHASES <= set(times), LORA_PHASES - set(times)
    assert all(seconds > 0 and calls == 1 for name, (seconds, calls) in times.items() if name in LORA_PHASES)
    assert engine.phase_times() == {}


def check_lora_gradients_come_last(backend, problem) -> None:
    """``backward_parts`` returns grad_x and grad_w before any LoRA gradient phase has run; its ``lora_grads()`` runs
    them (and nothing else) and gives what ``backward`` gives, to the bit."""
    weights, x, ids, w, lora = problem
    engine = backend._engine
    packed = backend.pack(weights)
    want = _step(backend, packed, problem)
    _, ctx = backend.forward(packed, x, ids, w, lora, save=True)
    engine.phase_clock(True)
    grad_x, grad_w, lora_grads = backend.backward_parts(packed, ctx, torch.ones_like(x), lora)
    first = engine.phase_times()
    grads = lora_grads()
    second = engine.phase_times()
    engine.phase_clock(False)
    assert not GRADIENT_PHASES & set(first) and "bwd gate_up: gemm" in first
    assert set(second) == GRADIENT_PHASES
    assert torch.equal(grad_x, want[0]) and torch.equal(grad_w, want[1])
    assert all(torch.equal(a, b) for a, b in zip(grads.tensors(), want[2].tensors()) if a is not None)
