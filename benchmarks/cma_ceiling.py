"""The ceiling of a CPU push on this host: `process_vm_writev` (what UCX's CMA transport calls for a
NIXL WRITE between two processes) against a plain memory copy of the same bytes, writer and receiver
each on one core. No NIXL, no UCX: just the kernel call, in the chunk sizes a WRITE's descriptors have.

    python benchmarks/cma_ceiling.py [--mib 96] [--writer-core 0] [--receiver-core 1] [--huge-pages]

Compare with `tests/integration/connector/bench_write.py` (the same bytes through kvpush's Producer).
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time

import numpy as np

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20
REPEATS = 5


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc = ctypes.CDLL(None, use_errno=True)


def buffer(nbytes: int, huge_pages: bool) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous memory aligned to 2 MiB, faulted in (so page faults are not timed)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    offset = (-raw.ctypes.data) % HUGE_PAGE
    arr = raw[offset:offset + nbytes]
    if huge_pages:
        libc.madvise(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    arr[:] = 1
    return region, arr


def write_into(pid: int, src: np.ndarray, remote_addr: int, chunk: int) -> None:
    for offset in range(0, src.nbytes, chunk):
        length = min(chunk, src.nbytes - offset)
        local = IoVec(src.ctypes.data + offset, length)
        remote = IoVec(remote_addr + offset, length)
        if libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != length:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=96)
    ap.add_argument("--writer-core", type=int, default=0)
    ap.add_argument("--receiver-core", type=int, default=1)
    ap.add_argument("--huge-pages", action="store_true", help="advise 2 MiB pages on both buffers")
    args = ap.parse_args(argv)
    nbytes = args.mib << 20
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the receiver: holds a buffer and waits to be killed
        try:
            os.sched_setaffinity(0, {args.receiver_core})
            _region, dst = buffer(nbytes, args.huge_pages)
            os.write(ready_w, f"{dst.ctypes.data:032d}".encode())
        except Exception as exc:  # noqa: BLE001 - report and let the parent's read end
            print(f"cma_ceiling: receiver: {exc}", file=sys.stderr)
            os._exit(1)
        time.sleep(600)
        os._exit(0)
    os.close(ready_w)  # so the read below ends if the receiver dies before answering
    try:
        os.sched_setaffinity(0, {args.writer_core})
        answer = os.read(ready_r, 32)
        if not answer:
            raise SystemExit("cma_ceiling: the receiver process failed to start (see above)")
        remote_addr = int(answer)
        _src_region, src = buffer(nbytes, args.huge_pages)
        _dst_region, local_dst = buffer(nbytes, args.huge_pages)
        for chunk_kib in (nbytes >> 10, 4096, 512, 128, 64):
            chunk = chunk_kib << 10
            write_s = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                write_into(pid, src, remote_addr, chunk)
                write_s.append(time.perf_counter() - started)
            copy_s = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                np.copyto(local_dst, src)
                copy_s.append(time.perf_counter() - started)
            pvw, cpy = nbytes / statistics.median(write_s) / 1e9, nbytes / statistics.median(copy_s) / 1e9
            print(f"{args.mib} MiB in {chunk_kib:>6} KiB calls: process_vm_writev {pvw:.2f} GB/s, memcpy {cpy:.2f} GB/s "
                  f"-> {100 * pvw / cpy:.0f}% (medians of {REPEATS})", flush=True)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
