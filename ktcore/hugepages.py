"""Large CPU buffers on 2 MiB transparent huge pages, for packed expert weights.

A layer's packed experts are hundreds of MB read in streams and, in backward, in strided pieces of a few KiB.
On 4 KiB pages every such piece costs a TLB miss and a page walk; on 2 MiB pages a whole expert matrix sits
under a few TLB entries. Linux gives anonymous memory huge pages where ``/sys/kernel/mm/transparent_hugepage/
enabled`` is ``always``, or ``madvise`` and the range was advised with MADV_HUGEPAGE before it is first
touched: ``empty`` returns a 2 MiB-aligned tensor so advised. ``KTCORE_HUGE_PAGES=0`` turns this off.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 8 * HUGE_PAGE  # below this the alignment slack (up to 2 MiB) is not worth it
_MADV_HUGEPAGE = 14


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get("KTCORE_HUGE_PAGES", "1") != "0"


def advise(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + nbytes); True when the kernel accepted it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(address, nbytes, _MADV_HUGEPAGE) == 0


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype)``; when large, 2 MiB-aligned and advised for huge pages (untouched, so
    the first writes fault in huge pages)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(numel, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start:start + nbytes].view(dtype)
    advise(out.data_ptr(), nbytes)
    return out
