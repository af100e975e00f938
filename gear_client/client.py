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

import ctypes
import os
import secrets
import sys
import threading
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from gear_client import errors, nest
from gear_client._proto import replay_pb2 as pb
from gear_client._proto import replay_pb2_grpc as pb_grpc
from gear_client.replay_sample import ReplaySample, SampleInfo
from gear_client.wire import read_varint, skip_field

__all__ = ["Client", "decode_sample_response", "SampleBatchView", "CHANNEL_OPTIONS"]

MAX_MESSAGE_BYTES = (1 << 31) - 1
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
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
                    yield emit(batch.info(i), batch.item_columns(i))
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
        from gear_client.server import TableInfo

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


_allocator_tuned = False


def tune_allocator(mmap_threshold: int = 128 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep freed multi-MiB buffers in the heap (glibc) so the next ones do not fault in fresh pages.

    Every sampled message and batch is a fresh multi-MiB buffer; with glibc's
    defaults the heap top is trimmed and the pages faulted in (and zeroed) again
    for nearly every message, which costs as much CPU as the copies themselves.
    Buffers under ``mmap_threshold`` come from the heap, and up to
    ``trim_threshold`` bytes of free heap are kept. Set ``GEAR_MALLOC_TUNING=0``
    to leave the allocator alone. Returns whether the settings were applied.
    """
    global _allocator_tuned
    if _allocator_tuned or not sys.platform.startswith("linux") or os.environ.get("GEAR_MALLOC_TUNING", "1") == "0":
        return _allocator_tuned
    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters
        _allocator_tuned = bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold))) and \
            bool(libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):
        _allocator_tuned = False
    return _allocator_tuned


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


# ---------------------------------------------------------------- wire parsing ----

class SampleBatchView:
    """A decoded SampleResponse: infos, per-item lengths and column arrays viewing the message bytes."""

    __slots__ = ("infos", "lengths", "structure", "squeeze", "columns", "starts", "num_items")

    def __init__(self, batch: pb.SampleBatch, columns: list[np.ndarray]):
        self.infos = batch.info
        self.num_items = len(batch.info)
        n_cols = len(columns)
        self.lengths = np.asarray(batch.lengths, np.int64).reshape(self.num_items, n_cols) if n_cols else \
            np.zeros((self.num_items, 0), np.int64)
        self.structure = batch.structure
        self.squeeze = list(batch.squeeze) + [False] * (n_cols - len(batch.squeeze))
        self.columns = columns
        self.starts = np.zeros_like(self.lengths)
        if self.num_items:
            np.cumsum(self.lengths[:-1], axis=0, out=self.starts[1:])
            for c, col in enumerate(columns):
                if col.shape[0] != int(self.lengths[:, c].sum()):
                    raise ValueError(f"sample batch column {c} holds {col.shape[0]} steps, lengths say "
                                     f"{int(self.lengths[:, c].sum())}")

    def info(self, i: int) -> SampleInfo:
        m = self.infos[i]
        return SampleInfo(int(m.key), float(m.probability), int(m.table_size), float(m.priority),
                          int(m.times_sampled))

    def item_columns(self, i: int) -> list[np.ndarray]:
        """Item i's leaves: [T, *shape] (squeezed columns: [*shape])."""
        out = []
        for c, col in enumerate(self.columns):
            start = int(self.starts[i, c])
            if self.squeeze[c]:
                out.append(col[start, ...])  # an array (0-d for scalars), not a numpy scalar
            else:
                out.append(col[start:start + int(self.lengths[i, c])])
        return out


def _parse_tensor(raw: bytes, buf: memoryview, start: int, end: int) -> np.ndarray:
    """A Tensor message in raw[start:end] -> an array viewing its data bytes (no copy)."""
    dtype_text = ""
    shape: list[int] = []
    data_at, data_len = start, 0
    pos = start
    while pos < end:
        key, pos = read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 1 and wire_type == 2:
            length, pos = read_varint(buf, pos)
            dtype_text = bytes(buf[pos:pos + length]).decode()
            pos += length
        elif field == 2 and wire_type == 2:  # packed shape
            length, pos = read_varint(buf, pos)
            stop = pos + length
            while pos < stop:
                d, pos = read_varint(buf, pos)
                shape.append(d)
        elif field == 2 and wire_type == 0:
            d, pos = read_varint(buf, pos)
            shape.append(d)
        elif field == 3 and wire_type == 2:
            data_len, pos = read_varint(buf, pos)
            data_at = pos
            pos += data_len
        else:
            pos = skip_field(buf, pos, wire_type)
    if pos != end:
        raise ValueError("malformed tensor in sample response")
    dtype = np.dtype(dtype_text)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != data_len:
        raise ValueError(f"sample tensor of shape {shape} and dtype {dtype_text} holds {data_len} bytes")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=data_at).reshape(shape)


def decode_sample_response(raw: bytes, writable: bool = False) -> SampleBatchView:
    """Parse a serialized SampleResponse.

    Column arrays view ``raw`` (read-only, no copy), or with ``writable`` are one
    copy per column (numpy arrays users may modify in place, as Reverb's are).
    """
    buf = memoryview(raw)
    small = bytearray()  # every SampleBatch field but the columns, re-parsed by protobuf
    columns: list[np.ndarray] = []
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = read_varint(buf, pos)
        if key != 0x0A:  # SampleResponse.batch, length-delimited
            pos = skip_field(buf, pos, key & 7)
            continue
        length, pos = read_varint(buf, pos)
        batch_end = pos + length
        if batch_end > end:
            raise ValueError("truncated sample response")
        while pos < batch_end:
            field_start = pos
            key, pos = read_varint(buf, pos)
            if key == 0x12:  # SampleBatch.columns
                length, pos = read_varint(buf, pos)
                column = _parse_tensor(raw, buf, pos, pos + length)
                columns.append(column.copy() if writable else column)
                pos += length
            else:
                pos = skip_field(buf, pos, key & 7)
                small += buf[field_start:pos]
        if pos != batch_end:
            raise ValueError("malformed sample batch")
    return SampleBatchView(pb.SampleBatch.FromString(bytes(small)), columns)
