"""Back a CPU KV cache with transparent huge pages before it is registered with NIXL.

On a CPU host UCX moves KV with process_vm_writev/readv, which looks up and pins the other process's
memory page by page. vLLM's CPU KV cache is an ordinary torch allocation: 4 KiB pages (THP is
"madvise" on most distributions, and torch does not ask), so a 96 MiB push walks ~24,600 pages on
each side. Collapsing the cache into 2 MiB pages once at start-up (MADV_HUGEPAGE, then MADV_COLLAPSE,
Linux 6.1+) makes that 48. Everything here is advice: where the kernel refuses (older kernel, THP
disabled, no free huge pages) the cache keeps working on small pages and the result says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import time
from dataclasses import dataclass
from typing import Callable, Sequence

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
COLLAPSE_CHUNK = 64 * HUGE_PAGE  # 128 MiB per call: a refusal costs at most this much

Madvise = Callable[[int, int, int], int]  # (address, length, advice) -> 0 or an errno


@dataclass(frozen=True)
class HugePageResult:
    requested_bytes: int  # the 2 MiB-aligned part of the spans
    collapsed_bytes: int
    seconds: float
    error: str = ""  # why some or all of it stayed on small pages

    def describe(self) -> str:
        mib = 1024 * 1024
        text = (f"{self.collapsed_bytes // mib} of {self.requested_bytes // mib} MiB of the KV cache on 2 MiB pages "
                f"({self.seconds:.2f} s)")
        return f"{text}; the rest stays on 4 KiB pages: {self.error}" if self.error else text


def aligned_inside(start: int, length: int) -> tuple[int, int] | None:
    """The largest huge-page-aligned range inside [start, start+length), or None."""
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + length) // HUGE_PAGE * HUGE_PAGE
    return (first, end - first) if end > first else None


def back_with_huge_pages(spans: Sequence[tuple[int, int]], madvise: Madvise | None = None) -> HugePageResult:
    """Ask for huge pages on each span, then collapse what is already there, chunk by chunk so that
    one refusal (e.g. no free huge page) does not give up on the rest."""
    madvise = madvise or _libc_madvise()
    started = time.monotonic()
    requested = collapsed = 0
    errors: list[str] = []
    for span in spans:
        inner = aligned_inside(*span)
        if inner is None:
            continue
        address, length = inner
        requested += length
        err = madvise(address, length, MADV_HUGEPAGE)
        if err:
            errors.append(f"MADV_HUGEPAGE: {_name(err)}")
            continue
        for offset in range(0, length, COLLAPSE_CHUNK):
            size = min(COLLAPSE_CHUNK, length - offset)
            err = madvise(address + offset, size, MADV_COLLAPSE)
            if err:
                errors.append(f"MADV_COLLAPSE: {_name(err)}")
                if err in (errno.EINVAL, errno.EPERM):  # not supported here: the rest would fail alike
                    break
            else:
                collapsed += size
    return HugePageResult(requested, collapsed, time.monotonic() - started, "; ".join(sorted(set(errors))))


def _name(err: int) -> str:
    return errno.errorcode.get(err, str(err))


def _libc_madvise() -> Madvise:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int

    def madvise(address: int, length: int, advice: int) -> int:
        return ctypes.get_errno() if libc.madvise(address, length, advice) != 0 else 0

    return madvise
