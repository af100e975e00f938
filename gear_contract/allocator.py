"""glibc allocator settings for processes that handle multi-MiB buffers (the daemon, learners, writers)."""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "GEAR_MALLOC_TUNING"
_allocator_tuned = False


def tune_allocator(mmap_threshold: int = 128 << 20, trim_threshold: int = 256 << 20, *, opt_in: bool = True) -> bool:
    """Keep freed multi-MiB buffers in the heap (glibc) so the next ones do not fault in fresh pages.

    Every sampled message and batch is a fresh multi-MiB buffer; with glibc's
    defaults the heap top is trimmed and the pages faulted in (and zeroed) again
    for nearly every message, which costs as much CPU as the copies themselves.
    Buffers under ``mmap_threshold`` come from the heap, and up to
    ``trim_threshold`` bytes of free heap are kept.

    ``mallopt`` changes the whole process, so the client library (``opt_in``,
    the default) applies it only when ``GEAR_MALLOC_TUNING=1``: the user's
    process is theirs to tune. The daemon passes ``opt_in=False``: it tunes its
    own process unless ``GEAR_MALLOC_TUNING=0``. Returns whether the settings
    are applied.
    """
    global _allocator_tuned
    setting = os.environ.get(ENV, "")
    wanted = setting == "1" if opt_in else setting != "0"
    if _allocator_tuned or not wanted or not sys.platform.startswith("linux"):
        return _allocator_tuned
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
        _allocator_tuned = bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold))) and \
            bool(libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):
        _allocator_tuned = False
    return _allocator_tuned
