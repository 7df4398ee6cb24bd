"""Back a CPU KV cache with transparent huge pages before it is registered with NIXL.

On a CPU host UCX moves KV with process_vm_writev/readv, which looks up and pins the other process's
memory page by page. vLLM's CPU KV cache is an ordinary torch allocation on base pages (THP is
"madvise" on most distributions, and torch asks for it only under THP_MEM_ALLOC_ENABLE=1), so a
96 MiB push walks ~24,600 4 KiB pages on each side. Collapsing the cache into huge pages once at
start-up (MADV_HUGEPAGE, then MADV_COLLAPSE, Linux 6.1+) makes that 48. Everything here is advice:
where the kernel refuses (older kernel, THP disabled, no free huge pages) or the time budget runs
out, the rest of the cache stays on base pages and the result says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
PMD_SIZE_FILE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
DEFAULT_BUDGET_S = 30.0  # ~2.4 s per GiB was measured with two instances starting on two busy cores
CHUNK_HUGE_PAGES = 64  # per MADV_COLLAPSE call: a refusal costs at most this much, the budget is checked between

Madvise = Callable[[int, int, int], int]  # (address, length, advice) -> 0 or an errno


@dataclass(frozen=True)
class HugePageResult:
    requested_bytes: int  # the huge-page-aligned part of the spans
    collapsed_bytes: int
    seconds: float
    page_size: int = 0
    error: str = ""  # why some or all of it stayed on base pages

    def describe(self) -> str:
        mib = 1024 * 1024
        text = (f"{self.collapsed_bytes // mib} of {self.requested_bytes // mib} MiB of the KV cache on "
                f"{self.page_size // mib} MiB pages ({self.seconds:.2f} s)")
        return f"{text}; the rest stays on base pages: {self.error}" if self.error else text


def huge_page_size() -> int:
    """The kernel's transparent huge page size (2 MiB on x86-64, 512 MiB on arm64 with 64 KiB pages);
    0 where the kernel has no THP."""
    try:
        return int(PMD_SIZE_FILE.read_text())
    except (OSError, ValueError):
        return 0


def merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans that touch or overlap joined: a huge page may straddle two adjacent allocations (K and
    V of a layer), which NIXL must keep apart but madvise need not."""
    out: list[list[int]] = []
    for start, end in sorted((s, s + n) for s, n in spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e - s) for s, e in out]


def aligned_inside(start: int, length: int, page: int) -> tuple[int, int] | None:
    """The largest page-aligned range inside [start, start+length), or None."""
    first = -(-start // page) * page
    end = (start + length) // page * page
    return (first, end - first) if end > first else None


def back_with_huge_pages(spans: Sequence[tuple[int, int]], madvise: Madvise | None = None, *,
                         page_size: int | None = None, budget_s: float = DEFAULT_BUDGET_S,
                         clock: Callable[[], float] = time.monotonic) -> HugePageResult:
    """Ask for huge pages on each span, then collapse what is already there, chunk by chunk, so that
    a busy kernel (no free huge page now) does not give up on the rest and a large cache does not
    hold start-up beyond `budget_s`."""
    page = huge_page_size() if page_size is None else page_size
    started = clock()
    if page <= 0:
        return HugePageResult(0, 0, 0.0, 0, "this kernel has no transparent huge pages")
    madvise = madvise or _libc_madvise()
    ranges = [r for r in (aligned_inside(s, n, page) for s, n in merged(spans)) if r is not None]
    requested = sum(n for _, n in ranges)
    collapsed = 0
    errors: set[str] = set()
    chunk = CHUNK_HUGE_PAGES * page
    for address, length in ranges:
        err = madvise(address, length, MADV_HUGEPAGE)
        if err:
            errors.add(f"MADV_HUGEPAGE: {_name(err)}")
            continue
        for offset in range(0, length, chunk):
            if clock() - started > budget_s:
                errors.add(f"stopped after the {budget_s:g} s start-up budget")
                return HugePageResult(requested, collapsed, clock() - started, page, "; ".join(sorted(errors)))
            size = min(chunk, length - offset)
            err = madvise(address + offset, size, MADV_COLLAPSE)
            if not err:
                collapsed += size
                continue
            errors.add(f"MADV_COLLAPSE: {_name(err)}")
            if err in (errno.EINVAL, errno.EPERM):  # not supported here: every other range would fail alike
                return HugePageResult(requested, collapsed, clock() - started, page, "; ".join(sorted(errors)))
    return HugePageResult(requested, collapsed, clock() - started, page, "; ".join(sorted(errors)))


def _name(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def _libc_madvise() -> Madvise:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int

    def madvise(address: int, length: int, advice: int) -> int:
        return ctypes.get_errno() if libc.madvise(address, length, advice) != 0 else 0

    return madvise
