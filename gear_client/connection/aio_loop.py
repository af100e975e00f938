"""One asyncio loop thread per process that drives the client's grpc.aio calls.

A sync gRPC stream costs two Python threads (the channel's spin thread and the
request-iterator thread) besides the caller's reader; with a thousand actors
in one process those threads, their wake-ups and their fight for the GIL are
most of a connect storm's time. Writers' streams (and the ServerInfo a writer
asks at start) run instead as coroutines on this one loop, whose gRPC work is
polled by grpc.aio's own poller: a writer costs no thread of its own.

The loop starts on first use, is made afresh in a forked child, and is
stopped at interpreter exit (bounded: a call still open is abandoned, never
waited for).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["alive", "call_soon", "in_loop", "loop", "run", "submit"]

T = TypeVar("T")
_STOP_TIMEOUT_S = 2.0

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid = 0


def loop() -> asyncio.AbstractEventLoop:
    """The process's loop, started on first use (and again in a forked child)."""
    global _loop, _thread, _pid
    current = _loop
    if current is not None and _pid == os.getpid():
        return current
    with _lock:
        if _loop is None or _pid != os.getpid():
            new = asyncio.new_event_loop()
            started = threading.Event()
            thread = threading.Thread(target=_serve, args=(new, started), name="gear-aio", daemon=True)
            thread.start()
            started.wait()
            _loop, _thread, _pid = new, thread, os.getpid()
        return _loop


def _serve(new: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(new)
    new.call_soon(started.set)
    try:
        new.run_forever()
    finally:
        try:
            for task in asyncio.all_tasks(new):
                task.cancel()
        except RuntimeError:
            pass


def alive() -> bool:
    """Whether this process's loop runs (started, and not stopped at exit)."""
    return _thread is not None and _pid == os.getpid() and _thread.is_alive() and _loop is not None \
        and _loop.is_running()


def in_loop() -> bool:
    """Whether the caller runs on the process's loop thread."""
    return _thread is not None and threading.current_thread() is _thread


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Schedule ``coro`` on the loop; its concurrent future."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds: TimeoutError)."""
    if in_loop():
        coro.close()
        raise RuntimeError("gear_client.connection.aio_loop.run called from the loop thread itself")
    future = submit(coro)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout} s") from None


def call_soon(fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on the loop thread (at once when already there); no-op once the loop is stopped."""
    current = _loop
    if current is None or _pid != os.getpid() or current.is_closed():
        return
    if in_loop():
        fn(*args)
        return
    try:
        current.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed meanwhile (interpreter exit)
        pass


@atexit.register
def _stop() -> None:
    """Stop the loop at exit without waiting on anything that is still open."""
    global _loop
    current, thread = _loop, _thread
    if current is None or thread is None or _pid != os.getpid():
        return
    try:
        current.call_soon_threadsafe(current.stop)
    except RuntimeError:
        return
    thread.join(_STOP_TIMEOUT_S)
