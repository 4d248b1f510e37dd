"""ktcore.experts.saved_buffers: saved activations reuse the memory of contexts that are gone, never of live ones."""

import gc

import torch

from ktcore.experts.saved_buffers import SavedBufferPool


def _addresses(*tensors):
    return {t.data_ptr() for t in tensors}


def test_buffers_come_back_when_their_lease_is_gone():
    pool = SavedBufferPool()
    lease = pool.lease()
    a, b = lease.empty((300, 7), torch.float32), lease.empty((64,), torch.bfloat16)
    assert a.shape == (300, 7) and a.dtype == torch.float32 and a.is_contiguous()
    assert b.shape == (64,) and b.dtype == torch.bfloat16
    first = _addresses(a, b)

    other = pool.lease()  # taken while the first lease lives: other memory
    c = other.empty((300, 7), torch.float32)
    assert c.data_ptr() not in first and pool.idle_bytes == 0

    del a, b, lease
    gc.collect()
    assert pool.idle_bytes >= 300 * 7 * 4 + 64 * 2
    again = pool.lease()
    assert _addresses(again.empty((300, 7), torch.float32), again.empty((64,), torch.bfloat16)) == first
    assert pool.idle_bytes == 0


def test_best_fit_and_headroom():
    pool = SavedBufferPool()
    lease = pool.lease()
    big, small = lease.empty((100_000,), torch.uint8), lease.empty((1000,), torch.uint8)  # big comes back first
    small_at, big_at = small.data_ptr(), big.data_ptr()
    del small, big, lease
    lease = pool.lease()
    assert lease.empty((900,), torch.uint8).data_ptr() == small_at  # the smallest buffer that fits
    assert lease.empty((110_000,), torch.uint8).data_ptr() == big_at  # a slightly larger batch still fits


def test_a_miss_drops_the_idle_buffers_too_small_for_it():
    pool = SavedBufferPool()
    lease = pool.lease()
    lease.empty((1000,), torch.float32)
    del lease
    assert pool.idle_bytes > 0
    bigger = pool.lease()
    bigger.empty((10_000,), torch.float32)
    assert pool.idle_bytes == 0  # the 4 KB buffer is gone, not kept for batches smaller than any seen since


def test_empty_shapes():
    lease = SavedBufferPool().lease()
    assert lease.empty((0, 5), torch.float32).shape == (0, 5)
