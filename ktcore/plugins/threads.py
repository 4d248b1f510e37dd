"""One thread budget for the host: the expert backend's thread pool and torch's CPU threads share the cores.

A native backend (one that runs its own pool; it reports ``num_threads``) gets ``kt_num_threads`` threads, by
default every core this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit,
not the machine's count), and never more. When the model computes on a GPU, the torch CPU ops left on the
host are ktcore's own (copies into pinned buffers, a backend's torch glue), and they run while the backend's
pool works: torch is then limited to the cores the pool leaves, at least one, so the two never ask for more
cores than there are (an oversubscribed pool waits at every barrier for its descheduled threads). With the
model on the CPU, torch's threads run the model itself and take turns with the pool: they stay as they are.

Several processes on one host (``torchrun``/``accelerate launch``: ``LOCAL_WORLD_SIZE`` ranks, this one
``LOCAL_RANK``): each rank runs its own backend pool, so the default share is the usable cores divided by the
local ranks (at least one thread), and torch on a CPU rank gets no more than that share either; with several
ranks the pools would otherwise ask for N times the cores and wait at every barrier. One-line notes are printed
by rank 0 only (``RANK``), once.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional

_noted: set = set()
_budget: Optional[int] = None  # torch's threads as apply_budget limited them (None: it left them as they were)


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_ranks() -> int:
    """The processes of this job on this host (``LOCAL_WORLD_SIZE``, set by torchrun and accelerate; 1 alone)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def is_main_rank() -> bool:
    """True in a process started alone and in global rank 0 of a launched job (``RANK``): the one that prints
    notes and writes outputs."""
    return os.environ.get("RANK", "0") in ("0", "")


def rank_cores() -> int:
    """This rank's share of the usable cores: all of them alone, 1/``LOCAL_WORLD_SIZE`` of them (at least one)
    with several ranks on the host."""
    return max(1, usable_cores() // local_ranks())


def _note(message: str) -> None:
    if message not in _noted and is_main_rank():
        _noted.add(message)
        print(f"ktcore: {message}", file=sys.stderr)


def backend_threads(requested: Optional[int]) -> int:
    """The backend pool's share: kt_num_threads, capped at the usable cores (default: this rank's share of them,
    all of them in a process started alone)."""
    cores = usable_cores()
    if requested is None:
        share = rank_cores()
        if share < cores:
            _note(f"{local_ranks()} ranks on this host: each rank's expert backend pool runs {share} of the {cores} "
                  "cores (kt_config.kt_num_threads sets it)")
        return share
    if requested > cores:
        _note(f"kt_num_threads {requested} is more than the {cores} cores this process may use "
              f"(os.sched_getaffinity); the backend runs {cores} threads")
        return cores
    return requested


def torch_share(pool_threads: int) -> int:
    """torch's CPU threads while a backend pool of ``pool_threads`` works: the rest of the cores, at least one."""
    return max(1, usable_cores() - pool_threads)


def apply_budget(backends: Iterable, device) -> Optional[int]:
    """Limit torch's CPU threads for a model on ``device`` whose experts run on ``backends``; returns the new
    torch thread count, or None when nothing changed."""
    import torch

    pools = [n for n in (getattr(b, "num_threads", None) for b in backends) if n]
    if torch.device(device).type == "cpu":
        return _cpu_rank_budget(torch)
    if not pools:
        return None
    share = torch_share(max(pools))
    current = torch.get_num_threads()
    if current <= share:
        return None
    global _budget
    torch.set_num_threads(share)
    _budget = share
    _note(f"torch CPU threads {current} -> {share}: the expert backend's pool runs {max(pools)} of the "
          f"{usable_cores()} cores this process may use (kt_config.kt_num_threads sets its share)")
    return share


def _cpu_rank_budget(torch) -> Optional[int]:
    """A model on the CPU: torch keeps its threads, but with several ranks on the host no more than this rank's
    share (torchrun sets OMP_NUM_THREADS=1 itself; ``accelerate launch`` and a user's OMP_NUM_THREADS may not)."""
    share, current = rank_cores(), torch.get_num_threads()
    if local_ranks() == 1 or current <= share:
        return None
    torch.set_num_threads(share)
    _note(f"torch CPU threads {current} -> {share}: {local_ranks()} ranks share the {usable_cores()} cores this "
          "process may use")
    return share


_step_hooks = None
_threads_before_step: Optional[int] = None


def _updates_host_params(optimizer) -> bool:
    return any(p.grad is not None and p.device.type == "cpu" for group in optimizer.param_groups
               for p in group["params"])


def give_optimizer_steps_the_cores() -> None:
    """Once per process: torch gets this rank's cores for each optimizer step that updates parameters in host
    memory (expert LoRA kept there, ``ktcore.model.host_lora``), and the budget back afterwards.

    The budget above keeps torch to the cores the backend pool leaves (often one) because the two run at once in
    forward and backward; during ``optimizer.step()`` the pool is idle, and AdamW on ~100M host parameters at one
    thread would cost a large part of a step. torch.optim's global step hooks run around every optimizer's step,
    whoever calls it (HF Trainer through accelerate, a user's loop). Only ktcore's own limit is lifted: threads
    that are not at the budget (set by the user, or never limited) are left alone. A step that raises leaves the
    raised count until the next step's post hook."""
    global _step_hooks
    if _step_hooks is not None:
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def before(optimizer, args, kwargs):
        global _threads_before_step
        current, cores = torch.get_num_threads(), rank_cores()
        if current == _budget and current < cores and _updates_host_params(optimizer):
            _threads_before_step = current
            torch.set_num_threads(cores)

    def after(optimizer, args, kwargs):
        global _threads_before_step
        if _threads_before_step is not None:
            torch.set_num_threads(_threads_before_step)
            _threads_before_step = None

    _step_hooks = (register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after))
