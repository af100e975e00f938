"""InsertStream by hand: one-chunk requests, a stream held open, and the chunk-budget refusals."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb

LEAF = pb.Structure(kind=pb.Structure.LEAF)


def chunk_request(key: int, data: np.ndarray, table: str = "t", release: bool = True) -> pb.InsertStreamRequest:
    tensor = pb.Tensor(dtype=data.dtype.str, shape=list(data.shape), data=data.tobytes())
    item = pb.PrioritizedItem(key=key, table=table, priority=1.0, structure=LEAF, columns=[
        pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=key, offset=0, length=len(data))])])
    return pb.InsertStreamRequest(chunks=[pb.ChunkData(chunk_key=key, data=tensor, episode_id=key)], items=[item],
                                  release_chunk_keys=[key] if release else [])


def exhaust_chunk_budgets(stub, block: np.ndarray, first_key: int) -> None:
    """Against a server with 64 KiB per stream and 96 KiB in all of chunk bytes (16 KiB ``block``s kept,
    never released): the fifth chunk of one stream is refused naming ``limits.max_stream_buffer_bytes``;
    then two streams under their own budget pass the total one together, refused naming
    ``limits.max_buffered_bytes``. Keys from ``first_key`` (three runs of 100); 4 + 4 + 2 items acknowledged."""
    stream = HeldStream(stub)
    for k in range(first_key, first_key + 4):
        stream.send(chunk_request(k, block, release=False))
        assert list(next(stream.call).keys) == [k]
    stream.send(chunk_request(first_key + 4, block, release=False))
    error = stream.error()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_stream_buffer_bytes" in error.details()
    first, second = HeldStream(stub), HeldStream(stub)
    for k in range(first_key + 100, first_key + 104):
        first.send(chunk_request(k, block, release=False))
        assert list(next(first.call).keys) == [k]
    for k in range(first_key + 200, first_key + 202):
        second.send(chunk_request(k, block, release=False))
        assert list(next(second.call).keys) == [k]
    second.send(chunk_request(first_key + 202, block, release=False))
    error = second.error()
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_buffered_bytes" in error.details()
    first.close()
    list(first.call)


class HeldStream:
    """An InsertStream whose requests come from a queue: it stays open until ``close()``."""

    def __init__(self, stub, metadata=None):
        self._queue: list = []
        self._more = threading.Condition()
        self._closed = False
        self.call = stub.InsertStream(self._requests(), timeout=60, metadata=metadata)

    def _requests(self):
        while True:
            with self._more:
                while not self._queue and not self._closed:
                    self._more.wait()
                if not self._queue:
                    return
                request = self._queue.pop(0)
            yield request

    def send(self, request) -> None:
        with self._more:
            self._queue.append(request)
            self._more.notify()

    def close(self) -> None:
        with self._more:
            self._closed = True
            self._more.notify()

    def error(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            for _ in self.call:
                pass
        return info.value
