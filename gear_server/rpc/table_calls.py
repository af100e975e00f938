"""Table calls from the event loop: the work on a bounded thread pool, the waits on asyncio.

The daemon serves every RPC on one asyncio event loop (grpc.aio). A table's
work (copying an item's bytes into its slot, picking a selection, encoding a
sample) runs on ``TableCalls.executor``, a small fixed pool, so the loop stays
free for the other calls. Waiting for the rate limiter holds no thread: the call
attempts without blocking (``WaitTicket``); when the limiter would block, the
ticket is registered and the call awaits an asyncio event that the limiter sets
(through ``loop.call_soon_threadsafe``) when its state changes, then attempts
again, until its deadline. Reverb's semantics are unchanged: a sample takes its
items one at a time as the limiter allows, a call past its timeout ends with
RateLimiterTimeout (after a last attempt), and its stats count it once as
limited with its whole wait.

A call whose RPC ends (the task is cancelled) leaves nothing behind: an attempt
already running finishes on its thread and whatever it leased is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from gear_server.errors import RateLimiterTimeout, SamplingStopped
from gear_server.table.items import ItemToInsert
from gear_server.table.rate_limiter import WaitTicket, WouldBlock
from gear_server.table.table import Selection, Table

T = TypeVar("T")


class JoinedSelection:
    """Several selections of one call as one: item i of the joined arrays, every part's lease."""

    _ARRAYS = ("slots", "generations", "lengths", "keys", "probabilities", "table_sizes", "priorities",
               "times_sampled")

    def __init__(self, parts: Sequence[Selection]):
        self.parts = list(parts)
        first = parts[0]
        for name in self._ARRAYS:  # one part (the common case): its own arrays, nothing copied
            setattr(self, name, getattr(first, name) if len(parts) == 1 else
                    np.concatenate([getattr(p, name) for p in parts]))
        # A later part saw the newer layout; a growth copies every slot, so earlier refs hold in it.
        self.layout_version = max(p.layout_version for p in parts)
        self.lease_ids = [p.lease_id for p in parts]
        self.lease_id = first.lease_id  # reading the joined slots checks one lease: all are held alike

    def __len__(self) -> int:
        return len(self.slots)


class CallsInProgress:
    """The sampling calls in progress (Sample RPCs, Selects over gRPC or the local lane): a graceful stop,
    once no table takes samples, waits for them to hand over what they took before it cancels calls.
    Thread-safe: local-lane calls run on threads of their own."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Count the enclosed call as in progress."""
        with self._idle:
            self._count += 1
        try:
            yield
        finally:
            with self._idle:
                self._count -= 1
                if not self._count:
                    self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no call is in progress; False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout)

    def __len__(self) -> int:
        return self._count


class TableCalls:
    """Runs table work on a bounded pool and rate-limiter waits on the event loop."""

    def __init__(self, workers: int, *, name: str = "gear-table"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool. Cancelling the caller does not interrupt it (it finishes)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ------------------------------------------------------------------ waits
    async def _attempt(self, ticket: WaitTicket, on_orphan: Callable[[Any], None] | None,
                       fn: Callable[..., T], *args: Any) -> T:
        """One non-blocking attempt on the pool; a result that arrives after the caller left goes to ``on_orphan``."""
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            def after(f: asyncio.Future) -> None:  # the attempt may have registered or leased after the caller left
                ticket.abandon()
                if on_orphan is not None and not f.cancelled() and f.exception() is None:
                    on_orphan(f.result())

            future.add_done_callback(after)
            raise

    async def insert(self, table: Table, item: ItemToInsert, timeout: float | None) -> None:
        """``table.insert(item)`` waiting for the rate limiter without holding a thread."""
        await self.insert_many([(table, item)], timeout)

    async def insert_many(self, items: Sequence[tuple[Table, ItemToInsert]], timeout: float | None,
                          on_inserted: Callable[[Table, ItemToInsert], None] | None = None) -> None:
        """Insert items in order; as many as the limiter allows go in one pool job.

        ``on_inserted(table, item)`` runs on the loop after each insert (acknowledgements, metrics).
        """
        waiter = _Waiter(timeout)
        ticket = waiter.ticket

        def insert_from(start: int) -> tuple[int, BaseException | None]:
            """Insert items[start:] until one fails or would block: (the index reached, that error)."""
            with ticket.attempting():
                for i in range(start, len(items)):
                    table, item = items[i]
                    try:
                        table.insert(item, timeout=0)
                    except BaseException as error:  # noqa: BLE001 (handed back with the progress made)
                        return i, error
            return len(items), None

        position = 0
        try:
            while position < len(items):
                waiter.arm()
                reached, error = await self._attempt(ticket, None, insert_from, position)
                if on_inserted is not None:
                    for i in range(position, reached):
                        on_inserted(*items[i])
                if reached > position and not ticket.blocked_now:
                    ticket.settle()
                position = reached
                if error is None:
                    break
                if not isinstance(error, WouldBlock):
                    raise error
                await waiter.wait()
        except BaseException:
            ticket.abandon()
            raise

    async def sample(self, table: Table, n: int, timeout: float | None, *,
                     by_reference: bool = False, rng: np.random.Generator | None = None) -> JoinedSelection:
        """``table.sample(n)``: n items, each as the limiter allows, fewer only if the timeout passes after some.

        RateLimiterTimeout when not one item was allowed before the timeout. ``by_reference`` and
        ``rng``: Table.sample's arguments.
        """
        return (await self.sample_batches(table, n, timeout, 1, by_reference=by_reference, rng=rng))[0]

    async def sample_batches(self, table: Table, n: int, timeout: float | None, batches: int, *,
                             by_reference: bool = False, prelude: Callable[[], None] | None = None,
                             rng: np.random.Generator | None = None) -> list[JoinedSelection]:
        """The first batch as ``sample``; then up to ``batches - 1`` more of ``n`` items each, taken
        in the same pool job as the first batch's end, only while the limiter allows them at once.

        ``prelude()`` runs first, in the first pool job (work that takes table locks, saved a hop).
        """
        waiter = _Waiter(timeout)
        ticket = waiter.ticket
        parts: list[Selection] = []
        extra: list[Selection] = []
        taken = 0

        def attempt(want: int) -> tuple[Selection, list[Selection]]:
            nonlocal prelude
            if prelude is not None:
                prelude, run_first = None, prelude
                run_first()
            with ticket.attempting():
                selection = table.sample(want, timeout=0, by_reference=by_reference, rng=rng)
            more = []
            if len(selection) == want and not ticket.blocked_now:
                more = _more_batches(table, n, batches - 1, by_reference)
            return selection, more

        def release_orphan(picked: tuple[Selection, list[Selection]]) -> None:
            for selection in (picked[0], *picked[1]):
                self.executor.submit(table.release, selection.lease_id)

        try:
            while taken < n:
                waiter.arm()
                try:
                    selection, extra = await self._attempt(ticket, release_orphan, attempt, n - taken)
                except WouldBlock:
                    selection = None
                except (RateLimiterTimeout, SamplingStopped):  # the deadline, or the daemon drains: nothing more
                    if parts:
                        break
                    raise
                if selection is not None:
                    parts.append(selection)
                    taken += len(selection)
                    if not ticket.blocked_now:
                        ticket.settle()
                if taken >= n or ticket.final:
                    break
                await waiter.wait()
        except BaseException:
            ticket.abandon()
            for selection in parts:
                self.executor.submit(table.release, selection.lease_id)
            raise
        ticket.abandon()  # a partial pick may have left it registered
        return [JoinedSelection(parts), *(JoinedSelection([e]) for e in extra)]


def _more_batches(table: Table, n: int, count: int, by_reference: bool) -> list[Selection]:
    """Up to ``count`` batches of ``n`` items the limiter allows now (no waiting; on the pool)."""
    more: list[Selection] = []
    while len(more) < count and table.can_sample(n):
        try:
            more.append(table.sample(n, timeout=0, by_reference=by_reference))
        except RateLimiterTimeout:  # another caller took them first
            break
    return more


class InlineTableCalls(TableCalls):
    """``TableCalls`` whose table work runs on the calling thread (awaited as before, waits still on
    asyncio): for a thread that runs an event loop of its own for one caller (a local-lane
    connection), where a hop to the pool and back would only add thread switches."""

    def __init__(self) -> None:  # no pool: nothing to shut down
        self.workers = 0
        self.executor = _Inline()

    def shutdown(self) -> None:
        pass

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    async def _attempt(self, ticket: WaitTicket, on_orphan: Callable[[Any], None] | None,
                       fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)  # nothing awaited meanwhile: the caller cannot leave mid-attempt


class _Inline:
    """An executor that runs what it is given at once (``InlineTableCalls``' releases)."""

    def submit(self, fn: Callable[..., T], *args: Any) -> None:
        fn(*args)


class _Waiter:
    """One call's ticket and the wake it waits for; the asyncio event is made only when it must wait."""

    __slots__ = ("ticket", "deadline", "_loop", "_event", "_woken")

    def __init__(self, timeout: float | None):
        self.deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        self._loop = asyncio.get_running_loop()
        self._event: asyncio.Event | None = None
        self._woken = False
        self.ticket = WaitTicket(self._wake)

    def _wake(self) -> None:  # any thread, maybe under a table lock: only schedule
        self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        self._woken = True
        if self._event is not None:
            self._event.set()

    def arm(self) -> None:
        """Before an attempt: forget earlier wakes (the attempt sees the state they announced)."""
        self._woken = False
        if self._event is not None:
            self._event.clear()

    async def wait(self) -> None:
        """Until woken; at the deadline, mark the next attempt final."""
        if self._woken:
            return
        if self._event is None:
            self._event = asyncio.Event()
        if self.deadline is None:
            await self._event.wait()
            return
        remaining = self.deadline - time.monotonic()
        if remaining > 0:
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
                return
            except TimeoutError:
                pass
        self.ticket.final = True
