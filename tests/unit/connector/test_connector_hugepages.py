"""connector/hugepages.py: which ranges are advised, what a refusal or the budget does, and the real syscall."""
from __future__ import annotations

import errno
import mmap
import re
from pathlib import Path

import numpy as np
import pytest

from kvpush.connector.hugepages import (CHUNK_HUGE_PAGES, MADV_COLLAPSE, MADV_HUGEPAGE, aligned_inside,
                                        back_with_huge_pages, huge_page_size, merged)

pytestmark = pytest.mark.unit
PAGE = 2 * 1024 * 1024
CHUNK = CHUNK_HUGE_PAGES * PAGE


class FakeMadvise:
    def __init__(self, refuse: dict[int, int] | None = None):
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse or {}  # advice -> errno

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        return self.refuse.get(advice, 0)


def test_only_whole_huge_pages_inside_a_span_are_advised():
    assert aligned_inside(PAGE + 4096, 3 * PAGE, PAGE) == (2 * PAGE, 2 * PAGE)
    assert aligned_inside(4096, PAGE, PAGE) is None  # no whole huge page inside
    assert aligned_inside(0, PAGE, PAGE) == (0, PAGE)


def test_touching_spans_are_joined_so_a_page_across_their_border_counts():
    k, v = (PAGE // 2, PAGE), (PAGE // 2 + PAGE, PAGE)  # K and V of a layer, back to back, off alignment
    assert merged([v, k]) == [(PAGE // 2, 2 * PAGE)]
    assert merged([(0, PAGE), (3 * PAGE, PAGE)]) == [(0, PAGE), (3 * PAGE, PAGE)]
    result = back_with_huge_pages([k, v], FakeMadvise(), page_size=PAGE)
    assert result.requested_bytes == PAGE  # apart, neither span holds a whole huge page


def test_each_range_is_advised_then_collapsed_in_chunks():
    fake = FakeMadvise()
    length = CHUNK + 2 * PAGE
    result = back_with_huge_pages([(PAGE, length), (100 * CHUNK, 4096)], fake, page_size=PAGE)
    assert fake.calls == [(PAGE, length, MADV_HUGEPAGE), (PAGE, CHUNK, MADV_COLLAPSE),
                          (PAGE + CHUNK, 2 * PAGE, MADV_COLLAPSE)]
    assert result.requested_bytes == result.collapsed_bytes == length and result.error == ""
    assert "of the KV cache on 2 MiB pages" in result.describe()


def test_an_unsupported_kernel_stops_at_the_first_refusal_and_says_why():
    fake = FakeMadvise(refuse={MADV_COLLAPSE: errno.EINVAL})
    result = back_with_huge_pages([(0, 3 * CHUNK), (10 * CHUNK, CHUNK)], fake, page_size=PAGE)
    assert [c[2] for c in fake.calls] == [MADV_HUGEPAGE, MADV_COLLAPSE]  # the second span is not tried
    assert result.collapsed_bytes == 0 and "EINVAL" in result.error
    assert "stays on base pages" in result.describe()


def test_a_busy_kernel_still_tries_every_chunk():
    fake = FakeMadvise(refuse={MADV_COLLAPSE: errno.EAGAIN})
    back_with_huge_pages([(0, 3 * CHUNK)], fake, page_size=PAGE)
    assert [c[2] for c in fake.calls].count(MADV_COLLAPSE) == 3


def test_the_time_budget_stops_collapsing_and_is_named():
    ticks = iter(range(100))
    result = back_with_huge_pages([(0, 5 * CHUNK)], FakeMadvise(), page_size=PAGE, budget_s=2.5,
                                  clock=lambda: float(next(ticks)))
    assert 0 < result.collapsed_bytes < result.requested_bytes == 5 * CHUNK
    assert "2.5 s start-up budget" in result.error


def test_no_transparent_huge_pages_means_no_advice():
    fake = FakeMadvise()
    result = back_with_huge_pages([(0, CHUNK)], fake, page_size=0)
    assert fake.calls == [] and result.collapsed_bytes == 0 and "no transparent huge pages" in result.error


def anon_huge_kib() -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+)", Path("/proc/self/smaps_rollup").read_text()).group(1))


def test_real_madvise_keeps_the_bytes_and_collapses_whenever_it_reports_so():
    page = huge_page_size()
    if not page:
        pytest.skip("no transparent huge pages on this kernel")
    buf = mmap.mmap(-1, 8 * page)  # anonymous, page-aligned, like a large torch allocation
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)
    expected = data.copy()
    before = anon_huge_kib()
    result = back_with_huge_pages([(data.ctypes.data, data.nbytes)])
    assert result.requested_bytes >= 6 * page and result.page_size == page
    assert np.array_equal(data, expected)
    if not result.error:  # the kernel said yes: the pages must be there
        assert result.collapsed_bytes == result.requested_bytes
        assert anon_huge_kib() - before >= page // 1024  # smaps counts at least one new huge page
    del data
    buf.close()
