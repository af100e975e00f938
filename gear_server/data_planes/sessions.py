"""Data-plane sessions and the leases they hold.

A learner's session is bound to one table and one plane. Each ``Select`` takes
a table lease on the selected slots (the table will not rewrite a leased slot)
and records it here with a deadline. The lease ends when the learner releases
it, when its deadline passes (a stalled or dead learner), or when the session
ends (closed, or idle past its timeout). Release reports a lease *stale* when
the learner can no longer trust the bytes it read under it: the lease had
expired, or a slot's generation moved (the table bumps a slot's generation
before it writes the slot, so an unchanged generation at release time means no
write touched the slot while the learner read it).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Expired lease ids remembered per session (to answer Release with "stale").
MAX_REMEMBERED_EXPIRED = 4096
DEFAULT_MAX_SESSIONS = 4096
# Sessions one peer may hold open (config: [data_planes] max_sessions_per_peer), so a
# single client cannot take every session and push the other learners to inline.
DEFAULT_MAX_SESSIONS_PER_PEER = 1024
PER_PEER_KEY = "[data_planes] max_sessions_per_peer"


def peer_identity(context: Any) -> str:
    """Who opens a session: the client certificate's name under mutual TLS, else the peer's address.

    The port is left out (a client reconnecting, or opening several channels,
    stays the same peer); a bearer token is shared by every client, so it
    identifies nobody.
    """
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - a context without auth data (tests, in-process calls)
        auth = {}
    names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name")
    if names:
        return "cert:" + b",".join(sorted(names)).decode(errors="replace")
    try:
        peer = context.peer() or ""
    except Exception:  # noqa: BLE001 - no peer address: one shared bucket
        peer = ""
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    return peer


@dataclass
class Lease:
    """One Select's lease: the table leases it took (a Select may take several) and its deadline."""

    lease_id: int
    table_leases: list[int]
    slots: np.ndarray
    generations: np.ndarray
    deadline: float


@dataclass
class Session:
    session_id: str
    table: Any
    kind: str
    lease_timeout_s: float
    last_seen: float
    leases: dict[int, Lease] = field(default_factory=dict)
    expired: OrderedDict = field(default_factory=OrderedDict)
    resources: Any = None  # plane resources to close with the session (RDMA queue pairs)
    closed: bool = False
    next_lease: int = 1
    layout_version: int = -1  # the layout this session's learner holds (-1: none yet)
    peer: str = ""  # peer_identity() of the caller that opened it
    group: Any = None  # the SelectionGroup (groups.py) this session is a rank of, if any
    rank: int = 0

    def remember_expired(self, lease_id: int) -> None:
        self.expired[lease_id] = None
        while len(self.expired) > MAX_REMEMBERED_EXPIRED:
            self.expired.popitem(last=False)


class SessionNotFoundError(KeyError):
    """No open session of that id (never opened, closed, or reaped)."""

    def __str__(self) -> str:
        return f"data-plane session {self.args[0]!r} not found (closed or expired); open a new one"


class SessionRegistry:
    """Open sessions, their leases and the reaping of expired ones (thread safe)."""

    def __init__(self, *, lease_timeout_s: float, idle_timeout_s: float, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 max_sessions_per_peer: int = DEFAULT_MAX_SESSIONS_PER_PEER,
                 clock: Callable[[], float] = time.monotonic,
                 on_close: Callable[[Session], None] | None = None):
        if lease_timeout_s <= 0 or idle_timeout_s <= 0:
            raise ValueError("lease and idle timeouts must be positive")
        self.lease_timeout_s = float(lease_timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_sessions = int(max_sessions)
        self.max_sessions_per_peer = int(max_sessions_per_peer)
        self._clock = clock
        self._on_close = on_close
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._per_peer: dict[str, int] = {}

    # ----------------------------------------------------------------- sessions
    def create(self, table: Any, kind: str, resources: Any = None, peer: str = "") -> Session:
        """A new session of ``peer``; OverflowError (RESOURCE_EXHAUSTED) past either cap, naming it."""
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise OverflowError(f"too many open data-plane sessions ({self.max_sessions}, "
                                    f"[data_planes] max_sessions): try again later")
            held = self._per_peer.get(peer, 0)
            if held >= self.max_sessions_per_peer:
                raise OverflowError(f"this peer holds {held} open data-plane sessions, the most "
                                    f"{PER_PEER_KEY} allows: close some (or raise the setting)")
            session = Session(secrets.token_hex(16), table, kind, self.lease_timeout_s, self._clock(),
                              resources=resources, peer=peer)
            self._sessions[session.session_id] = session
            self._per_peer[peer] = held + 1
            return session

    def _forget_peer(self, session: Session) -> None:
        """One session of its peer fewer (call with the lock held, once the session left ``_sessions``)."""
        left = self._per_peer.get(session.peer, 0) - 1
        if left > 0:
            self._per_peer[session.peer] = left
        else:
            self._per_peer.pop(session.peer, None)

    def counts_by_peer(self) -> dict[str, int]:
        """Open sessions per peer identity."""
        with self._lock:
            return dict(self._per_peer)

    def get(self, session_id: str) -> Session:
        """The open session (its idle clock restarts); SessionNotFoundError if none."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise SessionNotFoundError(session_id)
            session.last_seen = self._clock()
            return session

    def close(self, session_id: str) -> bool:
        """End a session and release its leases; False if it was not open."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._forget_peer(session)
        if session is None:
            return False
        self._finish(session)
        return True

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._per_peer.clear()
        for s in sessions:
            self._finish(s)

    def _finish(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            leases = list(session.leases.values())
            session.leases.clear()
        wake = getattr(session.table, "wake_waiters", None)
        if wake is not None:  # a Select of this session blocked on the rate limiter gives up
            try:
                wake()
            except Exception:  # noqa: BLE001 - closing goes on: leases are released
                pass
        for lease in leases:
            _release_table_leases(session.table, lease.table_leases)
        if self._on_close is not None:
            self._on_close(session)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def active_leases(self) -> int:
        with self._lock:
            return sum(len(s.leases) for s in self._sessions.values())

    def oldest_lease(self, session: Session) -> int | None:
        """The lowest id among the session's open leases (None: it holds none)."""
        with self._lock:
            return min(session.leases, default=None)

    def counts_by_kind(self) -> dict[str, int]:
        """Open sessions per plane kind (the daemon's metrics read it at scrape time)."""
        with self._lock:
            counts: dict[str, int] = {}
            for session in self._sessions.values():
                counts[session.kind] = counts.get(session.kind, 0) + 1
            return counts

    # ------------------------------------------------------------------- leases
    def add_lease(self, session: Session, table_leases: list[int], slots: np.ndarray, generations: np.ndarray
                  ) -> int | None:
        """Record a Select's table leases under a new session lease id.

        None (and the table leases released at once) if the session closed meanwhile.
        """
        with self._lock:
            if not session.closed:
                lease_id = session.next_lease
                session.next_lease += 1
                deadline = self._clock() + session.lease_timeout_s
                session.leases[lease_id] = Lease(lease_id, list(table_leases), np.asarray(slots),
                                                 np.asarray(generations), deadline)
                return lease_id
        _release_table_leases(session.table, table_leases)
        return None

    def lease_slots(self, session_id: str, lease_id: int) -> np.ndarray | None:
        """The slots of a lease the session holds now (its idle clock restarts); None if it holds no such lease.

        A lease not held now comes back stale from any later Release (expired, released or
        never given), so whatever a learner read in its name is dropped.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or session.closed:
                return None
            lease = session.leases.get(int(lease_id))
            if lease is None:
                return None
            session.last_seen = self._clock()
            return lease.slots

    def release(self, session: Session, lease_ids: Iterable[int]) -> list[int]:
        """End leases; returns those that were stale (expired, unknown, or a slot rewritten)."""
        stale = []
        taken = []
        with self._lock:
            for lease_id in lease_ids:
                lease_id = int(lease_id)
                lease = session.leases.pop(lease_id, None)
                if lease is None:
                    session.expired.pop(lease_id, None)
                    stale.append(lease_id)
                else:
                    taken.append(lease)
        for lease in taken:
            if not generations_unchanged(session.table, lease.slots, lease.generations):
                stale.append(lease.lease_id)
            _release_table_leases(session.table, lease.table_leases)
        return stale

    def reap(self) -> tuple[int, int]:
        """End expired leases and idle sessions; returns (leases expired, sessions closed)."""
        now = self._clock()
        expired: list[tuple[Session, Lease]] = []
        idle: list[Session] = []
        with self._lock:
            for sid, session in list(self._sessions.items()):
                if now - session.last_seen > self.idle_timeout_s:
                    idle.append(self._sessions.pop(sid))
                    self._forget_peer(session)
                    continue
                for lease_id, lease in list(session.leases.items()):
                    if lease.deadline <= now:
                        del session.leases[lease_id]
                        session.remember_expired(lease_id)
                        expired.append((session, lease))
        for session, lease in expired:
            _release_table_leases(session.table, lease.table_leases)
        for session in idle:
            self._finish(session)
        return len(expired), len(idle)


def generations_unchanged(table: Any, slots: np.ndarray, generations: np.ndarray) -> bool:
    """Whether none of ``slots`` was (re)written since ``generations`` were read."""
    meta = getattr(table, "meta", None)
    current = getattr(meta, "generation", None)
    if current is None:
        return True
    slots = np.asarray(slots, dtype=np.int64)
    if len(slots) != len(generations):
        return False
    try:
        now = current[slots]
    except IndexError:  # a slot past the table's capacity
        return False
    return bool((now == generations).all())


def _release_table_leases(table: Any, lease_ids: Iterable[int]) -> None:
    for lease_id in lease_ids:
        try:
            table.release(lease_id)
        except Exception:  # noqa: BLE001 - a closed table has nothing left to release
            pass
