"""Host tensors locked in memory at their own size, for host-to-device copies that overlap the GPU's work.

``Tensor.pin_memory()`` takes a block of torch's pinned-memory cache, whose blocks are powers of two: a
DeepSeek-V2-Lite layer's gate_up experts (738 MB) lock 1 GiB, so every streamed layer held 1.45x its bytes (on the
H200 machine gpu_stream's host memory ran 24-31% above the cost model's). ``pinned`` copies a tensor into pages of
its own, an anonymous mapping of its exact size, and registers them with the CUDA driver (``cudaHostRegister``).
No other allocation shares those pages, so no registration can overlap another; they are unregistered when
``owner`` is collected, before the mapping can be unmapped (a freed range still registered would make the driver
refuse the next registration of its addresses).
"""

from __future__ import annotations

import mmap
import weakref

import torch


def pinned(t: torch.Tensor, owner) -> torch.Tensor:
    """A copy of ``t`` in page-locked host memory of its own, locked while ``owner`` lives."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    out = torch.frombuffer(area, dtype=torch.uint8).view(t.dtype).view(t.shape)  # the tensor keeps ``area``
    out.copy_(t)
    status = int(torch.cuda.cudart().cudaHostRegister(out.data_ptr(), nbytes, 0))
    if status != 0:
        raise RuntimeError(f"could not lock {nbytes / 2**30:.2f} GiB of host memory for copies to the GPU "
                           f"(cudaHostRegister returned CUDA error {status}); free host memory or use "
                           "kt_expert_placement: cpu")
    weakref.finalize(owner, _unregister, out).atexit = False  # at exit the process's memory goes anyway
    return out


def _unregister(t: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy from these pages may still be running
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
