"""Fixtures for the kernel tests: GPU skips (never faked) and poisoned device allocations."""

from __future__ import annotations

import pytest

from gear_kernels import gpu_available

POISON = 0xA5


@pytest.fixture
def cupy():
    """CuPy, with every new device allocation filled with POISON bytes, so an unwritten output fails."""
    if not gpu_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    import cupy as cp

    pool = cp.get_default_memory_pool()

    def poisoned_malloc(size: int):
        mem = pool.malloc(size)
        if size:
            cp.cuda.runtime.memset(mem.ptr, POISON, size)
        return mem

    with cp.cuda.using_allocator(poisoned_malloc):
        yield cp
    cp.cuda.Device().synchronize()
