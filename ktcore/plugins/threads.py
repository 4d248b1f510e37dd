"""One thread budget for the host: the expert backend's thread pool and torch's CPU threads share the cores.

A native backend (one that runs its own pool; it reports ``num_threads``) gets ``kt_num_threads`` threads, by
default every core this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit,
not the machine's count), and never more. When the model computes on a GPU, the torch CPU ops left on the
host are ktcore's own (copies into pinned buffers, a backend's torch glue), and they run while the backend's
pool works: torch is then limited to the cores the pool leaves, at least one, so the two never ask for more
cores than there are (an oversubscribed pool waits at every barrier for its descheduled threads). With the
model on the CPU, torch's threads run the model itself and take turns with the pool: they stay as they are.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional

_noted: set = set()


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _note(message: str) -> None:
    if message not in _noted:
        _noted.add(message)
        print(f"ktcore: {message}", file=sys.stderr)


def backend_threads(requested: Optional[int]) -> int:
    """The backend pool's share: kt_num_threads, capped at the usable cores (default: all of them)."""
    cores = usable_cores()
    if requested is None:
        return cores
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
    if not pools or torch.device(device).type == "cpu":
        return None
    share = torch_share(max(pools))
    current = torch.get_num_threads()
    if current <= share:
        return None
    torch.set_num_threads(share)
    _note(f"torch CPU threads {current} -> {share}: the expert backend's pool runs {max(pools)} of the "
          f"{usable_cores()} cores this process may use (kt_config.kt_num_threads sets its share)")
    return share
