"""The calling thread's CUDA context, for NIXL calls made on threads CUDA has not seen.

UCX's CUDA IPC transport decides whether it can reach a peer's GPU memory when it unpacks the
peer's memory keys (NIXL's add_remote_agent); UCX releases whose key names no device ask the
calling thread's current CUDA context there, and a thread that never made a CUDA call has none:
such a UCX takes the memory as out of CUDA IPC's reach and moves every WRITE into it through its
software emulation over TCP. The connector makes peers and WRITEs on threads of its own, so it
binds the device's primary context (the one PyTorch and vLLM use) to such a thread first, through
libcuda directly (no torch import on these threads). The UCX inside nixl-cu13 1.5.1 did not need
it on an H200 (benchmarks/gpu_nixl_context.py: WRITEs from a context-less thread went over CUDA
IPC); it is a safeguard for UCX builds that do.
"""
from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

_local = threading.local()
_driver: ctypes.CDLL | None = None
_driver_lock = threading.Lock()


class CudaContextError(RuntimeError):
    """The driver refused a call needed to bind a context."""


def _libcuda() -> ctypes.CDLL:
    global _driver
    with _driver_lock:
        if _driver is None:
            lib = ctypes.CDLL("libcuda.so.1")
            _check(lib.cuInit(0), "cuInit")
            _driver = lib
        return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        raise CudaContextError(f"{call} failed with CUDA error {result}")


def current_context() -> int | None:
    """The calling thread's current CUDA context handle, or None."""
    ctx = ctypes.c_void_p()
    _check(_libcuda().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or None


def bind_device_context(device_id: int) -> bool:
    """Make `device_id`'s primary context current on the calling thread unless the thread has a
    context already. True if one is current afterwards; a failure is logged once per thread, and
    the NIXL call goes on (UCX then falls back, which the transfer's bytes/s shows)."""
    if getattr(_local, "device", None) == device_id:
        return True
    try:
        if current_context() is None:
            lib = _libcuda()
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            _check(lib.cuDeviceGet(ctypes.byref(dev), int(device_id)), "cuDeviceGet")
            _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    except (OSError, CudaContextError) as exc:
        if getattr(_local, "warned", False) is False:
            _local.warned = True
            log.warning("kvpush: cannot bind GPU %d's CUDA context to thread %s (%s); UCX may not reach the peer's GPU "
                        "memory through CUDA IPC", device_id, threading.current_thread().name, exc)
        return False
    _local.device = device_id
    return True
