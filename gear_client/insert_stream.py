"""The writer's transport over gRPC: one ``InsertStream`` call, batched requests, acknowledgements counted.

``InsertStream.send_item`` is where an encoded item (its new chunks and its
``PrioritizedItem`` bytes) is handed to the transport. Requests are framed by
hand around the chunks' raw buffers (gear_contract/wire.py), batched while
gRPC's own thread is busy sending the previous message, and queued to that
thread; a reader thread counts the acknowledged keys.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from gear_client.chunker import NewChunk
from gear_client.errors import ServiceError
from gear_contract._proto import replay_pb2 as pb
from gear_contract.allocator import tune_allocator
from gear_contract.wire import encode_release_keys

__all__ = ["InsertStream", "close_stream"]

# Requests group chunks up to this size (gRPC's default limit is 4 MiB; the daemon takes more).
MAX_REQUEST_BYTES = 3 << 20
# Under load, items are batched into requests of about this size.
BATCH_BYTES = 2 << 20
_CLOSE_TIMEOUT_S = 2.0

_INSERT_STREAM_METHOD = "/gear.v1.ReplayService/InsertStream"


def _open_insert_stream(client: Any) -> tuple[Any, bool]:
    """The InsertStream multicallable, and whether it takes encoded bytes.

    With the client's channel the writer sends its hand-encoded bytes as they
    are; through the stub (no channel) they are parsed into a message first.
    """
    stub = client._stub
    channel = getattr(client, "_channel", None)
    if isinstance(channel, grpc.Channel):
        return channel.stream_stream(_INSERT_STREAM_METHOD, request_serializer=None,
                                     response_deserializer=pb.InsertStreamResponse.FromString), True
    return stub.InsertStream, False


# ------------------------------------------------------------------ stream ----

class InsertStream:
    """One InsertStream call: batched requests through a queue, acknowledgements counted by a thread.

    Requests are filled in place in ``batch``; a batch is handed to gRPC's
    request thread as soon as that thread is idle, or once it holds
    ``BATCH_BYTES`` (under load many items share one message: per-message
    costs dominate otherwise). Holds no reference to the writer, so a dropped
    writer is collected and its finalizer ends the stream.
    """

    def __init__(self, client: Any):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.pending: dict[int, int] = {}  # item key -> bytes sent with it
        self.in_flight_bytes = 0
        self.error: BaseException | None = None
        self.done = False
        self._closing = False
        self._sender_idle = True  # gRPC's request thread waits for the next request
        self.batch: list | None = None  # pieces of the next message (bytes, or views of column buffers)
        self.batch_bytes = 0
        open_call, self._raw = _open_insert_stream(client)
        # Every message is a fresh multi-MiB bytes object (the batch joined): keep freed ones in the heap
        # so the next is not faulted in (and zeroed) page by page. Measured +3-4 % writer throughput.
        tune_allocator()
        # wait_for_ready: a daemon still starting (or restarting) is waited for, not an error.
        self._call = open_call(self._requests(), wait_for_ready=True)
        self._reader = threading.Thread(target=self._read_acks, name="gear-insert-acks", daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.InsertStreamRequest]:
        q = self._queue
        while True:
            try:
                request = q.get_nowait()
            except queue.Empty:
                self._sender_idle = True
                request = q.get()
            self._sender_idle = False
            if request is None:
                return
            yield request

    def _read_acks(self) -> None:
        error: BaseException | None = None
        try:
            for response in self._call:
                with self._cond:
                    for key in response.keys:
                        self.in_flight_bytes -= self.pending.pop(key, 0)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - reported to the writer, never lost
            error = e
        finally:
            self._queue.put(None)  # unblock gRPC's request thread
            with self._cond:
                if error is None and self.pending and not self._closing:
                    error = ServiceError(f"the insert stream ended with {len(self.pending)} items unacknowledged")
                if error is not None and not self._closing:
                    self.error = error
                self.done = True
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def request(self, nbytes: int) -> list:
        """The batch (a list of encoded pieces) to extend with ``nbytes`` more (a new one when full)."""
        if self.batch is not None and self.batch_bytes + nbytes > MAX_REQUEST_BYTES:
            self.submit()
        if self.batch is None:
            self.batch = []
            self.batch_bytes = 0
        self.batch_bytes += nbytes
        return self.batch

    def added(self, key: int | None = None, nbytes: int = 0) -> None:
        """Account for what was just filled into ``batch``; send it if the sender waits or it is full."""
        if key is not None:
            with self._cond:
                self.pending[key] = nbytes
                self.in_flight_bytes += nbytes
        if self.batch_bytes >= BATCH_BYTES or self._sender_idle:
            self.submit()

    def send_item(self, chunks: list[NewChunk], key: int, item: bytes, releases: Sequence[int] = ()) -> None:
        """Hand one encoded item to the transport: its new chunks, then the item (and chunk keys to release).

        Chunks stay views of the column buffers until the batch is joined into
        one message; the item is an encoded ``InsertStreamRequest.items`` field
        appended after them (concatenated messages merge).
        """
        nbytes = sum(len(c.head) + c.data.nbytes for c in chunks)
        remaining = nbytes
        start = 0
        # Chunks beyond one request's worth go first, in requests of their own.
        while remaining > MAX_REQUEST_BYTES and len(chunks) - start > 1:
            size = 0
            pieces = []
            while len(chunks) - start > 1 and (not pieces or size + len(chunks[start].head) + chunks[start].data.nbytes
                                               <= MAX_REQUEST_BYTES):
                chunk = chunks[start]
                start += 1
                pieces += (chunk.head, chunk.data)
                size += len(chunk.head) + chunk.data.nbytes
            self.request(size).extend(pieces)
            self.submit()
            remaining -= size
        if releases:
            item += encode_release_keys(releases)
        pieces = self.request(remaining + len(item))
        for chunk in chunks[start:]:
            pieces += (chunk.head, chunk.data)
        pieces.append(item)
        self.added(key, nbytes)

    def send_releases(self, keys: Sequence[int]) -> None:
        """Release chunks (sent at once: nothing waits for them)."""
        if keys:
            self.request(0).append(encode_release_keys(keys))
        self.submit()

    def submit(self) -> None:
        """Join the batch into one message (copying the column views) and queue it."""
        batch, self.batch = self.batch, None
        if batch:
            message = b"".join(batch)
            self._sender_idle = False
            self._queue.put(message if self._raw else pb.InsertStreamRequest.FromString(message))

    def wait(self, max_items: int, max_bytes: int, deadline: float | None) -> bool:
        """Block until at most max_items (and max_bytes) are in flight; False on timeout.

        Returns True early when the stream failed or ended (the caller checks ``error``).
        """
        if len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
            self.submit()  # what we wait for may sit in the batch (acks only lower the counts)
        with self._cond:
            while len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
                if self.done or self.error is not None:
                    return True
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            return True

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Half-close; cancel if the server has not finished within ``timeout``."""
        self.submit()
        self._queue.put(None)
        self._reader.join(timeout)
        if self._reader.is_alive():
            with self._cond:
                self._closing = True
            self._call.cancel()
            self._reader.join(timeout)

    def abort(self) -> None:
        """Cancel at once (after an error, or when the writer is dropped); once only.

        A writer dropped at interpreter exit is aborted twice (by its finalizer at
        exit, then by ``__del__``), and gRPC calls made while the interpreter
        finalizes can block forever.
        """
        with self._cond:
            if self._closing:
                return  # aborted already, or cancelled by close()
            self._closing = True
        self.batch = None
        self._queue.put(None)
        self._call.cancel()


def close_stream(stream: InsertStream | None) -> None:
    if stream is not None and not stream.done:
        stream.abort()
