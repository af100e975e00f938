"""The writer's transport over gRPC: ``InsertStream`` calls that survive a daemon restart.

``InsertStream.send_item`` is the one place where an encoded item (its new
chunks and its ``PrioritizedItem`` bytes) is handed to the transport.
Requests are framed by hand around the chunks' raw buffers
(gear_contract/wire.py) and batched: the stream's sender takes the batch
whenever it is idle and no item is unacknowledged (else with the
acknowledgement of the last one), so items go out in the background as soon
as they are created, flush or not; under load many items share one message
(a writer of a few items sends two, not one per item, and the daemon answers
two), and a full batch (``BATCH_BYTES``) goes at once.

The transport keeps what a new call would need: every chunk the server must
still hold (live, or released while an item that uses it is unacknowledged),
as the bytes it was sent in, and every unacknowledged item. A call that ends
with UNAVAILABLE (a daemon restarting, a network cut) or ends early is
transient: a thread waits for the daemon with back-off, opens a new call and
resends the chunks and the unacknowledged items (same keys; an item the
daemon already holds is not inserted twice), then carries on. Items still
unacknowledged after ``reconnect_timeout_s`` without a daemon are given up:
the writer's next call raises ``ItemsNotInsertedError`` naming their keys.
A call that never ends although its daemon answers nothing (a daemon stopped
or wedged, a host cut off: no error comes) is told from a daemon that holds
inserts back on its rate limiter by a ``DaemonWatch`` (ServerInfo probes while
a writer waits): once neither acknowledgements nor probes came for
``reconnect_timeout_s``, the call is cancelled and its items are given up the
same way.
Any other status is the writer's next call's error, as in Reverb.

A stream is a coroutine on the process's loop thread (gear_client/connection/aio_loop.py) over the
client's grpc.aio channel: a writer costs no thread of its own, which is what a connect storm of a
thousand actors in one process pays for most. Clients without a daemon channel (test doubles with a
sync channel or stub) get the same coroutine over a sync call, read through the loop's executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import grpc.aio

from gear_client.connection import aio_loop
from gear_client.connection.auth import ChannelSecurity
from gear_client.errors import ServiceError
from gear_client.writers.chunker import NewChunk
from gear_client.writers.routes import ingest_target
from gear_contract._proto import replay_pb2 as pb
from gear_contract.allocator import tune_allocator
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.daemon_watch import DaemonWatch
from gear_contract.wire import encode_release_keys, mark_resend

__all__ = ["InsertStream", "close_stream", "describe_error"]

log = logging.getLogger(__name__)

# Requests group chunks up to this size (gRPC's default limit is 4 MiB; the daemon takes more).
MAX_REQUEST_BYTES = 3 << 20
# Under load, items are batched into requests of about this size.
BATCH_BYTES = 2 << 20
_CLOSE_TIMEOUT_S = 2.0
_CANCEL_WAIT_S = 1.0
_IDLE = object()  # the sender has nothing to write: it waits to be woken
# Waiting for a daemon that went away: back-off between failed calls; waiters look at the clock this often.
_POLL_S = 0.5
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
_INSERT_STREAM_METHOD = "/gear.v1.ReplayService/InsertStream"
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class _Pending(NamedTuple):
    """An item sent and not yet acknowledged: its order, its encoded field, its chunk bytes."""

    seq: int
    item: bytes
    nbytes: int
    created_at: float  # time.monotonic() when the writer handed it over


class _CallCancelled(grpc.RpcError):
    """A call this process cancelled (grpc.aio raises asyncio.CancelledError for it): CANCELLED, transient."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "cancelled by the writer"


class _SyncCall:
    """A sync stream-stream call with the aio call's methods (for clients without a daemon channel): a thread
    of its own reads the responses (the loop's default executor has a few threads for all such calls)."""

    _END = object()

    def __init__(self, multicallable: Any, raw: bool):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._raw = raw
        self._call = multicallable(iter(self._requests.get, self._END), wait_for_ready=False)
        self._responses: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, args=(loop,), name="gear-insert-stream-sync", daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for response in self._call:
                loop.call_soon_threadsafe(self._responses.put_nowait, response)
            end: Any = grpc.aio.EOF
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            end = e
        try:
            loop.call_soon_threadsafe(self._responses.put_nowait, end)
        except RuntimeError:  # the loop is gone (interpreter exit)
            pass

    async def write(self, request: bytes) -> None:
        self._requests.put(request if self._raw else pb.InsertStreamRequest.FromString(request))

    async def done_writing(self) -> None:
        self._requests.put(self._END)

    async def read(self) -> Any:
        response = await self._responses.get()
        if isinstance(response, BaseException):
            raise response
        return response

    def cancel(self) -> bool:
        self._requests.put(self._END)
        return self._call.cancel()


class _LazyChannel:
    """A sync channel made only when a ``DaemonWatch`` probes through it (an ingest worker's)."""

    def __init__(self, security: ChannelSecurity, target: str):
        self._security, self._target = security, target
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._channel is None:
                self._channel = self._security.channel(self._target, options=CHANNEL_OPTIONS)
            return self._channel.unary_unary(method, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


class _Route:
    """Where a writer's calls go: an aio channel of the client's daemon channel, an ingest worker's own aio
    channel, or (test doubles) a sync channel or stub; ``watch_on``: what a DaemonWatch probes through."""

    def __init__(self, client: Any, use_ingest: bool):
        self.daemon = client._daemon_channel() if callable(getattr(client, "_daemon_channel", None)) else None
        self.metadata = None
        self.target = ingest_target(client) if use_ingest and self.daemon is not None else None
        self.security = ChannelSecurity.build(**client._security_args) if self.target is not None else None
        self.watch_channel: Any = None
        self._aio: grpc.aio.Channel | None = None
        self._sync = None
        self.raw = True  # hand-encoded bytes go out as they are (through a stub they are parsed first)
        if self.daemon is not None:
            self.metadata = self.daemon.call_metadata
            self.watch_channel = (_LazyChannel(self.security, self.target) if self.target is not None
                                  else self.daemon)
        else:
            channel = getattr(client, "_channel", None)
            if isinstance(channel, grpc.Channel):
                self._sync = (channel.stream_stream(_INSERT_STREAM_METHOD, request_serializer=None,
                                                    response_deserializer=pb.InsertStreamResponse.FromString), True)
                self.watch_channel = channel
            else:
                self._sync = (client._stub.InsertStream, False)
                self.raw = False

    def open(self) -> Any:
        """A new call (on the loop thread)."""
        if self._sync is not None:
            return _SyncCall(*self._sync)
        if self.target is not None:
            if self._aio is None:
                self._aio = self.security.aio_channel(self.target, options=CHANNEL_OPTIONS)
            channel = self._aio
        else:
            channel = self.daemon.aio_channel()
        call = channel.stream_stream(_INSERT_STREAM_METHOD, request_serializer=None,
                                     response_deserializer=pb.InsertStreamResponse.FromString)
        return call(metadata=self.metadata, wait_for_ready=False)

    def close(self) -> None:
        """Close what this route made for itself (an ingest worker's channels; on the loop thread)."""
        channel, self._aio = self._aio, None
        if channel is not None:
            asyncio.ensure_future(channel.close())
        if isinstance(self.watch_channel, _LazyChannel):
            self.watch_channel.close()


class InsertStream:
    """InsertStream calls of one writer: batches, acknowledgements, reconnection and resending.

    Everything below is guarded by ``_cond``. Holds no reference to the
    writer, so a dropped writer is collected and its finalizer ends the stream.
    """

    def __init__(self, client: Any, reconnect_timeout_s: float):
        self._cond = threading.Condition()
        self._reconnect_timeout_s = float(reconnect_timeout_s)
        # An ingest worker of the daemon when it runs some (gear_client/writers/routes.py). After an outage
        # the writer reconnects to the daemon itself: a restarted daemon's workers listen on other ports.
        self._client = client
        self._route = _Route(client, use_ingest=True)
        self._watch = self._watch_for(self._route.watch_channel)
        self._last_ack_at = time.monotonic()
        self._silent_call: Any = None  # the call cancelled because its daemon answered nothing
        self._resent = 0  # items the current call resent after an outage (logged at its first acknowledgement)
        self._calls_opened = 0
        self.address = str(getattr(client, "server_address", "the daemon"))  # for messages
        self.pending: dict[int, _Pending] = {}  # item key -> what a new call would resend, in send order
        self.in_flight_bytes = 0
        self._seq = 0  # items submitted so far
        self._chunks: dict[int, memoryview] = {}  # chunk key -> its encoded field as sent (head + rows)
        self._released: deque[tuple[int, int]] = deque()  # (items submitted before, chunk key) still kept
        self.batch: list | None = None  # pieces of the next message (bytes, or views of column buffers)
        self.batch_bytes = 0
        self._batch_chunks: list[tuple[int, int, int]] = []  # (chunk key, offset in the batch, length)
        self._batch_items: list[tuple[int, bytes, int, float]] = []  # (key, encoded item, chunk bytes, created at)
        self._batch_releases: list[int] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # the current call's requests
        self._first_queue = True  # the first call takes the requests queued before it opened
        self._call: Any = None
        self._in_call = False
        self._sender_idle = False  # the current call's sender has nothing to write: the batch goes at once
        self._sender_waiting = False  # the sender waits for the next put (woken through the loop)
        self.error: BaseException | None = None  # a non-transient failure, for the writer's next call
        self.lost = 0  # items the failed call took with it
        self.failed_keys: list[int] = []  # items given up after the reconnect timeout
        self._outage_since: float | None = None
        self._wanted = False  # a request waits for a call (after a non-transient failure)
        self._closing = False
        self.done = False
        # Every message is a fresh multi-MiB bytes object (the batch joined): keep freed ones in the heap
        # so the next is not faulted in (and zeroed) page by page. Measured +3-4 % writer throughput.
        tune_allocator()
        self._wake = asyncio.Event()  # the sender has requests to write (set from any thread via the loop)
        self._nudge = asyncio.Event()  # the driver: closing, or a new call wanted
        self._finished = threading.Event()
        self._in_call = True  # the first call is being opened
        self._driver = aio_loop.submit(self._drive())

    # ------------------------------------------------------------ the seam --
    def send_item(self, chunks: list[NewChunk], key: int, item: bytes, releases: Sequence[int] = ()) -> None:
        """Hand one encoded item to the transport: its new chunks, then the item (and chunk keys to release).

        Chunks stay views of the column buffers until the batch is joined into
        one message; the item is an encoded ``InsertStreamRequest.items`` field
        appended after them (concatenated messages merge).
        """
        nbytes = sum(len(c.head) + c.data.nbytes for c in chunks)
        with self._cond:
            start = 0
            remaining = nbytes
            # Chunks beyond one request's worth go first, in requests of their own.
            while remaining > MAX_REQUEST_BYTES and len(chunks) - start > 1:
                size = 0
                group = start
                while len(chunks) - group > 1 and (group == start or size + len(chunks[group].head)
                                                   + chunks[group].data.nbytes <= MAX_REQUEST_BYTES):
                    size += len(chunks[group].head) + chunks[group].data.nbytes
                    group += 1
                self._reserve(size)
                self._add_chunks(chunks[start:group])
                self._submit()
                remaining -= size
                start = group
            tail = encode_release_keys(releases)
            self._reserve(remaining + len(item) + len(tail))
            self._add_chunks(chunks[start:])
            self.batch.append(item)
            self._batch_items.append((key, item, nbytes, time.monotonic()))
            if releases:
                self.batch.append(tail)
                self._batch_releases.extend(releases)
            self.batch_bytes += len(item) + len(tail)
            self.in_flight_bytes += nbytes
            if self.batch_bytes >= BATCH_BYTES or (self._sender_idle and not self.pending):
                self._submit()

    def send_releases(self, keys: Sequence[int]) -> None:
        """Release chunks, and send whatever waits in the batch."""
        with self._cond:
            if keys:
                tail = encode_release_keys(keys)
                self._reserve(len(tail))
                self.batch.append(tail)
                self.batch_bytes += len(tail)
                self._batch_releases.extend(keys)
            self._submit()

    def release_views(self, start: int, end: int) -> None:
        """Send the batch if it views bytes in [start, end) (a column buffer about to be overwritten)."""
        with self._cond:
            for piece in self.batch or ():
                if type(piece) is memoryview:
                    address = piece.obj.ctypes.data
                    if address < end and address + piece.nbytes > start:
                        self._submit()
                        return

    # ------------------------------------------------------------ batches --
    def _reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more in the batch (sending a full one first); ``batch_bytes`` counts them."""
        if self.batch is not None and self.batch_bytes + nbytes > MAX_REQUEST_BYTES:
            self._submit()
        if self.batch is None:
            self.batch = []
            self.batch_bytes = 0

    def _add_chunks(self, chunks: Sequence[NewChunk]) -> None:
        batch = self.batch
        offset = self.batch_bytes
        for chunk in chunks:
            length = len(chunk.head) + chunk.data.nbytes
            self._batch_chunks.append((chunk.key, offset, length))
            batch += (chunk.head, chunk.data)
            offset += length
        self.batch_bytes = offset

    def _submit(self) -> None:
        """Join the batch into one message (copying the column views), keep what a resend needs, queue it."""
        batch, self.batch = self.batch, None
        if not batch:
            return
        message = b"".join(batch)
        whole = memoryview(message)
        for key, offset, length in self._batch_chunks:
            self._chunks[key] = whole[offset:offset + length]
        for key, item, nbytes, created_at in self._batch_items:
            self.pending[key] = _Pending(self._seq, item, nbytes, created_at)
            self._seq += 1
        for key in self._batch_releases:
            self._released.append((self._seq, key))
        self._batch_chunks, self._batch_items, self._batch_releases = [], [], []
        self._sender_idle = False
        self._queue.put(message)
        self._wake_sender_locked()

    def _wake_sender_locked(self) -> None:
        """Wake the sender if it waits for the next request (under the lock)."""
        if self._sender_waiting:
            self._sender_waiting = False
            aio_loop.call_soon(self._wake.set)

    def _take_batch(self, requests: queue.SimpleQueue) -> Any:
        """The next request of the call writing ``requests``: the batch if it is that call's turn, else None."""
        with self._cond:
            if requests is not self._queue:
                return None
            if self.batch and not self.pending:
                self._submit()
                try:
                    return requests.get_nowait()
                except queue.Empty:
                    return None
            self._sender_idle = True  # a batch behind unacknowledged items goes with their acknowledgement
            return None

    def _nothing_queued(self, requests: queue.SimpleQueue) -> bool:
        """Whether ``requests`` is empty; if so the sender waits to be woken by the next put (under the lock)."""
        with self._cond:
            empty = requests.empty()
            self._sender_waiting = empty
            return empty

    async def _send_requests(self, call: Any, requests: queue.SimpleQueue) -> None:
        """Write the call's requests as they come (the batch whenever idle); half-close at the end marker."""
        try:
            while True:
                self._wake.clear()
                try:
                    request = requests.get_nowait()
                except queue.Empty:
                    request = self._take_batch(requests)
                    if request is None:
                        if self._nothing_queued(requests):
                            await self._wake.wait()
                        continue
                if request is None:
                    await call.done_writing()
                    return
                await call.write(request)
        except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError):
            return  # the call ended: its reader reports how
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the loop is stopping

    # ------------------------------------------------------------- calls --
    async def _drive(self) -> None:
        """Open calls and read their acknowledgements; after a transient end, wait for the daemon, open a new
        call and resend. Runs on the process's loop thread."""
        failures = 0
        try:
            while True:
                with self._cond:
                    if self._closing and not self._first_queue:
                        return
                    try:
                        call, requests = self._open_locked()
                    except (ValueError, RuntimeError) as e:  # the client's channel was closed
                        self._fail_call_locked(ServiceError(f"cannot open the insert stream: {e}"))
                        return
                sender = asyncio.ensure_future(self._send_requests(call, requests))
                error = await self._read_acks(call)
                with self._cond:
                    self._in_call = False
                    requests.put(None)  # ends the call's sender
                    self._sender_idle = self._sender_waiting = False
                    self._wake.set()
                    if self._closing:
                        return
                    code = error.code() if isinstance(error, grpc.RpcError) else None
                    if error is None or code in _TRANSIENT:
                        if self._outage_since is None:
                            self._outage_since = time.monotonic()
                            log.warning("insert stream to %s lost (%s); %d items unacknowledged: reconnecting, "
                                        "then resending them", self.address, describe_error(error),
                                        len(self.pending))
                    else:
                        self._fail_call_locked(error)
                        failures = -1
                await asyncio.gather(sender, return_exceptions=True)
                if failures == -1:
                    while True:
                        self._nudge.clear()
                        with self._cond:
                            if self._wanted or self._closing:
                                break
                        await self._nudge.wait()
                failures += 1
                if failures and not await self._await_daemon(min(_MAX_BACKOFF_S,
                                                                 _MIN_BACKOFF_S * 2 ** (failures - 1))):
                    return
        finally:
            with self._cond:
                self.done = True
                self._in_call = False
                self._cond.notify_all()
            self._route.close()
            self._finished.set()

    def _open_locked(self) -> tuple[Any, queue.SimpleQueue]:
        """A new call whose first requests resend what the server must hold (on the loop, under the lock)."""
        if self._first_queue:  # the first call: what was queued before it opened
            requests = self._queue
            self._first_queue = False
        else:
            requests = queue.SimpleQueue()
            self._queue = requests
            # Items sent before may be in the table already (inserted, the acknowledgement lost): marked as
            # resent, the table leaves an existing key as it is.
            pieces = list(self._chunks.values()) + [mark_resend(p.item) for p in self.pending.values()]
            kept = [key for _, key in self._released]
            if kept:
                pieces.append(encode_release_keys(kept))
            message: list = []
            size = 0
            for piece in pieces:
                if message and size + len(piece) > MAX_REQUEST_BYTES:
                    requests.put(b"".join(message))
                    message, size = [], 0
                message.append(piece)
                size += len(piece)
            if message:
                requests.put(b"".join(message))
        self._wanted = False
        self._sender_idle = False
        # Fail-fast: a call to a daemon that is away fails at once, before it sends anything, and the
        # driver tries again; so nothing queued here goes out after its items were given up. After an
        # outage the writer reconnects to the daemon itself: a restarted daemon's workers listen on other ports.
        if self._calls_opened and self._route.target is not None:
            self._route.close()
            self._route = _Route(self._client, use_ingest=False)
            self._watch = self._watch_for(self._route.watch_channel)
        self._resent = len(self.pending) if self._outage_since is not None else 0
        self._calls_opened += 1
        call = self._route.open()
        self._call = call
        self._in_call = True
        return call, requests

    async def _read_acks(self, call: Any) -> BaseException | None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return None
                with self._cond:
                    pending = self.pending
                    for key in response.keys:
                        entry = pending.pop(key, None)
                        if entry is not None:
                            self.in_flight_bytes -= entry.nbytes
                    self._last_ack_at = time.monotonic()
                    if self._outage_since is not None:
                        log.info("insert stream to %s back after %.1f s; %d unacknowledged items resent",
                                 self.address, self._last_ack_at - self._outage_since, self._resent)
                    self._outage_since = None
                    self._drop_released_locked()
                    if self.batch and not pending and self._sender_idle:
                        self._submit()  # the items created while these were on their way
                    self._cond.notify_all()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the loop is stopping
            return _CallCancelled()
        except BaseException as e:  # noqa: BLE001 - an RpcError, or anything else: reported, never lost
            return e

    def _drop_released_locked(self) -> None:
        """Forget released chunks that no unacknowledged item uses."""
        oldest = next(iter(self.pending.values())).seq if self.pending else self._seq
        released = self._released
        while released and released[0][0] <= oldest:
            self._chunks.pop(released.popleft()[1], None)

    def _watch_for(self, channel: Any) -> DaemonWatch | None:
        """A watch of the daemon behind ``channel`` bounded by the reconnect timeout (None: no channel to probe)."""
        if channel is None:
            return None
        return DaemonWatch(channel, self._reconnect_timeout_s)

    def _check_answers_locked(self) -> None:
        """Cancel the call when its daemon answered nothing (acknowledgements or probes) for the reconnect
        timeout while items wait; the call's thread then gives up the items that are due (see ``_expire_locked``)."""
        call = self._call
        if not self._in_call or not self.pending or self._watch is None or call is None or call is self._silent_call:
            return
        quiet_since = max(self._last_ack_at, next(iter(self.pending.values())).created_at)
        if not self._watch.away(quiet_since):
            return
        if self._outage_since is None:
            self._outage_since = quiet_since
        log.warning("insert stream to %s: the daemon answered nothing for %g s (neither acknowledgements nor "
                    "ServerInfo calls); giving up %d unacknowledged items", self.address, self._reconnect_timeout_s,
                    len(self.pending))
        self._silent_call = call  # cancelled once; its driver ends it, then gives the due items up
        aio_loop.call_soon(call.cancel)

    def _recheck_in_locked(self) -> float | None:
        """How long a waiter may sleep (None: until notified): polls during an outage (items fall due), else
        until the daemon's watch would have something to say about the open call."""
        if self._outage_since is not None or not self._in_call or not self.pending:
            return _POLL_S
        if self._watch is None:
            return None
        return self._watch.recheck_in(max(self._last_ack_at, next(iter(self.pending.values())).created_at))

    def _fail_call_locked(self, error: BaseException) -> None:
        """A non-transient end: the writer's next call raises it; its unacknowledged items are lost."""
        self.error = error
        self.lost += len(self.pending)
        self.pending.clear()
        self.in_flight_bytes = sum(item[2] for item in self._batch_items)
        self._drop_released_locked()
        self._cond.notify_all()

    async def _await_daemon(self, backoff: float) -> bool:
        """Wait ``backoff`` before the next call (giving up items that are due); False when closing."""
        deadline = time.monotonic() + backoff
        while True:
            self._nudge.clear()
            with self._cond:
                self._expire_locked()
                if self._closing:
                    return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            try:
                await asyncio.wait_for(self._nudge.wait(), min(remaining, _POLL_S))
            except TimeoutError:
                pass

    def _expire_locked(self) -> None:
        """Give up the items unacknowledged for the reconnect timeout while the daemon has been away as long.

        Only between calls: an open call may still deliver them.
        """
        if self._outage_since is None or self._in_call:
            return
        limit = time.monotonic() - self._reconnect_timeout_s
        if self._outage_since > limit:
            return
        self._submit()  # items in the batch may be due too (their chunks are kept for later items)
        expired = []
        for key, entry in self.pending.items():
            if entry.created_at > limit:
                break  # created in order: the rest are younger
            expired.append(key)
        if not expired:
            return
        for key in expired:
            self.in_flight_bytes -= self.pending.pop(key).nbytes
        self.failed_keys.extend(expired)
        self._drop_released_locked()
        self._cond.notify_all()

    # ------------------------------------------------------------ writers --
    @property
    def _raw(self) -> bool:
        """Whether requests go out as the hand-encoded bytes (on a channel) rather than parsed messages."""
        return self._route.raw

    @property
    def in_flight(self) -> int:
        return len(self.pending) + len(self._batch_items)

    def take_failure(self) -> tuple[BaseException | None, int, list[int]]:
        """(the non-transient error, items it lost, keys given up) since the last call; clears them."""
        with self._cond:
            self._check_answers_locked()
            self._expire_locked()
            error, lost, failed = self.error, self.lost, self.failed_keys
            self.error, self.lost, self.failed_keys = None, 0, []
            if error is not None:
                self._wanted = True  # the next request gets a new call
                self._cond.notify_all()
                aio_loop.call_soon(self._nudge.set)
            return error, lost, failed

    def wait(self, max_items: int, max_bytes: int, deadline: float | None) -> bool:
        """Block until at most max_items (and max_bytes) are in flight; False on timeout.

        Returns True early when the stream failed, gave items up or ended (the caller checks).
        """
        with self._cond:
            if self.in_flight > max_items or (self.in_flight and self.in_flight_bytes > max_bytes):
                self._submit()  # what we wait for may sit in the batch (acks only lower the counts)
            while len(self.pending) > max_items or (self.pending and self.in_flight_bytes > max_bytes):
                if self.done or self.error is not None or self.failed_keys:
                    return True
                self._check_answers_locked()
                self._expire_locked()
                if self.failed_keys:
                    return True
                timeout = self._recheck_in_locked()
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    timeout = remaining if timeout is None else min(timeout, remaining)
                self._cond.wait(timeout)
            return True

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Half-close (the server finishes what it got); cancel if it has not finished within ``timeout``."""
        with self._cond:
            self._submit()
            self._closing = True  # no reconnecting from here on
            self._queue.put(None)
            self._cond.notify_all()
        self._wake_driver()
        if not self._finished.wait(timeout):
            self._cancel()
            self._finished.wait(timeout)

    def abort(self) -> None:
        """Cancel at once (when the writer is dropped); once only.

        A writer dropped at interpreter exit is aborted twice (by its finalizer at
        exit, then by ``__del__``), and gRPC calls made while the interpreter
        finalizes can block forever.
        """
        with self._cond:
            if self._closing:
                return  # aborted already, or closed
            self._closing = True
            self.batch = None
            self._queue.put(None)
            self._cond.notify_all()
        self._wake_driver()
        self._cancel()

    def _wake_driver(self) -> None:
        def wake() -> None:
            self._wake.set()
            self._nudge.set()

        aio_loop.call_soon(wake)

    def _cancel(self) -> None:
        """Cancel the current call on the loop; waits (briefly) until it did, unless the loop is gone."""
        call = self._call
        if call is None:
            return
        done: concurrent.futures.Future = concurrent.futures.Future()

        def cancel() -> None:
            try:
                call.cancel()
            finally:
                done.set_result(None)

        aio_loop.call_soon(cancel)
        if aio_loop.alive() and not aio_loop.in_loop():
            try:
                done.result(_CANCEL_WAIT_S)
            except concurrent.futures.TimeoutError:
                pass


def describe_error(error: BaseException | None) -> str:
    """A failed call in words for a log line: its status and details, not gRPC's object dump."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return f"{error.code().name}: {error.details()}"
    return "the daemon ended the stream" if error is None else str(error)


def close_stream(stream: InsertStream | None) -> None:
    if stream is not None and not stream.done:
        stream.abort()
