"""ktcore.experts.hugepages: large packed-weight buffers 2 MiB-aligned and on transparent huge pages."""

import re
from pathlib import Path

import pytest
import torch

from ktcore.experts import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(address: int) -> int:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_buffers_are_plain_tensors():
    t = hugepages.empty(1000, torch.int16)
    assert t.shape == (1000,) and t.dtype == torch.int16
    assert hugepages.empty((3, 5), torch.float32).shape == (3, 5)


def test_large_buffers_are_aligned(monkeypatch):
    numel = hugepages.MIN_BYTES // 2 + 12345  # int16: just over the threshold, not a whole number of pages
    t = hugepages.empty(numel, torch.int16)
    assert t.shape == (numel,) and t.dtype == torch.int16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0

    monkeypatch.setenv("KTCORE_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    plain = hugepages.empty(numel, torch.int16)
    assert plain.untyped_storage().nbytes() == 2 * numel  # no alignment slack
    monkeypatch.delenv("KTCORE_HUGE_PAGES")

    rows = hugepages.empty((1024, 4097), torch.float32)  # a saved activation: 2-D, 16 MiB and more
    assert rows.shape == (1024, 4097) and rows.is_contiguous() and rows.data_ptr() % hugepages.HUGE_PAGE == 0


@pytest.mark.perf
@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_large_buffers_are_on_huge_pages():
    """Whether the kernel backs the advised range with huge pages depends on the machine (THP mode, free memory)."""
    t = hugepages.empty(hugepages.MIN_BYTES // 2 + 12345, torch.int16)
    t.fill_(7)  # first touch: the kernel faults in huge pages for the advised range
    assert int(t[-1]) == 7 and _anon_huge_kb(t.data_ptr()) >= 2048
