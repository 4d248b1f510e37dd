"""Large CPU buffers on 2 MiB transparent huge pages: packed expert weights, activations saved for backward.

A layer's packed experts are hundreds of MB read in streams and, in backward, in strided pieces of a few KiB.
On 4 KiB pages every such piece costs a TLB miss and a page walk; on 2 MiB pages a whole expert matrix sits
under a few TLB entries. Activations saved for backward are fresh memory on every forward, hundreds of MB at
long sequences, and on 4 KiB pages their first writes take a page fault per 4 KiB. Linux backs anonymous
memory with huge pages where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, or ``madvise`` and
the range was advised with MADV_HUGEPAGE before it is first touched. ``empty`` maps fresh memory for that (the
allocator may hand out heap pages that are already touched) and returns a 2 MiB-aligned tensor on it.
``KTCORE_HUGE_PAGES=0`` turns this off.
"""

from __future__ import annotations

import math
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 8 * HUGE_PAGE  # below this the alignment slack (up to 2 MiB of address space) is not worth it


def enabled() -> bool:
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("KTCORE_HUGE_PAGES", "1") != "0")


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``; when large, on a fresh 2 MiB-aligned mapping advised for huge pages
    (untouched, so the first writes fault in huge pages: one fault per 2 MiB instead of 512). The tensor keeps
    its mapping alive."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # a kernel without THP: plain pages
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)
