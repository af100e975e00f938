"""One table's insert-plane work (reserves and commits), run by one pool job at a time, batched.

A lane keeps at most one pool job per table for the insert plane: the
reserves and commits that arrive while it runs are taken together by its next
jobs, in arrival order (a run of reserves in one job, a run of commits in one
``insert_many``). Same-host writers then never contend with each other for the
table's lock, and the pool keeps threads free for the other calls (a learner's
Select and Release do not queue behind a crowd of commits).

Semantics are those of one ``TableCalls.insert_many`` per message: items of a
message go in order, the rate limiter holds the lane (later messages of the
table wait behind it, as they would behind the limiter), an error stops its
own message (its earlier items stay inserted and acknowledged) and not the
others, and a message whose caller left before its turn is skipped. The lane's
job is cancelled when every caller it serves has left.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gear_server.rpc.table_calls import TableCalls

OnInserted = Callable[[Any, Any], None]


@dataclass
class _Message:
    pairs: Sequence[tuple[Any, Any]]  # (table-like with .insert, item)
    on_inserted: OnInserted | None
    done: asyncio.Future
    inserted: int = 0


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future
    on_orphan: Callable[[Any], None] | None = None


class CommitLane:
    """Commits of one table, one pool job at a time (see module docstring)."""

    def __init__(self, calls: TableCalls):
        self._calls = calls
        self._queue: deque[_Message | _Call] = deque()
        self._task: asyncio.Task | None = None
        self._running: list[_Message] = []
        self._job: asyncio.Task | None = None
        self.jobs = 0  # pool jobs run (tests, benchmarks)
        self.messages = 0  # messages committed through them

    async def commit(self, pairs: Sequence[tuple[Any, Any]], on_inserted: OnInserted | None = None) -> None:
        """Insert ``pairs`` in order as ``TableCalls.insert_many(pairs, None, on_inserted)`` would."""
        await self._enqueue(_Message(pairs, on_inserted, asyncio.get_running_loop().create_future()))

    async def run(self, fn: Callable[..., Any], *args: Any, on_orphan: Callable[[Any], None] | None = None) -> Any:
        """``fn(*args)`` in the lane's order (work that takes the table's lock and never waits, e.g. reserve).

        A caller that leaves before its turn skips it; one that leaves while it runs has
        its result handed to ``on_orphan`` (on the pool: give back what it took).
        """
        return await self._enqueue(_Call(fn, args, asyncio.get_running_loop().create_future(), on_orphan))

    async def _enqueue(self, entry: _Message | _Call) -> Any:
        self._queue.append(entry)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())
        try:
            return await asyncio.shield(entry.done)
        except asyncio.CancelledError:
            if not entry.done.done():
                entry.done.cancel()
            elif isinstance(entry, _Call) and entry.on_orphan is not None and not entry.done.cancelled() \
                    and entry.done.exception() is None:  # answered as its caller left: give back what it took
                self._calls.executor.submit(entry.on_orphan, entry.done.result())
            self._maybe_cancel_job()
            raise

    def _maybe_cancel_job(self) -> None:
        """Every caller of the running job left: nobody waits for it (the rate limiter may hold it forever)."""
        if self._job is not None and self._running and all(m.done.cancelled() for m in self._running):
            self._job.cancel()

    async def _drain(self) -> None:
        try:
            while self._queue:
                kind = type(self._queue[0])
                batch = []
                while self._queue and type(self._queue[0]) is kind:  # a run of one kind, in arrival order
                    entry = self._queue.popleft()
                    if not entry.done.done():
                        batch.append(entry)
                if batch:
                    try:
                        await (self._apply(batch) if kind is _Message else self._call(batch))
                    except asyncio.CancelledError:
                        self._fail(batch, None)
                        raise
                    except BaseException as e:  # noqa: BLE001 - the pool is gone (the daemon stops): callers hear it
                        self._fail(batch, e)
        finally:
            self._task = None
            if self._queue:  # arrived as the lane ended (cancelled): start again for them
                self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _call(self, batch: list[_Call]) -> None:
        """A run of calls in one pool job; each call's result or error goes to its caller."""
        def run_all() -> list[tuple[bool, Any]]:
            out = []
            for call in batch:
                if call.done.cancelled():  # its caller left before its turn
                    out.append((False, None))
                    continue
                try:
                    out.append((True, call.fn(*call.args)))
                except Exception as e:  # noqa: BLE001 - handed to its caller
                    out.append((False, e))
            return out

        self.jobs += 1
        results = await asyncio.shield(self._calls.run(run_all))
        for call, (ok, value) in zip(batch, results, strict=True):
            if call.done.done():
                if ok and call.on_orphan is not None:
                    self._calls.executor.submit(call.on_orphan, value)
                continue
            if ok:
                call.done.set_result(value)
            else:
                call.done.set_exception(value)

    async def _apply(self, batch: list[_Message]) -> None:
        """The batch's messages in order; each message's own error ends only that message."""
        start = 0
        while start < len(batch):
            pending = [m for m in batch[start:] if not m.done.done()]
            if not pending:
                return
            pairs: list[tuple[Any, Any]] = []
            owner: list[int] = []  # message index (in pending) of each pair
            for index, message in enumerate(pending):
                pairs.extend(message.pairs)
                owner.extend([index] * len(message.pairs))
            progress = [0]

            def inserted(table: Any, item: Any, _owner=owner, _pending=pending, _progress=progress) -> None:
                message = _pending[_owner[_progress[0]]]
                _progress[0] += 1
                message.inserted += 1
                if message.on_inserted is not None:
                    message.on_inserted(table, item)

            self._running = pending
            self._job = asyncio.get_running_loop().create_task(self._calls.insert_many(pairs, None, inserted))
            self.jobs += 1
            try:
                await self._job
                error = None
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # the lane itself is cancelled (the daemon stops)
                error = asyncio.CancelledError()
            except BaseException as e:  # noqa: BLE001 - handed to the message it belongs to
                error = e
            finally:
                self._job = None
                self._running = []
            reached = progress[0]
            done_messages = len(pending) if error is None else owner[reached] if reached < len(owner) else len(pending)
            for message in pending[:done_messages]:
                self._finish(message, None)
            if error is None:
                return
            if reached >= len(owner):  # failed after the last pair (nothing of it left): all done
                return
            failing = pending[owner[reached]]
            self._finish(failing, error)
            batch = pending
            start = owner[reached] + 1

    @staticmethod
    def _fail(batch: list[_Message] | list[_Call], error: BaseException | None) -> None:
        """Every entry of a batch whose job broke ends with ``error`` (None: cancelled); none is left waiting."""
        for entry in batch:
            if not entry.done.done():
                if error is None:
                    entry.done.cancel()
                else:
                    entry.done.set_exception(error)

    def _finish(self, message: _Message, error: BaseException | None) -> None:
        self.messages += 1
        if message.done.done():
            return
        if error is None:
            message.done.set_result(None)
        elif isinstance(error, asyncio.CancelledError):
            message.done.cancel()
        else:
            message.done.set_exception(error)
