"""The Reverb client: insert, sample, mutate priorities, reset, server info, writers.

``Client(server_address)`` talks to a gear daemon over gRPC. It connects
lazily, is safe to share between threads (one channel, calls are independent)
and pickles as its address (plus any explicit security settings), so a copy in
another process opens its own channel.

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
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from gear_client import errors
from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_client.table_info import TableInfo
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.allocator import tune_allocator
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.wire import decode_sample_response

__all__ = ["Client"]

_SAMPLE_METHOD = "/gear.v1.ReplayService/Sample"
# Items per Select when client.sample goes over a data plane (shm/rdma).
_PLANE_ITEMS_PER_SELECT = 256


class Client:
    """Client of a gear replay daemon (Reverb's ``reverb.Client``)."""

    def __init__(self, server_address: str, client: Client | None = None, *, token: str | None = None,
                 root_certificates: Any = None, certificate_chain: Any = None, private_key: Any = None,
                 data_planes: Sequence[str] | None = None):
        """``data_planes``: the planes ``sample`` may negotiate besides inline (default ``("shm", "rdma")``,
        or the comma-separated ``GEAR_DATA_PLANES``; ``()`` or ``"inline"`` keeps every sample on gRPC)."""
        if not isinstance(server_address, str) or not server_address:
            raise ValueError(f"server_address must be a non-empty string, got {server_address!r}")
        self._server_address = server_address
        self._data_planes = _data_planes_option(data_planes)
        self._security_args = {k: v for k, v in (("token", token), ("root_certificates", root_certificates),
                                                 ("certificate_chain", certificate_chain),
                                                 ("private_key", private_key)) if v is not None}
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub_instance: pb_grpc.ReplayServiceStub | None = None
        self._sample_call = None
        self._table_infos: dict[str, pb.TableInfo] = {}
        self._planes: dict[str, Any] = {}  # table -> PlaneSampler (shm/rdma) or None (inline)
        if client is not None and client._server_address == server_address:
            # Reverb's "pre-existing client": share its channel.
            self._channel, self._stub_instance, self._sample_call = client._connect()

    # ------------------------------------------------------------------ plumbing
    def __reduce__(self):
        return _rebuild_client, (self._server_address, self._security_args, self._data_planes)

    def __repr__(self) -> str:
        return f"Client, server_address={self._server_address}"

    @property
    def server_address(self) -> str:
        return self._server_address

    def _connect(self):
        with self._lock:
            if self._channel is None:
                self._channel = self._new_channel()
                self._stub_instance = pb_grpc.ReplayServiceStub(self._channel)
                # Sample responses are parsed by hand (decode_sample_response): no deserializer.
                self._sample_call = self._channel.unary_stream(
                    _SAMPLE_METHOD, request_serializer=pb.SampleRequest.SerializeToString,
                    response_deserializer=None)
            return self._channel, self._stub_instance, self._sample_call

    def _new_channel(self) -> grpc.Channel:
        try:
            from gear_client.auth import ChannelSecurity
        except ImportError:
            return grpc.insecure_channel(self._server_address, options=CHANNEL_OPTIONS)
        security = ChannelSecurity.build(**self._security_args)
        return security.channel(self._server_address, options=CHANNEL_OPTIONS)

    @property
    def _stub(self) -> pb_grpc.ReplayServiceStub:
        """The ReplayService stub on this client's channel (writers stream inserts through it)."""
        return self._connect()[1]

    def close(self) -> None:
        """Close the channel (a later call reconnects)."""
        with self._lock:
            channel, self._channel, self._stub_instance, self._sample_call = self._channel, None, None, None
            planes, self._planes = self._planes, {}
        for plane in planes.values():
            if plane is not None:
                plane.close()
        if channel is not None:
            channel.close()

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

    def _fetch_server_info(self, timeout: float | None) -> pb.ServerInfoResponse:
        try:
            response = self._stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                raise errors.DeadlineExceededError(
                    f"ServerInfo call did not complete within provided timeout of {timeout}s") from e
            raise errors.from_rpc_error(e, "server_info") from e
        with self._lock:
            self._table_infos = {t.name: t for t in response.table_info}
        return response

    # ------------------------------------------------------------------ inserts
    def insert(self, data: Any, priorities: Mapping[str, float]) -> None:
        """Insert ``data`` (a nest; stored once) as one item into each table of ``priorities``.

        The item holds a single step: every leaf gains a leading time dimension of 1.
        Blocks while a table's rate limiter holds the insert.
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
        try:
            for response in self._stub.InsertStream(iter([request]), wait_for_ready=True):
                wanted.difference_update(response.keys)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "insert") from e
        if wanted:
            raise errors.ServiceError(f"insert: the daemon did not acknowledge item(s) {sorted(wanted)}")

    def writer(self, max_sequence_length: int, delta_encoded: bool = False, chunk_length: int | None = None,
               max_in_flight_items: int | None = 25):
        """A legacy ``Writer`` whose items span at most ``max_sequence_length`` steps (it validates its arguments)."""
        from gear_client.writer import Writer

        return Writer(self, max_sequence_length=max_sequence_length, delta_encoded=delta_encoded,
                      chunk_length=chunk_length, max_in_flight_items=max_in_flight_items)

    def trajectory_writer(self, num_keep_alive_refs: int, *, validate_items: bool = True,
                          get_signature_timeout_ms: int | None = 3000):
        """A ``TrajectoryWriter`` whose items may reach ``num_keep_alive_refs`` steps back."""
        if num_keep_alive_refs < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        del get_signature_timeout_ms  # signatures are fetched on demand and cached
        from gear_client.trajectory_writer import TrajectoryWriter

        return TrajectoryWriter(self, num_keep_alive_refs, validate_items=validate_items)

    def structured_writer(self, configs: Sequence[Any]):
        """A ``StructuredWriter`` that inserts items as ``configs`` describe (reverb.structured)."""
        if not configs:
            raise ValueError("At least one config must be provided.")
        from gear_client.structured import StructuredWriter

        return StructuredWriter(self, configs)

    # ------------------------------------------------------------------ samples
    def sample(self, table: str, num_samples: int = 1, *, emit_timesteps: bool = True,
               unpack_as_table_signature: bool = False
               ) -> Generator[list[ReplaySample] | ReplaySample, None, None]:
        """Sample ``num_samples`` items from ``table``: a generator, blocking while the rate limiter says so.

        Yields, per item, a ReplaySample of the whole trajectory (``emit_timesteps=False``;
        data flat, or unpacked as the table signature) or a list of one ReplaySample
        per step (``emit_timesteps=True``).
        """
        structure = None
        if unpack_as_table_signature:
            structure = self._signature_structure(table)

        def emit(info, data):
            if emit_timesteps:
                if len({_length_of(col) for col in data}) != 1:
                    raise ValueError("Can't split non timestep trajectory into timesteps.")
                steps = []
                for t in range(_length_of(data[0])):
                    step = [np.asarray(col[t], col.dtype) for col in data]
                    steps.append(ReplaySample(info=info, data=_unpack(structure, step)))
                return steps
            return ReplaySample(info=info, data=_unpack(structure, data))

        plane = self._data_plane(table)
        if plane is not None:  # shm or rdma negotiated: bytes bypass the control plane
            tune_allocator()  # batches and the caller's stacked copies are multi-MiB buffers too
            remaining = int(num_samples)
            while remaining > 0:
                batch = plane.sample(min(remaining, _PLANE_ITEMS_PER_SELECT))
                remaining -= len(batch)
                for i, info in enumerate(batch.item_infos()):
                    yield emit(info, batch.item_columns(i))
            return
        sample_call = self._connect()[2]
        tune_allocator()
        request = pb.SampleRequest(table=table, num_samples=int(num_samples))
        call = sample_call(request, wait_for_ready=True)
        try:
            for raw in call:
                batch = decode_sample_response(raw, writable=True)
                for i in range(batch.num_items):
                    yield emit(_sample_info(batch.infos[i]), batch.item_columns(i))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "sample") from e
        finally:
            call.cancel()

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

        sampler = PlaneSampler(self, table, planes=self._data_planes)
        try:
            sampler.open()
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
        """Delete ``deletes`` then set ``updates`` (key -> priority); unknown keys are ignored."""
        request = pb.MutatePrioritiesRequest(
            table=table, updates=[pb.KeyWithPriority(key=int(k), priority=float(p)) for k, p in (updates or {}).items()],
            delete_keys=[int(k) for k in (deletes or [])])
        try:
            self._stub.MutatePriorities(request, wait_for_ready=True)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "mutate_priorities") from e

    def reset(self, table: str) -> None:
        """Empty the table and reset its rate limiter."""
        try:
            self._stub.Reset(pb.ResetRequest(table=table), wait_for_ready=True)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "reset") from e

    def server_info(self, timeout: float | None = None) -> dict[str, Any]:
        """Table name -> TableInfo; DeadlineExceededError when the daemon does not answer within ``timeout`` s."""

        response = self._fetch_server_info(timeout or None)
        return {t.name: TableInfo.from_proto(t) for t in response.table_info}

    def checkpoint(self) -> str:
        """Have the daemon write a checkpoint; returns its path."""
        try:
            return self._stub.Checkpoint(pb.CheckpointRequest(), wait_for_ready=True).path
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "checkpoint") from e

    def _check_rate_limiter(self, table: str, num_samples: int = 0, num_inserts: int = 0
                            ) -> pb.RateLimiterCheckResponse:
        """Whether the table would let ``num_samples`` samples / ``num_inserts`` inserts through now."""
        try:
            return self._stub.CheckRateLimiter(
                pb.RateLimiterCheckRequest(table=table, num_samples=num_samples, num_inserts=num_inserts),
                wait_for_ready=True)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "check_rate_limiter") from e


def _rebuild_client(address: str, security_args: dict[str, Any], data_planes: tuple[str, ...] = ("shm", "rdma")
                    ) -> Client:
    return Client(address, data_planes=data_planes, **security_args)


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


def _length_of(column: np.ndarray) -> int:
    if column.ndim == 0:
        raise ValueError("Can't split non timestep trajectory into timesteps.")
    return int(column.shape[0])


def _unpack(structure: pb.Structure | None, leaves: list) -> Any:
    if structure is None:
        return leaves
    return nest.unflatten(structure, leaves)


def _sample_info(m: pb.SampleInfo) -> SampleInfo:
    return SampleInfo(int(m.key), float(m.probability), int(m.table_size), float(m.priority), int(m.times_sampled))
