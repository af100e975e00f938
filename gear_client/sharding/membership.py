"""Which daemons make up a sharded table, and which of them answer now.

Membership comes from configuration or DNS, never from a cluster manager of
ours: a list of addresses, a comma-separated string, or ``"shards:NAME:PORT"``
(a DNS name whose every address is a shard). Each name is resolved and every
address is asked for its ``ServerInfo``; two addresses that reach the same
daemon (``localhost`` as 127.0.0.1 and ::1) are one shard: a daemon is known
by its host identity and port. An address of a multi-address name that does
not answer when the client connects is left out (``::1`` where the daemon
listens on IPv4 only), unless no address of that name answers.

Shards keep independent: one that stops answering is marked down (a warning,
``ShardState.up`` False, ``failures`` counted), left out of selection and
inserts, probed again in the background every ``retry_s`` and taken back once
it answers (a restarted daemon restores its own checkpoint).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from gear_client import errors
from gear_client.sharding.owners import KeyOwners
from gear_contract._proto import replay_pb2 as pb

log = logging.getLogger(__name__)

SHARDS_PREFIX = "shards:"
DEFAULT_TIMEOUT_S = 5.0  # a shard that does not answer a control call within this is down
DEFAULT_RETRY_S = 2.0  # how often a down shard is probed


def shard_addresses(spec: Any) -> list[str] | None:
    """The addresses of a sharded spec (a list, "a,b", "shards:name:port"); None for one plain address."""
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("a sharded table needs at least one daemon address")
        out = []
        for a in spec:
            if not isinstance(a, str) or not a.strip():
                raise ValueError(f"shard addresses must be non-empty strings, got {a!r}")
            out.append(a.strip())
        return out
    if isinstance(spec, str):
        text = spec[len(SHARDS_PREFIX):] if spec.startswith(SHARDS_PREFIX) else None
        if text is None and "," not in spec:
            return None
        parts = [p.strip() for p in (text if text is not None else spec).split(",") if p.strip()]
        if not parts:
            raise ValueError(f"no daemon address in {spec!r}")
        return parts
    return None


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"shard address {address!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"shard address {address!r} has no host")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def resolve(address: str) -> list[str]:
    """Every address a name resolves to, sorted (so every client numbers the shards alike).

    A name with one address stays as given (TLS checks the name); several become IP addresses.
    """
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.warning("shard address %s does not resolve (%s); kept as given", address, exc)
        return [address]
    ips = sorted({info[4][0] for info in infos}, key=lambda ip: (":" in ip, ip))
    if len(ips) <= 1:
        return [address]
    return [join_host_port(ip, port) for ip in ips]


@dataclass
class ShardState:
    """What ``server_info`` and ``shards()`` report of one shard."""

    index: int
    address: str
    host_id: str
    up: bool
    failures: int  # times it went down
    last_error: str = ""


class Shard:
    """One daemon of a sharded table: its single-daemon client and its liveness."""

    def __init__(self, index: int, address: str, client: Any):
        self.index = index
        self.address = address
        self.client = client  # gear_client.Client of this daemon
        self.host_id = ""
        self.port = split_host_port(address)[1]
        self.up = True
        self.failures = 0
        self.last_error = ""
        self.retry_at = 0.0
        self.probe: futures.Future | None = None

    def state(self) -> ShardState:
        return ShardState(self.index, self.address, self.host_id, self.up, self.failures, self.last_error)

    def server_info(self, timeout: float, wait: bool = False) -> pb.ServerInfoResponse:
        """ServerInfo within ``timeout``; fail-fast (a daemon that is gone answers UNAVAILABLE at once)
        unless ``wait``, which waits for a connection up to ``timeout``."""
        stub = self.client._connect()[1]
        return stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout, wait_for_ready=wait)


class ShardSet:
    """The shards of a client, their liveness, and the key -> shard cache (see module docstring)."""

    def __init__(self, addresses: Sequence[str], make_client: Callable[[str], Any], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S):
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(addresses) + 2),
                                                thread_name_prefix="gear-shards")
        self.key_owners = KeyOwners()  # key -> shard, learnt from sampled batches (routes mutations)
        self._rejoin_listeners: list[Callable[[Shard], None]] = []
        self.shards: list[Shard] = self._connect(addresses, make_client)

    # ------------------------------------------------------------------ membership
    def _connect(self, addresses: Sequence[str], make_client: Callable[[str], Any]) -> list[Shard]:
        groups = [resolve(a) for a in addresses]
        candidates = [Shard(-1, addr, make_client(addr)) for group in groups for addr in group]
        answers = self.map(lambda s: s.server_info(self.timeout_s, wait=True), candidates)
        shards: list[Shard] = []
        seen: set[tuple[str, int]] = set()
        start = 0
        for group in groups:
            members = candidates[start:start + len(group)]
            replies = answers[start:start + len(group)]
            start += len(group)
            answered = [(s, a) for s, a in zip(members, replies, strict=True) if isinstance(a, pb.ServerInfoResponse)]
            if not answered:  # nothing answers yet: one shard, down until it does
                self._set_down(members[0], self._cause(members[0], replies[0]), first=True)
                log.warning("shard %s does not answer (%s): down until it does; its items are not sampled and "
                            "inserts go to the others", members[0].address, members[0].last_error)
                shards.append(members[0])
                for extra in members[1:]:
                    extra.client.close()
                continue
            for shard, info in answered:
                identity = (info.host_id, shard.port)
                if identity in seen:  # another address of a daemon already counted
                    shard.client.close()
                    continue
                seen.add(identity)
                shard.host_id = info.host_id
                shards.append(shard)
            for shard, reply in zip(members, replies, strict=True):
                if not isinstance(reply, pb.ServerInfoResponse):
                    log.info("shard address %s does not answer (%s); another address of its name does: left out",
                             shard.address, _describe(reply))
                    shard.client.close()
        for i, shard in enumerate(shards):
            shard.index = i
        return shards

    def _cause(self, shard: Shard, error: BaseException) -> BaseException:
        """Why a daemon did not answer a call that waited for it: a wait that timed out says only
        DEADLINE_EXCEEDED, so one call that fails fast is made for the reason (e.g. connection refused)."""
        code = getattr(error, "code", None)
        if not (callable(code) and code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            return error
        try:
            shard.server_info(self.timeout_s)
        except grpc.RpcError as exc:
            return exc
        return error

    def map(self, fn: Callable[[Shard], Any], shards: Iterable[Shard]) -> list[Any]:
        """``fn(shard)`` for each shard in parallel; each result or the exception it raised."""
        shards = list(shards)
        if len(shards) == 1:
            try:
                return [fn(shards[0])]
            except Exception as exc:  # noqa: BLE001 - returned to the caller
                return [exc]
        jobs = [self._pool.submit(fn, s) for s in shards]
        out = []
        for job in jobs:
            try:
                out.append(job.result())
            except Exception as exc:  # noqa: BLE001 - each shard's error is its result
                out.append(exc)
        return out

    def map_watched(self, fn: Callable[[Shard], Any], shards: Iterable[Shard]) -> list[Any]:
        """``map`` for calls that may rightly take long (a checkpoint): a call still running after
        ``timeout_s`` has its shard asked for ServerInfo, and one that does not answer either is cut off
        (its result a ServiceError of code DEADLINE_EXCEEDED, the shard marked down), so a hung node stalls nothing for
        more than about twice ``timeout_s``; calls of shards that answer are waited for."""
        shards = list(shards)
        jobs = {self._pool.submit(fn, s): i for i, s in enumerate(shards)}
        out: list[Any] = [None] * len(shards)
        running = set(jobs)
        while running:
            done, running = futures.wait(running, timeout=self.timeout_s)
            for job in done:
                try:
                    out[jobs[job]] = job.result()
                except Exception as exc:  # noqa: BLE001 - returned to the caller
                    out[jobs[job]] = exc
            if not running:
                break
            waiting = sorted(running, key=jobs.__getitem__)
            answers = self.map(lambda s: s.server_info(self.timeout_s), [shards[jobs[j]] for j in waiting])
            for job, answer in zip(waiting, answers, strict=True):
                if isinstance(answer, BaseException) and is_unreachable(answer) and not job.done():
                    shard = shards[jobs[job]]
                    error = errors.ServiceError(f"stopped answering during the call ({_describe(answer)})",
                                                grpc.StatusCode.DEADLINE_EXCEEDED)
                    self.mark_down(shard, error)
                    out[jobs[job]] = error
                    running.discard(job)  # left to finish (or fail) in the pool on its own
        return out

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> futures.Future:
        return self._pool.submit(fn, *args, **kwargs)

    def on_rejoin(self, listener: Callable[[Shard], None]) -> None:
        """Call ``listener(shard)`` when a down shard answers again."""
        self._rejoin_listeners.append(listener)

    # ------------------------------------------------------------------ liveness
    def live(self) -> list[Shard]:
        """The shards up now; starts background probes of the down ones that are due."""
        now = time.monotonic()
        with self._lock:
            due = [s for s in self.shards if not s.up and s.probe is None and now >= s.retry_at]
            for shard in due:
                shard.probe = self._pool.submit(self._probe, shard)
            return [s for s in self.shards if s.up]

    def _probe(self, shard: Shard) -> None:
        # The shard's own channel (writers may still stream on it) reconnects within gear's short back-off.
        try:
            info = shard.server_info(self.timeout_s, wait=True)
        except grpc.RpcError as exc:
            with self._lock:
                shard.probe = None
                shard.retry_at = time.monotonic() + self.retry_s
                shard.last_error = _describe(exc)
            return
        with self._lock:
            shard.probe = None
            if shard.host_id and info.host_id != shard.host_id:
                log.warning("shard %s answers with another host identity (%s, was %s)", shard.address,
                            info.host_id, shard.host_id)
            shard.host_id = info.host_id
            shard.up = True
            shard.last_error = ""
        log.warning("shard %s is back", shard.address)
        for listener in self._rejoin_listeners:
            listener(shard)

    def mark_down(self, shard: Shard, error: BaseException) -> None:
        """The shard failed a call: leave it out until a probe finds it answering."""
        with self._lock:
            was_up = shard.up
            self._set_down(shard, error, first=False)
        if was_up:
            log.warning("shard %s is down (%s): its items are not sampled and inserts go to the others "
                        "until it answers again", shard.address, shard.last_error)

    def _set_down(self, shard: Shard, error: Any, first: bool) -> None:
        if shard.up or first:
            shard.failures += 1
        shard.up = False
        shard.last_error = _describe(error)
        shard.retry_at = time.monotonic() + (0.0 if first else self.retry_s)

    def states(self) -> list[ShardState]:
        with self._lock:
            return [s.state() for s in self.shards]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for shard in self.shards:
            shard.client.close()


def is_unreachable(error: BaseException) -> bool:
    """Whether an error says the daemon cannot be reached (as opposed to a refused request)."""
    code = getattr(error, "code", None)
    if callable(code):
        code = code()
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _describe(error: Any) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error) or type(error).__name__
