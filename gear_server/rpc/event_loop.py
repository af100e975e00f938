"""An asyncio event loop on its own thread, driven from synchronous code.

The daemon's API is synchronous (``Daemon.start()`` returns the port, ``stop()``
returns once everything is down) while it serves on grpc.aio: the server lives
on this loop, and ``run(coroutine)`` hands work to it from any other thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop when installed (less CPU per RPC), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """A running event loop in a daemon thread named ``name``."""

    def __init__(self, name: str = "gear-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:  # tasks left (cancelled calls' cleanups) get to finish
                pending = asyncio.all_tasks(self.loop)
                for task in pending:
                    task.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result (not from the loop's own thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Future:
        """Start ``coroutine`` on the loop; a concurrent.futures.Future of its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
