"""A recording ReplayService on loopback for the writer tests.

It implements only ``InsertStream``, the way the daemon must: chunks are kept
per stream until released, items are assembled from chunk slices and
acknowledged, and it records every request so tests can check the encoding.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc


@dataclass
class ReceivedItem:
    key: int
    table: str
    priority: float
    data: Any  # the nest rebuilt from the item's structure
    columns: list[np.ndarray]
    episode_ids: set[int] = field(default_factory=set)


class RecordingServicer(replay_pb2_grpc.ReplayServiceServicer):
    """Records requests, assembles items, acknowledges them (optionally only when allowed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[pb.InsertStreamRequest] = []
        self.items: list[ReceivedItem] = []
        self.streams_opened = 0
        self.streams_ended = 0
        self.live_chunks_at_end: list[int] = []
        self.ack_gate: threading.Semaphore | None = None  # set to hold acks (back-pressure)
        self.abort_on_table: dict[str, tuple[grpc.StatusCode, str]] = {}
        self.item_arrived = threading.Condition(self.lock)

    def InsertStream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        chunks: dict[int, pb.ChunkData] = {}
        with self.lock:
            self.streams_opened += 1
        try:
            for request in request_iterator:
                with self.lock:
                    self.requests.append(request)
                for chunk in request.chunks:
                    if chunk.chunk_key in chunks:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"chunk {chunk.chunk_key} sent twice")
                    chunks[chunk.chunk_key] = chunk
                for item in request.items:
                    if item.table in self.abort_on_table:
                        code, message = self.abort_on_table[item.table]
                        context.abort(code, message)
                    columns, episodes = [], set()
                    for column in item.columns:
                        parts = []
                        for s in column.slices:
                            if s.chunk_key not in chunks:
                                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown chunk {s.chunk_key}")
                            c = chunks[s.chunk_key]
                            episodes.add(c.episode_id)
                            arr = np.frombuffer(c.data.data, np.dtype(c.data.dtype)).reshape(tuple(c.data.shape))
                            if s.offset < 0 or s.offset + s.length > arr.shape[0]:
                                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "slice out of range")
                            parts.append(arr[s.offset:s.offset + s.length])
                        value = np.concatenate(parts)
                        if column.squeeze:
                            if value.shape[0] != 1:
                                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "squeezed column of length != 1")
                            value = value[0]
                        columns.append(value)
                    received = ReceivedItem(item.key, item.table, item.priority,
                                            nest.unflatten(item.structure, columns), columns, episodes)
                    if self.ack_gate is not None:
                        while not self.ack_gate.acquire(timeout=0.05):
                            if not context.is_active():
                                return
                    with self.lock:
                        self.items.append(received)
                        self.item_arrived.notify_all()
                    yield pb.InsertStreamResponse(keys=[item.key])
                for key in request.release_chunk_keys:
                    if key not in chunks:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"release of unknown chunk {key}")
                    del chunks[key]
        finally:
            with self.lock:
                self.streams_ended += 1
                self.live_chunks_at_end.append(len(chunks))

    def chunk_messages(self) -> list[pb.ChunkData]:
        with self.lock:
            return [c for r in self.requests for c in r.chunks]

    def released_keys(self) -> list[int]:
        with self.lock:
            return [k for r in self.requests for k in r.release_chunk_keys]


class FakeClient:
    """What a writer needs of a Client: ``_stub`` and ``_table_info``."""

    def __init__(self, address: str, tables: dict[str, pb.TableInfo]):
        self._channel = grpc.insecure_channel(address)
        self._stub = replay_pb2_grpc.ReplayServiceStub(self._channel)
        self.tables = tables
        self.info_calls = 0

    def _table_info(self, name: str, refresh: bool = False) -> pb.TableInfo:
        self.info_calls += 1
        if name not in self.tables:
            raise ValueError(f"Table '{name}' not found on the server")
        return self.tables[name]

    def close(self) -> None:
        self._channel.close()


class LoopbackServer:
    """A grpc.server on 127.0.0.1 with a RecordingServicer."""

    def __init__(self) -> None:
        self.servicer = RecordingServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        replay_pb2_grpc.add_ReplayServiceServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)
