"""One thread budget (ktcore.plugins.threads): the backend pool gets kt_num_threads, never more than the usable
cores; with the model on a GPU, torch's CPU threads get the rest, at least one."""

import pytest
import torch
from ktcore_tiny import backend_unusable

import ktcore
from ktcore.plugins.threads import apply_budget, backend_threads, torch_share, usable_cores


def test_the_backend_share_is_capped_at_the_usable_cores(capsys):
    cores = usable_cores()
    assert backend_threads(None) == cores
    assert backend_threads(1) == 1
    assert backend_threads(cores + 3) == cores
    assert f"kt_num_threads {cores + 3} is more than the {cores} cores" in capsys.readouterr().err
    assert torch_share(cores) == 1 and torch_share(cores + 8) == 1
    assert torch_share(1) == max(1, cores - 1)


def native_backend(threads):
    why = backend_unusable("llamafile")
    if why:
        pytest.skip(f"needs a native backend with its own pool (llamafile): {why}")
    return ktcore.get_backend("llamafile", {"kt_backend": "llamafile", "kt_num_threads": threads})


def test_get_backend_hands_the_capped_share_to_the_backend():
    backend = native_backend(usable_cores() + 5)
    assert backend.num_threads == usable_cores()
    assert backend.config.kt_num_threads == usable_cores()


def test_torch_gets_the_cores_the_pool_leaves_only_when_the_model_is_on_a_gpu():
    backend = native_backend(1)
    before = torch.get_num_threads()
    try:
        assert apply_budget([backend], "cpu") is None  # the model's own ops take turns with the pool
        assert apply_budget([ktcore.get_backend("torch", {"kt_backend": "torch"})], "cuda") is None  # no pool of its own
        assert torch.get_num_threads() == before
        expected = max(1, usable_cores() - 1)
        assert apply_budget([backend], "cuda") == (expected if before > expected else None)
        assert torch.get_num_threads() == min(before, expected)
    finally:
        torch.set_num_threads(before)
