"""A fixed sequence of copies and kernel launches, captured once as a CUDA graph and replayed.

Small, frequent calls (a batch of draws, a batch of priority updates) spend
more time in Python launch overhead than on the GPU. Captured as a graph, one
call is: fill a pinned input buffer, launch the graph, wait, read a pinned
output buffer. Inputs and outputs live at fixed addresses, so everything that
changes per call travels through them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np


def _pinned(cp: Any, nbytes: int) -> np.ndarray:
    size = max(nbytes, 16)
    return np.frombuffer(cp.cuda.alloc_pinned_memory(size), dtype=np.uint8, count=size)


class Replay:
    """``launch(dev_in, dev_out)`` (enqueuing on the current stream) captured with its input and output copies."""

    def __init__(self, cp: Any, in_nbytes: int, out_nbytes: int, launch: Callable[[Any, Any], None],
                 keep: tuple = ()):
        self._cp = cp
        self.host_in = _pinned(cp, in_nbytes)
        self.host_out = _pinned(cp, out_nbytes)
        self.dev_in = cp.empty(max(in_nbytes, 16), dtype=cp.uint8)
        self.dev_out = cp.empty(max(out_nbytes, 16), dtype=cp.uint8)
        self._keep = keep  # arrays the graph reads or writes: kept alive as long as it is
        h2d, d2h = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                if in_nbytes:
                    cp.cuda.runtime.memcpyAsync(self.dev_in.data.ptr, self.host_in.ctypes.data, in_nbytes, h2d,
                                                stream.ptr)
                launch(self.dev_in, self.dev_out)
                if out_nbytes:
                    cp.cuda.runtime.memcpyAsync(self.host_out.ctypes.data, self.dev_out.data.ptr, out_nbytes, d2h,
                                                stream.ptr)
            finally:
                self.graph = stream.end_capture()

    def run(self) -> None:
        """Replay on the current stream (so it is ordered after earlier work there) and wait for it."""
        stream = self._cp.cuda.get_current_stream()
        self.graph.launch(stream)
        stream.synchronize()


class ReplayCache:
    """The most recently used replays, by key."""

    def __init__(self, size: int = 16):
        self._size = size
        self._items: OrderedDict = OrderedDict()

    def get(self, key: tuple, build: Callable[[], Replay]) -> Replay:
        item = self._items.get(key)
        if item is None:
            item = self._items[key] = build()
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return item
