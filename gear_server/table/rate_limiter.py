"""Reverb's rate limiter: keeps the ratio of samples to inserts within bounds.

State is three counters (inserts, samples, deletes; every removal counts as a
delete). ``can_sample(n)`` is false while ``inserts - deletes <
min_size_to_sample``, else ``inserts * spi - samples - n >= min_diff``;
``can_insert(n)`` is true while ``inserts + n - deletes <= min_size_to_sample``,
else ``(inserts + n) * spi - samples <= max_diff``. Blocked calls wait on
condition variables that share the table's lock, until allowed, timed out
(``RateLimiterTimeout``) or cancelled (``TableClosedError``).

The table reserves a slot for an insert before copying its bytes outside the
lock; such an insert is *pending*: it counts against ``can_insert`` (so that
concurrent writers cannot overshoot ``max_diff``) but not for sampling, which
only sees items whose bytes are in.

Calls served from an event loop (the daemon's grpc.aio server) must not hold a
thread while they wait: they make non-blocking *attempts* under a ``WaitTicket``
(``with ticket.attempting(): table.insert(item, timeout=0)``). An attempt that
would block registers the ticket and raises ``WouldBlock``; the rate limiter
calls ``ticket.wake()`` (thread-safe, e.g. ``loop.call_soon_threadsafe``) once the
call may be allowed, and the caller attempts again. The ticket keeps one call's
stats across its attempts, so a call counts as limited once with its whole
wait, exactly like a blocking call.

Reported call stats follow Reverb 0.14 (``RateLimiter::Info``): ``completed`` is
the insert / sample counter itself, so ``reset`` (the table's Reset) zeroes it and
a restored checkpoint brings it back. ``limited`` and the wait times are gear's
additions (Reverb 0.14 leaves them 0): cumulative since the table was built, never
reset, so that the metrics built on them only grow.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import CallCancelled, RateLimiterTimeout, SamplingStopped, TableClosedError

_STOPPED = "the daemon is stopping: it takes no more samples (sample again once it is back)"


class LimiterCounts(NamedTuple):
    """A rate limiter's counters (``RateLimiter.counts``)."""

    inserts: int
    samples: int
    deletes: int
    pending_inserts: int  # admitted by the limiter, not yet committed or abandoned


class WouldBlock(RateLimiterTimeout):
    """A non-blocking attempt (under a ``WaitTicket``) is not allowed yet; the ticket will be woken."""


class CallStats:
    """Limited count and wait times of one kind of call (insert or sample); cumulative, never reset.

    Thread-safe on its own: a ticket of an event-loop call finishes its event without the table's lock.
    """

    def __init__(self) -> None:
        self.limited = 0
        self.completed_wait_s = 0.0
        self._pending: dict[int, float] = {}  # event id -> start (monotonic)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self) -> int:
        with self._lock:
            event = next(self._ids)
            self._pending[event] = time.monotonic()
            return event

    def finish(self, event: int, blocked: bool) -> None:
        with self._lock:
            start = self._pending.pop(event, None)
            if blocked and start is not None:
                self.limited += 1
                self.completed_wait_s += time.monotonic() - start

    def discard(self, event: int) -> None:
        """Forget a call whose caller went away (its RPC was cancelled): it did not happen."""
        with self._lock:
            self._pending.pop(event, None)

    def to_proto(self, completed: int) -> pb.RateLimiterCallStats:
        """The stats as reported; ``completed`` is the rate limiter's counter of such calls (as Reverb 0.14)."""
        now = time.monotonic()
        with self._lock:
            pending = sum(now - s for s in self._pending.values())
            limited, waited = self.limited, self.completed_wait_s
        return pb.RateLimiterCallStats(completed=completed, limited=limited, completed_wait_time_s=waited,
                                       pending_wait_time_s=pending)


_current_ticket: contextvars.ContextVar[WaitTicket | None] = contextvars.ContextVar("gear_wait_ticket", default=None)


class WaitTicket:
    """One event-loop call's wait on a rate limiter, across its non-blocking attempts.

    ``wake`` is called (from any thread, possibly with a table lock held: it must
    only schedule) when the call may now be allowed. Attempts run inside
    ``attempting()``; set ``final`` for the last attempt at the deadline (it raises
    RateLimiterTimeout instead of WouldBlock). ``settle()`` after an attempt that
    made progress ends a wait it was in; ``abandon()`` when the caller goes away.
    """

    __slots__ = ("wake", "final", "blocked_now", "_blocked", "_stats", "_event", "_limiter", "_what")

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.final = False
        self.blocked_now = False  # the latest attempt ended waiting
        self._blocked = False  # the open wait has blocked at least once
        self._stats: CallStats | None = None
        self._event: int | None = None
        self._limiter: RateLimiter | None = None
        self._what = ""

    @contextlib.contextmanager
    def attempting(self) -> Iterator[None]:
        """Run one attempt: rate-limiter waits inside it do not block (WouldBlock instead)."""
        self.blocked_now = False
        token = _current_ticket.set(self)
        try:
            yield
        finally:
            _current_ticket.reset(token)

    @property
    def waiting(self) -> bool:
        """A wait of this call is in progress (its stats event is open)."""
        return self._event is not None

    def begin(self, limiter: RateLimiter, what: str, stats: CallStats) -> None:
        if self._event is None:
            self._stats, self._event, self._blocked = stats, stats.start(), False
        self._limiter, self._what = limiter, what

    def block(self) -> None:
        """The latest attempt must wait (it is registered with the limiter)."""
        self._blocked = self.blocked_now = True

    def settle(self) -> None:
        """The wait ended (allowed, table closed or timed out): counted as a blocking call would be."""
        if self._event is not None:
            self._stats.finish(self._event, self._blocked)
            self._event = None
        self._unregister()

    def abandon(self) -> None:
        """The caller went away: its wait did not happen; a wake it received goes to the next waiter."""
        if self._event is not None:
            self._stats.discard(self._event)
            self._event = None
        if self._limiter is not None and not self._limiter.unregister(self._what, self):
            self._limiter.wake_next(self._what)  # it was woken: pass the wake on
        self._limiter = None

    def _unregister(self) -> None:
        if self._limiter is not None:
            self._limiter.unregister(self._what, self)
            self._limiter = None


class RateLimiter:
    """Reverb semantics; every method must be called with ``lock`` held."""

    def __init__(self, options: pb.RateLimiterOptions, lock: threading.Lock | threading.RLock):
        self.samples_per_insert = float(options.samples_per_insert)
        self.min_size_to_sample = int(options.min_size_to_sample)
        self.min_diff = float(options.min_diff)
        self.max_diff = float(options.max_diff)
        for name in ("samples_per_insert", "min_diff", "max_diff"):
            if math.isnan(getattr(self, name)):
                raise ValueError(f"rate limiter {name} is NaN")
        self.inserts = 0
        self.samples = 0
        self.deletes = 0
        self.pending_inserts = 0
        self.cancelled = False
        self.sampling_stopped = False  # the daemon is draining: no sample is allowed any more
        self.insert_stats = CallStats()
        self.sample_stats = CallStats()
        self._can_insert_cv = threading.Condition(lock)
        self._can_sample_cv = threading.Condition(lock)
        self._insert_waiters = 0
        self._sample_waiters = 0
        # Event-loop calls that attempted and would have blocked, oldest first; woken on changes.
        self._tickets: dict[str, dict[WaitTicket, None]] = {"insert": {}, "sample": {}}
        self._tickets_lock = threading.Lock()  # tickets leave from the event loop, without the table lock

    # ------------------------------------------------------------ predicates
    def can_sample(self, n: int = 1) -> bool:
        if self.sampling_stopped:
            return False
        if self.inserts - self.deletes < max(self.min_size_to_sample, 1):
            return False
        return self.inserts * self.samples_per_insert - self.samples - n >= self.min_diff

    def can_insert(self, n: int = 1) -> bool:
        inserts = self.inserts + self.pending_inserts
        if inserts + n - self.deletes <= self.min_size_to_sample:
            return True
        return (inserts + n) * self.samples_per_insert - self.samples <= self.max_diff

    def samples_allowed_now(self, limit: int) -> int:
        """The largest m <= limit with can_sample(m) (0 if none): samples that may run without waiting."""
        if limit <= 0 or not self.can_sample(1):
            return 0
        room = self.inserts * self.samples_per_insert - self.samples - self.min_diff
        m = int(min(limit, math.floor(room))) if math.isfinite(room) else limit
        m = max(m, 1)
        while m > 1 and not self.can_sample(m):  # guard against floating-point rounding
            m -= 1
        return m

    # ------------------------------------------------------------ waiting
    def await_insert(self, deadline: float | None, abandoned=None) -> None:
        """Wait until one more insert is allowed, then mark it pending.

        ``abandoned()`` true (checked at every wake-up, see ``wake_all``) ends the wait with CallCancelled.
        """
        self._await("insert", lambda: self.can_insert(1), deadline, abandoned)
        self.pending_inserts += 1

    def await_sample(self, deadline: float | None, ready=None, abandoned=None) -> None:
        """Wait until one sample is allowed (and ``ready()``, if given, holds); does not count it.

        ``abandoned()`` true (checked at every wake-up, see ``wake_all``) ends the wait with CallCancelled.
        """
        self._await("sample", lambda: self.can_sample(1) and (ready is None or ready()), deadline, abandoned)

    def _await(self, what: str, allowed: Callable[[], bool], deadline: float | None, abandoned) -> None:
        """Wait (lock held) until ``allowed()``; ``what`` ("insert" or "sample") picks the condition
        variable, waiter count and stats. TableClosedError, CallCancelled or RateLimiterTimeout end it."""
        cv = self._can_insert_cv if what == "insert" else self._can_sample_cv
        stats = self.insert_stats if what == "insert" else self.sample_stats
        ticket = _current_ticket.get()
        if ticket is not None:
            return self._attempt(what, allowed, ticket, stats)
        waiters = f"_{what}_waiters"
        event = stats.start()
        blocked: bool | None = False
        try:
            while True:
                if what == "sample" and self.sampling_stopped:
                    raise SamplingStopped(_STOPPED)
                if self.cancelled:
                    raise TableClosedError(f"table closed while a{'n' if what == 'insert' else ''} {what} waited "
                                           "on the rate limiter")
                if abandoned is not None and abandoned():
                    blocked = None
                    raise CallCancelled(f"the {what} was cancelled while it waited on the rate limiter")
                if allowed():
                    break
                blocked = True
                setattr(self, waiters, getattr(self, waiters) + 1)
                try:
                    in_time = _wait(cv, deadline)
                finally:
                    setattr(self, waiters, getattr(self, waiters) - 1)
                if not in_time:
                    if self.cancelled:
                        continue
                    if allowed():
                        break
                    raise RateLimiterTimeout(
                        f"Rate Limiter: Timeout exceeded before the right to {what} was acquired.")
        finally:
            # A wait whose caller went away is forgotten; any other wait (timed out included)
            # adds to the limited count and wait time when it was blocked.
            if blocked is None:
                stats.discard(event)
            else:
                stats.finish(event, blocked)

    def _attempt(self, what: str, allowed: Callable[[], bool], ticket: WaitTicket, stats: CallStats) -> None:
        """The non-blocking form of ``_await`` (lock held): allowed now, or register the ticket and raise."""
        ticket.begin(self, what, stats)
        if what == "sample" and self.sampling_stopped:
            ticket.settle()
            raise SamplingStopped(_STOPPED)
        if self.cancelled:
            ticket.settle()
            raise TableClosedError(f"table closed while a{'n' if what == 'insert' else ''} {what} waited "
                                   "on the rate limiter")
        if allowed():
            ticket.settle()
            return
        if ticket.final:
            ticket.settle()
            raise RateLimiterTimeout(f"Rate Limiter: Timeout exceeded before the right to {what} was acquired.")
        with self._tickets_lock:
            self._tickets[what][ticket] = None
        ticket.block()
        raise WouldBlock(f"the {what} must wait for the rate limiter")

    def unregister(self, what: str, ticket: WaitTicket) -> bool:
        """Take a ticket off the waiters; False if it was not there (already woken)."""
        with self._tickets_lock:
            return self._tickets[what].pop(ticket, False) is None

    def wake_next(self, what: str) -> None:
        """Wake the oldest waiting ticket of ``what`` (a woken caller left without attempting)."""
        self._wake_tickets(what, 1)

    def _wake_tickets(self, what: str, limit: int | None) -> None:
        """Wake (and unregister) up to ``limit`` oldest tickets (None: all)."""
        tickets = self._tickets[what]
        if not tickets:
            return
        with self._tickets_lock:
            woken = list(itertools.islice(tickets, limit))
            for ticket in woken:
                del tickets[ticket]
        for ticket in woken:
            ticket.wake()

    def _wake_allowed_tickets(self) -> None:
        """Wake as many ticket holders as the limiter now allows calls (each takes at least one)."""
        inserts = self._tickets["insert"]
        if inserts:
            n = 0
            while n < len(inserts) and self.can_insert(n + 1):
                n += 1
            if n:
                self._wake_tickets("insert", n)
        samples = self._tickets["sample"]
        if samples:
            n = self.samples_allowed_now(len(samples))
            if n:
                self._wake_tickets("sample", n)

    # ------------------------------------------------------------ counters
    def insert_committed(self) -> None:
        self.pending_inserts -= 1
        self.inserts += 1
        self.notify()

    def insert_abandoned(self) -> None:
        """A reserved insert did not happen (turned into an update, or failed)."""
        self.pending_inserts -= 1
        self.notify()

    def sampled(self, n: int = 1) -> None:
        self.samples += n
        self.notify()

    def deleted(self, n: int = 1) -> None:
        self.deletes += n
        self.notify()

    def reset(self) -> None:
        """Zero the counters (Reverb's Reset); the cumulative limited / wait stats stay."""
        self.inserts = 0
        self.samples = 0
        self.deletes = 0
        self.notify()

    def cancel(self) -> None:
        self.cancelled = True
        self._can_insert_cv.notify_all()
        self._can_sample_cv.notify_all()
        self._wake_tickets("insert", None)
        self._wake_tickets("sample", None)

    def stop_sampling(self) -> None:
        """No more samples (a graceful stop): every waiting sample ends with SamplingStopped, taking nothing."""
        self.sampling_stopped = True
        self._can_sample_cv.notify_all()
        self._wake_tickets("sample", None)

    def notify(self) -> None:
        """Wake waiters whose condition may now hold."""
        if self._insert_waiters and self.can_insert(1):
            self._can_insert_cv.notify_all()
        if self._sample_waiters and self.can_sample(1):
            self._can_sample_cv.notify_all()
        self._wake_allowed_tickets()

    def wake_all(self) -> None:
        """Wake every waiter so it re-checks its ``abandoned`` callable (lock held)."""
        self._can_insert_cv.notify_all()
        self._can_sample_cv.notify_all()

    def notify_samplers(self) -> None:
        """Wake samplers unconditionally (the table's own readiness changed)."""
        if self._sample_waiters:
            self._can_sample_cv.notify_all()
        self._wake_tickets("sample", None)

    # ------------------------------------------------------------ reporting
    def info(self) -> pb.RateLimiterInfo:
        return pb.RateLimiterInfo(
            samples_per_insert=self.samples_per_insert, min_diff=self.min_diff, max_diff=self.max_diff,
            min_size_to_sample=self.min_size_to_sample, insert_stats=self.insert_stats.to_proto(self.inserts),
            sample_stats=self.sample_stats.to_proto(self.samples), num_deletes=self.deletes,
        )

    def counts(self) -> LimiterCounts:
        """The counters it decides with, and the inserts admitted but not yet committed."""
        return LimiterCounts(self.inserts, self.samples, self.deletes, self.pending_inserts)

    def state(self) -> dict[str, int]:
        return {"inserts": self.inserts, "samples": self.samples, "deletes": self.deletes}

    def restore(self, state: dict[str, int]) -> None:
        self.inserts = int(state["inserts"])
        self.samples = int(state["samples"])
        self.deletes = int(state["deletes"])
        self.notify()


def deadline_after(timeout: float | None) -> float | None:
    """A monotonic deadline for a timeout in seconds (None: wait forever)."""
    return None if timeout is None else time.monotonic() + max(0.0, float(timeout))


def _wait(cv: threading.Condition, deadline: float | None) -> bool:
    """Wait on cv until notified or the deadline; False when the deadline has passed."""
    if deadline is None:
        cv.wait()
        return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    cv.wait(remaining)
    return time.monotonic() < deadline
