"""The daemon's side of the nixl plane: table segments registered with a NIXL agent.

The daemon is the passive side: its agent (UCX backend, progress thread) maps each
table segment and registers it as DRAM once for every session that reads that
segment version; the agent's metadata (connection details and the registered
memory) goes to the learner in ``OpenDataPlane`` (and with a ``Select`` that
carries a new layout). The learner's agent then READs the windows of its leased
items; no daemon Python code runs per read. A table that grows moves to a new
segment: it is registered when a session first attaches it. The session keeps
the old one until every lease it took before the move is released (a READ of those
may still be in flight; over UCX's TCP transport the daemon serves READs from the
address asked, so memory must stay mapped while it can be asked for); the segment
is deregistered and unmapped when no session holds it any more.
"""

from __future__ import annotations

import logging
import mmap
import threading
from dataclasses import dataclass, field
from typing import Any

from gear_contract import nixl_agents
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout
from gear_server.data_planes.rdma_server import map_segment
from gear_server.data_planes.settings import DataPlaneSettings

log = logging.getLogger(__name__)


@dataclass
class _Registered:
    mapping: mmap.mmap
    descs: Any  # the agent's registration list (for deregistration)
    address: int
    length: int
    sessions: int = 0


@dataclass
class NixlGrant:
    """What one learner session holds: a reference on the registered segment it reads."""

    session_id: str
    segment: str | None = None
    region: pb.NixlRegion | None = None
    # (segment, lease watermark): earlier segments still held for the leases below the watermark
    retired: list[tuple[str, int]] = field(default_factory=list)


class NixlServer:
    """Owns the daemon's NIXL agent and the segments registered with it (thread safe)."""

    def __init__(self, agent: Any = None):
        self.agent = agent if agent is not None else nixl_agents.new_agent("daemon")
        self._lock = threading.Lock()
        self._segments: dict[str, _Registered] = {}
        self._metadata: bytes | None = None  # the agent's metadata, read again after each (de)registration

    @classmethod
    def open(cls, settings: DataPlaneSettings) -> tuple[NixlServer | None, str | None]:
        """(a NixlServer, None) or (None, why the nixl plane is off)."""
        if not settings.nixl:
            return None, "turned off ([data_planes] nixl = false)"
        reason = nixl_agents.unavailable_reason()
        if reason is not None:
            return None, reason
        try:
            return cls(), None
        except nixl_agents.NixlUnavailableError as exc:
            return None, str(exc)

    @property
    def segments(self) -> tuple[str, ...]:
        """Paths of the segments registered now."""
        with self._lock:
            return tuple(self._segments)

    def _acquire(self, layout: TableLayout) -> _Registered:
        with self._lock:
            reg = self._segments.get(layout.segment)
            if reg is None:
                mapping, address = map_segment(layout)
                try:
                    descs = self.agent.register_memory([(address, layout.segment_size, 0, "")], nixl_agents.DRAM)
                except BaseException:
                    mapping.close()
                    raise
                reg = _Registered(mapping, descs, address, layout.segment_size)
                self._segments[layout.segment] = reg
                self._metadata = None
                log.debug("nixl: registered %s (%d bytes at %#x)", layout.segment, layout.segment_size, address)
            reg.sessions += 1
            return reg

    def _release(self, segment: str) -> None:
        with self._lock:
            reg = self._segments.get(segment)
            if reg is None:
                return
            reg.sessions -= 1
            if reg.sessions > 0:
                return
            del self._segments[segment]
            self._metadata = None
            self._deregister(reg)

    def _deregister(self, reg: _Registered) -> None:
        try:
            self.agent.deregister_memory(reg.descs)
        except Exception:  # noqa: BLE001 - the mapping goes all the same
            log.exception("nixl: deregistering a segment failed")
        reg.mapping.close()

    def _agent_metadata(self) -> bytes:
        with self._lock:
            if self._metadata is None:
                self._metadata = bytes(self.agent.get_agent_metadata())
            return self._metadata

    def grant(self, session_id: str) -> NixlGrant:
        return NixlGrant(session_id)

    def attach(self, grant: NixlGrant, layout: TableLayout, watermark: int = 0) -> pb.NixlRegion:
        """Let the session read ``layout``'s segment (registered once for all sessions); returns its region.

        The segment the session read before stays registered for its leases below
        ``watermark`` (``release_retired``). FileNotFoundError when the segment was
        already replaced by a newer layout.
        """
        if grant.segment == layout.segment and grant.region is not None:
            return grant.region
        reg = self._acquire(layout)
        previous = grant.segment
        grant.segment = layout.segment
        grant.region = pb.NixlRegion(agent_metadata=self._agent_metadata(), agent=self.agent.name,
                                     addr=reg.address, length=reg.length, device_id=0, mem_type=nixl_agents.DRAM)
        if previous is not None:
            grant.retired.append((previous, watermark))
        return grant.region

    def release_retired(self, grant: NixlGrant, oldest_lease: int | None) -> None:
        """Let go of the session's earlier segments once no lease that may address them is open."""
        done = []
        with self._lock:  # a Release and a Select of one session may run on two pool threads
            while grant.retired and (oldest_lease is None or grant.retired[0][1] <= oldest_lease):
                done.append(grant.retired.pop(0)[0])
        for segment in done:
            self._release(segment)

    def close_session(self, grant: NixlGrant) -> None:
        self.release_retired(grant, None)
        if grant.segment is not None:
            self._release(grant.segment)
            grant.segment = None
            grant.region = None

    def close(self) -> None:
        """Deregister and unmap every segment, then let the agent go (its UCX workers and progress thread end)."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            for reg in segments:
                self._deregister(reg)
            self.agent = None
