"""connector/hugepages.py: which ranges are advised, what a refusal does, and the real syscall."""
from __future__ import annotations

import errno
import mmap

import numpy as np
import pytest

from kvpush.connector.hugepages import (COLLAPSE_CHUNK, HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, aligned_inside,
                                        back_with_huge_pages)

pytestmark = pytest.mark.unit


class FakeMadvise:
    def __init__(self, refuse: dict[int, int] | None = None):
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse or {}  # advice -> errno

    def __call__(self, address: int, length: int, advice: int) -> int:
        self.calls.append((address, length, advice))
        return self.refuse.get(advice, 0)


def test_only_whole_huge_pages_inside_a_span_are_advised():
    assert aligned_inside(HUGE_PAGE + 4096, 3 * HUGE_PAGE) == (2 * HUGE_PAGE, 2 * HUGE_PAGE)
    assert aligned_inside(4096, HUGE_PAGE) is None  # no whole huge page inside
    assert aligned_inside(0, HUGE_PAGE) == (0, HUGE_PAGE)


def test_each_span_is_advised_then_collapsed_in_chunks():
    fake = FakeMadvise()
    length = COLLAPSE_CHUNK + 2 * HUGE_PAGE
    result = back_with_huge_pages([(HUGE_PAGE, length), (100, 4096)], fake)
    assert fake.calls == [(HUGE_PAGE, length, MADV_HUGEPAGE), (HUGE_PAGE, COLLAPSE_CHUNK, MADV_COLLAPSE),
                          (HUGE_PAGE + COLLAPSE_CHUNK, 2 * HUGE_PAGE, MADV_COLLAPSE)]
    assert result.requested_bytes == result.collapsed_bytes == length and result.error == ""
    assert "of the KV cache on 2 MiB pages" in result.describe()


def test_an_unsupported_kernel_stops_after_the_first_refusal_and_says_why():
    fake = FakeMadvise(refuse={MADV_COLLAPSE: errno.EINVAL})
    result = back_with_huge_pages([(0, 3 * COLLAPSE_CHUNK)], fake)
    assert [c[2] for c in fake.calls] == [MADV_HUGEPAGE, MADV_COLLAPSE]
    assert result.collapsed_bytes == 0 and "EINVAL" in result.error
    assert "stays on 4 KiB pages" in result.describe()


def test_a_busy_kernel_still_tries_every_chunk():
    fake = FakeMadvise(refuse={MADV_COLLAPSE: errno.EAGAIN})
    back_with_huge_pages([(0, 3 * COLLAPSE_CHUNK)], fake)
    assert [c[2] for c in fake.calls].count(MADV_COLLAPSE) == 3


def test_real_madvise_keeps_the_bytes_and_never_raises():
    buf = mmap.mmap(-1, 8 * HUGE_PAGE)  # anonymous, page-aligned, like a large torch allocation
    data = np.frombuffer(buf, dtype=np.uint8)
    data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)
    expected = data.copy()
    result = back_with_huge_pages([(data.ctypes.data, data.nbytes)])
    assert result.requested_bytes >= 6 * HUGE_PAGE and 0 <= result.collapsed_bytes <= result.requested_bytes
    assert np.array_equal(data, expected)
    del data
    buf.close()
