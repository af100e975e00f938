"""CuPy, when it and a GPU are there: loading, compiling and caching the .cu sources.

Every source is compiled with NVRTC once per process (and per device, by
CuPy) and cached. The shared header is inlined into the source text so that
CuPy's on-disk cache key covers it too.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

SOURCE_DIR = Path(__file__).resolve().parent
_HEADER = "gear_common.cuh"


@functools.cache
def cupy_module() -> Any | None:
    """The cupy module if it imports and sees at least one GPU, else None."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def gpu_available() -> bool:
    """True where CuPy and a CUDA GPU are usable in this process."""
    return cupy_module() is not None


def is_device_array(x: Any) -> bool:
    """True for a CuPy array (the GPU path); False for anything else (the NumPy twins)."""
    cp = cupy_module()
    return cp is not None and isinstance(x, cp.ndarray)


def require_cupy() -> Any:
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("gear_kernels: this needs CuPy and a CUDA GPU, and none is usable here")
    return cp


def source(name: str) -> str:
    """The text of kernels/<name>.cu with the shared header inlined."""
    text = (SOURCE_DIR / f"{name}.cu").read_text()
    header = (SOURCE_DIR / _HEADER).read_text().replace("#pragma once", "")
    return text.replace(f'#include "{_HEADER}"', header)


@functools.cache
def raw_module(name: str) -> Any:
    """kernels/<name>.cu compiled by NVRTC (through CuPy) once per process."""
    cp = require_cupy()
    return cp.RawModule(code=source(name), options=("--std=c++17", "--fmad=false"))


@functools.cache
def kernel(module: str, function: str) -> Any:
    """One extern "C" kernel of a module."""
    return raw_module(module).get_function(function)


class Staging:
    """A pinned host buffer for packing small host arrays into one host-to-device copy.

    Copies are asynchronous on the current stream; before the buffer is refilled
    the previous copy is waited for (an event), so a caller never overwrites bytes
    still in flight.
    """

    def __init__(self) -> None:
        self._host = None
        self._size = 0
        self._event = None
        self._lock = threading.Lock()
        self._down = None
        self._down_lock = threading.Lock()

    def download(self, array: Any) -> Any:
        """A NumPy copy of a contiguous device array, through a pinned buffer (waits for the copy)."""
        import numpy as np

        cp = require_cupy()
        array = cp.ascontiguousarray(array)
        nbytes = array.nbytes
        with self._down_lock:
            if self._down is None or self._down.nbytes < nbytes:
                size = max(nbytes, 1 << 16)
                self._down = np.frombuffer(cp.cuda.alloc_pinned_memory(size), dtype=np.uint8, count=size)
            stream = cp.cuda.get_current_stream()
            if nbytes:
                cp.cuda.runtime.memcpyAsync(self._down.ctypes.data, array.data.ptr, nbytes,
                                            cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            stream.synchronize()
            return self._down[:nbytes].view(array.dtype).reshape(array.shape).copy()

    def upload(self, arrays: list) -> list:
        """Device copies of host arrays (each 16-byte aligned inside one device buffer)."""
        import numpy as np

        cp = require_cupy()
        arrays = [np.ascontiguousarray(a) for a in arrays]
        with self._lock:
            return self._upload_locked(cp, np, arrays)

    def _upload_locked(self, cp: Any, np: Any, arrays: list) -> list:
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += (a.nbytes + 15) // 16 * 16
        total = max(total, 16)
        if self._event is not None:
            self._event.synchronize()
        if total > self._size:
            size = max(total, 1 << 16)
            mem = cp.cuda.alloc_pinned_memory(size)
            self._host = np.frombuffer(mem, dtype=np.uint8, count=size)
            self._size = size
        for a, off in zip(arrays, offsets, strict=True):
            self._host[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        device = cp.empty(total, dtype=cp.uint8)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(device.data.ptr, self._host.ctypes.data, total,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        if self._event is None:
            self._event = cp.cuda.Event(block=False, disable_timing=True)
        self._event.record(stream)
        return [device[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
                for a, off in zip(arrays, offsets, strict=True)]


@functools.cache
def staging() -> Staging:
    """The process's staging buffer (a lock serialises its users)."""
    return Staging()
