"""Host memory the GPU reads directly: a segment (mmap) registered with cudaHostRegister, mapped.

The gather kernel reads table segments over PCIe with no staging copy; for
that the pages are pinned and mapped into the device's address space, and the
kernel is given the device pointer (which equals the host pointer where the
device supports it, and is asked for otherwise).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import require_cupy

# CUDA runtime constants (cudaHostRegister flags and device attributes).
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
HOST_REGISTER_READ_ONLY = 8
ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113


class HostRegistration:
    """A host buffer pinned and mapped for the current CUDA device.

    ``buffer`` is anything with the buffer protocol (an mmap of a shared-memory
    segment, a NumPy array). A read-only buffer (a segment mapped PROT_READ) is
    registered read-only. Close it (or use it as a context manager) before the
    buffer is unmapped.
    """

    def __init__(self, buffer: Any, *, read_only: bool | None = None):
        cp = require_cupy()
        self._cp = cp
        view = np.frombuffer(buffer, dtype=np.uint8)
        if view.nbytes == 0:
            raise ValueError("cannot register an empty buffer")
        if read_only is None:
            read_only = not view.flags.writeable
        device = cp.cuda.Device()
        attrs = cp.cuda.runtime
        if not attrs.deviceGetAttribute(ATTR_HOST_REGISTER_SUPPORTED, device.id):
            raise RuntimeError(f"GPU {device.id} does not support cudaHostRegister")
        if read_only and not attrs.deviceGetAttribute(ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, device.id):
            raise RuntimeError(f"GPU {device.id} cannot register read-only host memory")
        self.buffer = buffer
        self._view = view
        self.host_ptr = int(view.ctypes.data)
        self.size = int(view.nbytes)
        self.read_only = bool(read_only)
        self.device_id = device.id
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED | (HOST_REGISTER_READ_ONLY if read_only else 0)
        attrs.hostRegister(self.host_ptr, self.size, flags)
        self._registered = True
        try:
            same = attrs.deviceGetAttribute(ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, device.id)
            self.device_ptr = self.host_ptr if same else int(attrs.pointerGetAttributes(self.host_ptr).devicePointer)
            if not self.device_ptr:
                raise RuntimeError("cudaPointerGetAttributes gave no device pointer for registered memory")
        except Exception:
            self.close()
            raise

    def device_array(self, offset: int = 0, nbytes: int | None = None) -> Any:
        """A CuPy uint8 array over [offset, offset + nbytes) of the mapped buffer (no copy)."""
        cp = self._cp
        nbytes = self.size - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the {self.size}-byte registration")
        mem = cp.cuda.UnownedMemory(self.device_ptr + offset, nbytes, self)
        return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))

    def close(self) -> None:
        """Unpin and unmap (idempotent)."""
        if getattr(self, "_registered", False):
            self._registered = False
            self._cp.cuda.runtime.hostUnregister(self.host_ptr)
        self._view = None  # release the buffer export, so an mmap can be closed
        self.buffer = None

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
