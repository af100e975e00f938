"""The Reverb client: insert, sample, mutate priorities, reset, server info, writers.

``Client(server_address)`` talks to a gear daemon over gRPC. It connects
lazily, is safe to share between threads (one channel, calls are independent)
and pickles as its address (plus any explicit security settings), so a copy in
another process opens its own channel. A call waits for a daemon that is not
(yet) reachable for at most ``connect_timeout`` seconds, then raises
``errors.ConnectError`` naming the address and the cause (gear_client.connection.channel).

``sample`` uses the learner data plane it negotiates (gear_client.data_planes):
on the daemon's host the table's shared memory (shm), on another host with an
RDMA device one-sided reads (rdma). Otherwise it takes the inline path: the
daemon streams SampleResponses whose columns are raw buffers; they are parsed
here without protobuf copying the bytes, each column is copied once into a
writable array (Reverb's samples are writable), and items are views of it.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from gear_client import errors
from gear_client.connection import aio_loop
from gear_client.connection.auth import ChannelSecurity
from gear_client.connection.channel import DaemonChannel, check_address, connect_timeout_option
from gear_client.connection.lane_client import LaneBroken, LaneStatusError
from gear_client.data_planes.read_ahead import sampling_takes
from gear_client.replay_sample import ReplaySample, SampleInfo, emit_sample
from gear_client.table_info import TableInfo
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.allocator import tune_allocator
from gear_contract.lane_frames import MUTATE_PRIORITIES, encode_priorities
from gear_contract.wire import decode_sample_response, encode_priority_updates

__all__ = ["Client"]

# Items per Select when client.sample goes over a data plane (shm/rdma).
_PLANE_ITEMS_PER_SELECT = 256


class Client:
    """Client of a gear replay daemon (Reverb's ``reverb.Client``)."""

    def __new__(cls, server_address: Any = None, *args: Any, **kwargs: Any):
        """Several daemons (a list, "a,b", "shards:NAME:PORT") give a ShardedClient (docs/SHARDING.md)."""
        if cls is Client:
            from gear_client.sharding.membership import shard_addresses

            if shard_addresses(server_address) is not None:
                from gear_client.sharding.client import ShardedClient

                return ShardedClient(server_address, *args, client_type=Client, **kwargs)
        return super().__new__(cls)

    def __init__(self, server_address: str, client: Client | None = None, *, token: str | None = None,
                 root_certificates: Any = None, certificate_chain: Any = None, private_key: Any = None,
                 data_planes: Sequence[str] | None = None, connect_timeout: float | None = None):
        """A client of the daemon at ``server_address``; nothing is sent until the first call.

        Args:
          server_address: "host:port" of the daemon (without a port gRPC would dial 443, so it is refused).
            Several daemons (a list, "a:p,b:p" or "shards:NAME:PORT") give a ShardedClient that sees each
            table as one (docs/SHARDING.md).
          client: an existing Client of the same address whose channel this one shares (Reverb's
            pre-existing client).
          token: the bearer token the daemon's ``[auth]`` asks for (else ``GEAR_TOKEN`` or the file named by
            ``GEAR_TOKEN_FILE``).
          root_certificates: PEM bytes or path of the CAs to trust: the channel uses TLS (else
            ``GEAR_TLS_ROOT_CERTS``).
          certificate_chain: PEM bytes or path of this client's certificate, for mutual TLS (with
            ``private_key``; else ``GEAR_TLS_CERT_CHAIN``).
          private_key: PEM bytes or path of that certificate's key (else ``GEAR_TLS_PRIVATE_KEY``).
          data_planes: the planes ``sample`` may negotiate besides inline (default ``("shm", "rdma")``, or
            the comma-separated ``GEAR_DATA_PLANES``; ``()`` or ``"inline"`` keeps every sample on gRPC).
          connect_timeout: seconds a call waits for an unreachable daemon before ConnectError (default
            ``GEAR_CONNECT_TIMEOUT``, else 30; -1 waits forever).

        Raises:
          ValueError: the address names no port, a data plane is unknown, or the connect timeout is not a
            number. Credentials are checked at the first call (ValueError: an empty token, a certificate
            chain without its key).
        """
        self._server_address = check_address(server_address)
        self._data_planes = _data_planes_option(data_planes)
        self._connect_timeout = connect_timeout_option(connect_timeout)
        self._security_args = {k: v for k, v in (("token", token), ("root_certificates", root_certificates),
                                                 ("certificate_chain", certificate_chain),
                                                 ("private_key", private_key)) if v is not None}
        self._lock = threading.Lock()
        self._daemon: DaemonChannel | None = None
        self._table_infos: dict[str, pb.TableInfo] = {}
        self._server_info: tuple[float, pb.ServerInfoResponse] | None = None  # (fetched at, response)
        self._planes: dict[str, Any] = {}  # table -> PlaneSampler (shm/rdma) or None (inline)
        if client is not None and client._server_address == server_address:
            # Reverb's "pre-existing client": share its channel.
            self._daemon = client._daemon_channel()

    # ------------------------------------------------------------------ plumbing
    def __reduce__(self):
        return _rebuild_client, (self._server_address, self._security_args, self._data_planes,
                                 self._connect_timeout if self._connect_timeout is not None else -1)

    def __repr__(self) -> str:
        return f"Client, server_address={self._server_address}"

    @property
    def server_address(self) -> str:
        return self._server_address

    def _daemon_channel(self) -> DaemonChannel:
        """This client's channel to the daemon (made on first use; no wait)."""
        with self._lock:
            if self._daemon is None:
                security = ChannelSecurity.build(**self._security_args)
                self._daemon = DaemonChannel(self._server_address, security, self._connect_timeout)
            return self._daemon

    @property
    def _channel(self) -> grpc.Channel | None:
        """The daemon channel's sync gRPC channel (made on first use), None before the first call."""
        daemon = self._daemon
        return daemon.channel if daemon is not None else None

    def _connect(self) -> tuple[grpc.Channel, pb_grpc.ReplayServiceStub, Any]:
        """(channel, stub, raw Sample multicallable), without waiting for the daemon."""
        daemon = self._daemon_channel()
        return daemon.channel, daemon.stub, daemon.sample_call

    def _wait_ready(self, operation: str, timeout: float | None = None) -> DaemonChannel:
        """The daemon channel once the daemon can take calls; ConnectError after the connect timeout."""
        daemon = self._daemon_channel()
        daemon.wait_ready(operation, timeout)
        return daemon

    @property
    def _stub(self) -> pb_grpc.ReplayServiceStub:
        """The ReplayService stub once the daemon is reachable (writers stream inserts through it)."""
        return self._wait_ready("writer").stub

    def _error(self, error: grpc.RpcError, operation: str) -> Exception:
        """The exception for a failed call: ConnectError when the daemon is away or refused the token."""
        daemon = self._daemon
        connect_error = daemon.error_for(error, operation) if daemon is not None else None
        return connect_error or errors.from_rpc_error(error, operation)

    def _unary(self, operation: str, method: Callable[[pb_grpc.ReplayServiceStub], Any], request: Any,
               timeout: float | None = None) -> Any:
        """A unary call; when the daemon is unreachable, sent again once it is (within the connect timeout)."""
        daemon = self._daemon_channel()
        for attempt in range(2):
            try:
                return method(daemon.stub)(request, timeout=timeout, wait_for_ready=False)
            except grpc.RpcError as e:
                if attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    daemon.wait_ready(operation, timeout)
                    continue
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                    raise errors.DeadlineExceededError(
                        f"{operation} call did not complete within provided timeout of {timeout}s") from e
                raise self._error(e, operation) from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close the channel (a later call reconnects)."""
        with self._lock:
            daemon, self._daemon = self._daemon, None
            planes, self._planes = self._planes, {}
        for plane in planes.values():
            if plane is not None:
                plane.close()
        if daemon is not None:
            daemon.close()

    def _table_info(self, name: str, refresh: bool = False) -> pb.TableInfo:
        """The daemon's TableInfo of ``name`` (cached); ValueError naming the table if there is none."""
        with self._lock:
            info = None if refresh else self._table_infos.get(name)
        if info is None:
            self._fetch_server_info(timeout=None)
            with self._lock:
                info = self._table_infos.get(name)
                known = sorted(self._table_infos)
            if info is None:
                raise ValueError(f'Could not find table "{name}". The following tables exists: {", ".join(known)}.')
        return info

    def _fetch_server_info(self, timeout: float | None, operation: str = "server_info",
                           aio: bool = False) -> pb.ServerInfoResponse:
        """The daemon's ServerInfo (cached for the table infos). ``aio``: asked first on the aio channel (a
        writer's: an actor that only writes never makes the sync channel); a daemon that does not answer at
        once is waited for as any call is."""
        response = None
        if aio:
            daemon = self._daemon_channel()
            try:
                response = aio_loop.run(daemon.server_info_aio(timeout), None if timeout is None else timeout + 1.0)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                        raise errors.DeadlineExceededError(
                            f"{operation} call did not complete within provided timeout of {timeout}s") from e
                    raise self._error(e, operation) from e
            except (TimeoutError, ValueError):
                pass
        if response is None:
            response = self._unary(operation, lambda stub: stub.ServerInfo, pb.ServerInfoRequest(), timeout)
        with self._lock:
            self._table_infos = {t.name: t for t in response.table_info}
            self._server_info = (time.monotonic(), response)
        return response

    def _recent_server_info(self, max_age_s: float, timeout: float | None) -> pb.ServerInfoResponse:
        """The daemon's ServerInfo fetched at most ``max_age_s`` ago, else a fresh one (a writer opening
        its routes right after ``trajectory_writer`` asked does not ask again)."""
        with self._lock:
            cached = self._server_info
        if cached is not None and time.monotonic() - cached[0] <= max_age_s:
            return cached[1]
        return self._fetch_server_info(timeout)

    # ------------------------------------------------------------------ inserts
    def insert(self, data: Any, priorities: Mapping[str, float]) -> None:
        """Insert ``data`` (a nest; stored once) as one item into each table of ``priorities``.

        The item holds a single step: every leaf gains a leading time dimension of 1.
        Blocks while a table's rate limiter holds the insert.

        Args:
          data: a nest of arrays or scalars (numeric, bool or fixed-size strings).
          priorities: table name -> the item's priority in that table (finite, >= 0).

        Raises:
          ValueError: ``priorities`` or ``data`` is empty, a leaf has object dtype, a table does not
            exist, a priority is invalid or the data does not fit a table's signature.
          ConnectError: the daemon stayed unreachable past the connect timeout.
          ServiceError: the daemon refused or did not acknowledge the insert.
        """
        if not priorities:
            raise ValueError("priorities must contain at least one item")
        leaves = nest.flatten(data)
        if not leaves:
            raise ValueError("data must hold at least one value (empty trajectory)")
        structure = nest.structure_of(data)
        base = secrets.randbits(63)
        chunks = []
        columns = []
        episode = secrets.randbits(63)
        for i, leaf in enumerate(leaves):
            array = np.asarray(leaf)
            if array.dtype.hasobject:
                raise ValueError(f"leaf {i} of the data has object dtype ({type(leaf).__name__}); only numeric, "
                                 "bool and fixed-size string arrays can be inserted")
            key = base + i
            chunks.append(pb.ChunkData(chunk_key=key, episode_id=episode, episode_step=0, data=pb.Tensor(
                dtype=array.dtype.str, shape=[1, *array.shape], data=array.tobytes())))
            columns.append(pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=key, offset=0, length=1)]))
        items = [pb.PrioritizedItem(key=secrets.randbits(64), table=table, priority=float(priority),
                                    structure=structure, columns=columns)
                 for table, priority in priorities.items()]
        request = pb.InsertStreamRequest(chunks=chunks, items=items, release_chunk_keys=[c.chunk_key for c in chunks])
        wanted = {item.key for item in items}
        daemon = self._daemon_channel()
        for attempt in range(2):  # sent again once the daemon is reachable (keys are idempotent)
            try:
                for response in daemon.stub.InsertStream(iter([request]), wait_for_ready=False):
                    wanted.difference_update(response.keys)
                break
            except grpc.RpcError as e:
                if attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    daemon.wait_ready("insert")
                    continue
                raise self._error(e, "insert") from e
        if wanted:
            raise errors.ServiceError(f"insert: the daemon did not acknowledge item(s) {sorted(wanted)}")

    def writer(self, max_sequence_length: int, delta_encoded: bool = False, chunk_length: int | None = None,
               max_in_flight_items: int | None = 25):
        """A legacy ``Writer`` whose items span at most ``max_sequence_length`` steps.

        Args:
          max_sequence_length: the most steps an item may span.
          delta_encoded: accepted for Reverb's API (it tunes Reverb's compression; bytes travel raw here).
          chunk_length: accepted likewise; between 1 and ``max_sequence_length`` (default
            ``min(10, max_sequence_length)``).
          max_in_flight_items: items the writer may have unacknowledged (None: no practical bound).

        Raises:
          ValueError: an argument out of range (as Reverb's checks).
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        from gear_client.writers.legacy_writer import Writer

        self._wait_ready("writer")
        return Writer(self, max_sequence_length=max_sequence_length, delta_encoded=delta_encoded,
                      chunk_length=chunk_length, max_in_flight_items=max_in_flight_items)

    def trajectory_writer(self, num_keep_alive_refs: int, *, validate_items: bool = True,
                          get_signature_timeout_ms: int | None = 3000, reconnect_timeout_s: float | None = None):
        """A ``TrajectoryWriter`` whose items may reach ``num_keep_alive_refs`` steps back.

        Args:
          num_keep_alive_refs: how many of the latest steps stay referable (``writer.history``).
          validate_items: check each item against its table's signature before sending it.
          get_signature_timeout_ms: accepted for Reverb's API; signatures are fetched when first needed.
          reconnect_timeout_s: how long the writer waits for a daemon that went away before it gives up
            the unacknowledged items (ItemsNotInsertedError); default: this client's connect timeout.

        Raises:
          ValueError: ``num_keep_alive_refs`` is not positive.
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        if num_keep_alive_refs < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        del get_signature_timeout_ms  # signatures are fetched on demand and cached
        from gear_client.writers.trajectory_writer import TrajectoryWriter

        self._fetch_server_info(None, "trajectory_writer", aio=True)  # waits for the daemon; the writer uses it
        return TrajectoryWriter(self, num_keep_alive_refs, validate_items=validate_items,
                                reconnect_timeout_s=reconnect_timeout_s)

    def structured_writer(self, configs: Sequence[Any]):
        """A ``StructuredWriter`` that inserts items as ``configs`` describe (reverb.structured_writer).

        Args:
          configs: structured-writer configs (``structured_writer.create_config``), at least one.

        Raises:
          ValueError: ``configs`` is empty or a config is invalid.
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        if not configs:
            raise ValueError("At least one config must be provided.")
        from gear_client.writers.structured_writer import StructuredWriter

        self._fetch_server_info(None, "structured_writer")  # waits for the daemon; the writer uses the answer
        return StructuredWriter(self, configs)

    # ------------------------------------------------------------------ samples
    def sample(self, table: str, num_samples: int = 1, *, emit_timesteps: bool = True,
               unpack_as_table_signature: bool = False, columns: Any = None
               ) -> Generator[list[ReplaySample] | ReplaySample, None, None]:
        """Sample ``num_samples`` items from ``table``: a generator, blocking while the rate limiter says so.

        Yields, per item, a ReplaySample of the whole trajectory (``emit_timesteps=False``;
        data flat, or unpacked as the table signature) or a list of one ReplaySample
        per step (``emit_timesteps=True``).

        Args:
          table: the table to sample from.
          num_samples: how many items to yield.
          emit_timesteps: yield each item as a list of one ReplaySample per step (Reverb's default).
          unpack_as_table_signature: data in the table signature's structure instead of its flat leaves.
          columns: gear only: fetch only these fields (paths such as "obs" or "obs/rgb", a list of
            them, or a nest of the wanted fields); data then holds only them, in the table's order
            (unpacked: the table's structure pruned to them). Takes a data-plane session of its own.

        Raises:
          ValueError: a path in ``columns`` names no field (nothing is sampled).
          RuntimeError: the daemon has no table ``table`` (ValueError when the signature or ``columns``
            is asked for).
          ConnectError: the daemon stayed unreachable past the connect timeout.
          ServiceError: the daemon ended the call (stopping, out of resources).
        """
        if columns is not None:
            yield from self._sample_columns(table, int(num_samples), columns, emit_timesteps,
                                            unpack_as_table_signature)
            return
        structure = None
        if unpack_as_table_signature:
            structure = self._signature_structure(table)

        def emit(info, data):
            return emit_sample(info, data, structure, emit_timesteps)

        plane = self._data_plane(table)
        remaining = int(num_samples)
        if plane is not None:  # shm or rdma negotiated: bytes bypass the control plane
            tune_allocator()  # batches and the caller's stacked copies are multi-MiB buffers too
            # a table whose picks take something (a queue, a limiter that spends samples): one item a call
            # (Reverb's sampler keeps one ahead), so each is handed over as it comes and none is taken unseen
            per_call = 1 if sampling_takes(self._table_info(table)) else _PLANE_ITEMS_PER_SELECT
            while remaining > 0:
                try:
                    batch = plane.sample(min(remaining, per_call))
                except ValueError:
                    if plane.kind is not None:
                        raise
                    # the daemon ended the session and refuses shm/rdma now (the table holds items of
                    # several layouts): nothing was taken; the rest comes over the Sample RPC
                    with self._lock:
                        self._planes[table] = None
                    plane.close()
                    break
                remaining -= len(batch)
                for i, info in enumerate(batch.item_infos()):
                    yield emit(info, batch.item_columns(i))
            if remaining <= 0:
                return
        daemon = self._daemon_channel()
        tune_allocator()
        request = pb.SampleRequest(table=table, num_samples=remaining)
        for attempt in range(2):  # sent again once the daemon is reachable, if nothing arrived yet
            call = daemon.sample_call(request, wait_for_ready=False)
            received = False
            try:
                for raw in call:
                    received = True
                    batch = decode_sample_response(raw, writable=True)
                    for i in range(batch.num_items):
                        yield emit(_sample_info(batch.infos[i]), batch.item_columns(i))
                return
            except grpc.RpcError as e:
                if attempt == 0 and not received and e.code() == grpc.StatusCode.UNAVAILABLE:
                    daemon.wait_ready("sample")
                    continue
                raise self._error(e, "sample") from e
            finally:
                call.cancel()

    def _sample_columns(self, table: str, num_samples: int, columns: Any, emit_timesteps: bool,
                        unpack: bool) -> Generator[list[ReplaySample] | ReplaySample, None, None]:
        """``sample`` of some fields only: a PlaneSampler with ``columns=`` over the best plane (inline too)."""
        from gear_client.data_planes.sampler import PlaneSampler

        per_call = 1 if sampling_takes(self._table_info(table)) else _PLANE_ITEMS_PER_SELECT
        with PlaneSampler(self, table, planes=(*self._data_planes, "inline"), columns=columns,
                          from_torch=False) as sampler:
            remaining = num_samples
            while remaining > 0:
                batch = sampler.sample(min(remaining, per_call))
                remaining -= len(batch)
                structure = batch.structure if unpack else None
                for i, info in enumerate(batch.item_infos()):
                    yield emit_sample(info, batch.item_columns(i), structure, emit_timesteps)

    def _data_plane(self, table: str):
        """A PlaneSampler when this learner reaches the table over shm or rdma; None: sample inline.

        Negotiated once per table (offering shm and rdma only); the answer is kept.
        """
        if not self._data_planes:
            return None
        with self._lock:
            if table in self._planes:
                return self._planes[table]
        from gear_client.data_planes.sampler import PlaneSampler

        sampler = PlaneSampler(self, table, planes=self._data_planes, from_torch=False)  # Reverb's: on its own
        try:
            sampler.open()
        except errors.ConnectError:  # the daemon is away or refuses the token: inline would fail the same way
            sampler.close()
            raise
        except errors.ReverbError:  # transient (unavailable, deadline...): try again next time
            sampler.close()
            return None
        except (ValueError, RuntimeError, NotImplementedError):  # no shm/rdma in common, or no data planes
            sampler.close()
            sampler = None
        with self._lock:
            if table in self._planes:  # another thread negotiated meanwhile
                if sampler is not None:
                    sampler.close()
                return self._planes[table]
            self._planes[table] = sampler
        return sampler

    def _signature_structure(self, table: str) -> pb.Structure | None:
        """The structure of the table's signature (None: the table has none, data stays flat, as Reverb)."""
        info = self._table_info(table)  # a table's signature is fixed by its configuration: the cache holds
        return info.signature.structure if info.HasField("signature") else None

    # ------------------------------------------------------------------ table operations
    def mutate_priorities(self, table: str, updates: Mapping[int, float] | None = None,
                          deletes: Iterable[int] | None = None) -> None:
        """Delete ``deletes`` then set ``updates`` (key -> priority); unknown keys are ignored.

        Returns once the daemon applied it. On the daemon's host the call takes the local lane
        (gear_client/connection/lane_client.py), else (or when the lane fails) gRPC.

        Args:
          table: the table holding the items.
          updates: item key -> new priority (finite, >= 0).
          deletes: keys of the items to remove.

        Raises:
          ValueError: a priority is negative, NaN or infinite (nothing is applied).
          RuntimeError: the daemon has no table ``table``.
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        if deletes is not None and not isinstance(deletes, (list, tuple)):
            deletes = list(deletes)  # read twice when the lane gives way to gRPC
        daemon = self._daemon_channel()
        lane = daemon.local_lane()
        if lane is not None:
            try:
                lane.call(MUTATE_PRIORITIES, encode_priorities(table, updates, deletes))
                return
            except LaneBroken:
                daemon.lane_broken(lane)  # the daemon went away or is stopping: gRPC waits for it and says why
            except LaneStatusError as e:
                raise self._error(e, "mutate_priorities") from e
        self._unary("mutate_priorities", lambda _: daemon.mutate_call, encode_priority_updates(table, updates, deletes))

    def reset(self, table: str) -> None:
        """Empty the table and reset its rate limiter.

        Args:
          table: the table to empty.

        Raises:
          RuntimeError: the daemon has no table ``table``.
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        self._unary("reset", lambda stub: stub.Reset, pb.ResetRequest(table=table))

    def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        """Table name -> TableInfo of every table of the daemon.

        Args:
          timeout: seconds to wait for the answer (None or 0: no deadline beyond the connect timeout).

        Raises:
          DeadlineExceededError: the daemon did not answer within ``timeout``.
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """

        response = self._fetch_server_info(timeout or None)
        return {t.name: TableInfo.from_proto(t) for t in response.table_info}

    def checkpoint(self) -> str:
        """Have the daemon write a checkpoint of every table; returns its path.

        Raises:
          NotImplementedError: the daemon has no checkpoint directory (a ``gear-server`` without ``[checkpoint] dir``).
          ServiceError: writing the checkpoint failed (the daemon logs why).
          ConnectError: the daemon stayed unreachable past the connect timeout.
        """
        return self._unary("checkpoint", lambda stub: stub.Checkpoint, pb.CheckpointRequest()).path

    def _check_rate_limiter(self, table: str, num_samples: int = 0, num_inserts: int = 0
                            ) -> pb.RateLimiterCheckResponse:
        """Whether the table would let ``num_samples`` samples / ``num_inserts`` inserts through now."""
        return self._unary("check_rate_limiter", lambda stub: stub.CheckRateLimiter,
                           pb.RateLimiterCheckRequest(table=table, num_samples=num_samples, num_inserts=num_inserts))


def _rebuild_client(address: str, security_args: dict[str, Any], data_planes: tuple[str, ...] = ("shm", "rdma"),
                    connect_timeout: float | None = None) -> Client:
    return Client(address, data_planes=data_planes, connect_timeout=connect_timeout, **security_args)


_KNOWN_PLANES = ("shm", "rdma")


def _data_planes_option(value: Sequence[str] | str | None) -> tuple[str, ...]:
    """The planes besides inline a client may use (see Client.__init__)."""
    if value is None:
        value = os.environ.get("GEAR_DATA_PLANES", ",".join(_KNOWN_PLANES))
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    planes = tuple(v for v in value if v != "inline")
    unknown = sorted(set(planes) - set(_KNOWN_PLANES))
    if unknown:
        raise ValueError(f"unknown data plane(s) {unknown}; known: shm, rdma, inline")
    return planes


def _sample_info(m: pb.SampleInfo) -> SampleInfo:
    return SampleInfo(int(m.key), float(m.probability), int(m.table_size), float(m.priority), int(m.times_sampled))
