"""An ingest worker: a process of its own that serves InsertStream for network actors.

The daemon starts ``[ingest] workers`` of them (``gear_server.ingest.worker_pool``).
Each listens on its own TCP port (advertised in ``ServerInfoResponse.ingest_ports``)
and does what the daemon's InsertStream would do with the bytes: parses the
requests, checks the items, and writes their rows straight into the table's
shared-memory segment through the insert plane (``gear_contract.slot_writer``),
committing them over the daemon's local socket. The daemon keeps the one index
(selection, rate limiters, leases); the bytes never pass through its
interpreter, so N workers use N cores. An item the insert plane cannot take
(a table still learning its layout, an item longer than its slots) and a
writer's resent item (``PrioritizedItem.resend``: a key the table holds stays
as it is, which a commit cannot say) are forwarded to the daemon's own
InsertStream, after the request's earlier items are committed (order kept).

The worker serves on grpc.aio, as the daemon does: an open stream is a task on
the worker's event loop, so thousands of idle writers cost memory, not threads.
What blocks (copying rows into the segment, waiting for their commit, which
the rate limiter may hold) runs as a pool job with a ``SlotWriter`` lent for
that request (idle writers are closed, their reservations given back); a
stream between requests holds neither a thread nor a writer. Each table has
its own share of the pool (``--threads`` jobs at once; the others wait holding
no thread), so streams a table's rate limiter holds never keep another
table's items waiting. The
daemon's interceptors apply unchanged: the bearer token (``[auth]``), and
``CallGuard`` (``[limits] max_streams``: RESOURCE_EXHAUSTED naming the key;
unparsable bytes: INVALID_ARGUMENT). Chunk bytes a stream holds count against
``[limits] max_stream_buffer_bytes`` and, per worker process,
``max_buffered_bytes``.

Acknowledgements, errors and back-pressure are InsertStream's: a request's keys
are acknowledged once its items are committed (after the rate limiter let them
in); a bad item ends the stream with INVALID_ARGUMENT; an error of the daemon
ends it with the daemon's status (keys committed before it are acknowledged).
A stream's requests are read ahead (``READ_AHEAD_REQUESTS``) while its earlier
items commit, and those that came meanwhile are written and committed as one
batch: a network actor's items are not each a commit round trip.

Run as ``python -m gear_server.ingest.worker_process --daemon unix:PATH --bind HOST``; it
prints ``PORT <n>`` once it serves and exits on SIGTERM or when its parent
daemon goes away. Security settings (the daemon's ``[auth]``) come as JSON in
``GEAR_INGEST_AUTH``, limits (``[limits]``) in ``GEAR_INGEST_LIMITS``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

import grpc
import numpy as np
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.slot_writer import SlotWriter
from gear_server.errors import CallCancelled
from gear_server.ops.auth import AuthSettings
from gear_server.rpc.event_loop import new_event_loop
from gear_server.rpc.insert_requests import (
    INSERT_STREAM_METHOD,
    SERVICE_NAME,
    Chunk,
    build_item,
    receive_chunks,
    serialize,
)
from gear_server.rpc.interceptors import CallGuard
from gear_server.rpc.limits import ByteBudget, LimitSettings
from gear_server.rpc.ports import GRPC_OPTIONS, bind
from gear_server.rpc.statuses import RefusalLog, abort_for, status_of
from gear_server.table.items import BadRequest, PreparedItem

log = logging.getLogger("gear_server.ingest.worker_process")

ENV_AUTH = "GEAR_INGEST_AUTH"
ENV_LIMITS = "GEAR_INGEST_LIMITS"
# Pool jobs (copying rows into a table's segment, waiting for their commits) of one table at once. A job
# waits as long as the table's rate limiter holds its commits (or reservations queued behind them), so
# each table has its own share of the pool: one its limiter holds never keeps another's items waiting.
DEFAULT_THREADS = 8
# Tables whose jobs may hold their whole share at once (the pool has DEFAULT_THREADS * this many threads,
# started as needed).
TABLES_AT_ONCE = 8
# A pooled SlotWriter unused this long is closed: the table gets its reserved slots back.
WRITER_IDLE_S = 5.0
READ_AHEAD_REQUESTS = 16  # requests a stream reads while its earlier items are written and committed
READ_AHEAD_BYTES = 4 << 20  # ... and their bytes (one request always, however large)

_Built = tuple[pb.PrioritizedItem, PreparedItem]


class _Written:
    """What one pool job put through the insert plane for a request (its caller may leave meanwhile)."""

    def __init__(self) -> None:
        self.keys: list[int] = []  # written into slots, in order
        self.committed: list[int] = []
        self.error: BaseException | None = None
        self.writer: SlotWriter | None = None  # lent to the job
        self.next_table = False  # it stopped where another table's items start (not to be forwarded)
        self.abandoned = False

    def abandon(self) -> None:
        """The caller left: end the job's writer so that its waits return (the daemon drops its commits)."""
        self.abandoned = True
        writer = self.writer
        if writer is not None:
            writer.abort()


def forward_request(item: pb.PrioritizedItem, columns: list[list[np.ndarray]]) -> pb.InsertStreamRequest:
    """One self-contained InsertStreamRequest for an item (a chunk per column; its resend mark kept)."""
    request = pb.InsertStreamRequest()
    out = request.items.add(key=item.key, table=item.table, priority=item.priority, resend=item.resend)
    out.structure.CopyFrom(item.structure)
    for c, (pieces, column) in enumerate(zip(columns, item.columns, strict=True)):
        data = np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces)
        request.chunks.add(chunk_key=c + 1, data=pb.Tensor(dtype=data.dtype.str, shape=list(data.shape),
                                                           data=data.tobytes()))
        out.columns.add(squeeze=column.squeeze).slices.add(chunk_key=c + 1, offset=0, length=data.shape[0])
    return request


class WriterPool:
    """SlotWriters on the daemon's insert plane, lent to one request at a time (thread safe).

    The most recently used is lent first, so a steady load keeps a few writers
    warm; one idle for ``idle_s`` is closed (``close_idle``), giving its
    reserved slots back to the table. A writer that failed is dropped.
    """

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None,
                 idle_s: float = WRITER_IDLE_S):
        self._channel = channel
        self._metadata = metadata
        self.idle_s = float(idle_s)
        self._lock = threading.Lock()
        self._idle: list[tuple[SlotWriter, float]] = []  # (writer, when it came back), oldest first
        self._lent: set[SlotWriter] = set()
        self._closed = False

    def take(self) -> SlotWriter:
        """An idle writer, or a new one (opening it waits for the daemon's answer)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the ingest worker is stopping")
            while self._idle:
                writer, _ = self._idle.pop()
                if writer.error is None and not writer.done:
                    self._lent.add(writer)
                    return writer
                writer.abort()
        writer = SlotWriter(self._channel, metadata=self._metadata)
        with self._lock:
            if not self._closed:
                self._lent.add(writer)
                return writer
        writer.abort()
        raise RuntimeError("the ingest worker is stopping")

    def give(self, writer: SlotWriter) -> None:
        """A writer back after a request (never blocks); one that failed or still has items uncommitted is
        ended (the daemon gives its reservations back when the stream ends)."""
        with self._lock:
            self._lent.discard(writer)
            if not (self._closed or writer.error is not None or writer.done or writer.in_flight):
                self._idle.append((writer, time.monotonic()))
                return
        writer.abort()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close_idle(self, now: float | None = None) -> int:
        """Close the writers idle for ``idle_s`` or more; how many were closed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [w for w, since in self._idle if now - since >= self.idle_s]
            self._idle = [(w, since) for w, since in self._idle if now - since < self.idle_s]
        for writer in expired:
            writer.close()
        return len(expired)

    def close(self) -> None:
        """Close the idle writers and end the lent ones (their requests fail: the worker is stopping)."""
        with self._lock:
            self._closed = True
            writers, self._idle = [w for w, _ in self._idle], []
            lent = list(self._lent)
        for writer in lent:
            writer.abort()
        for writer in writers:
            writer.close()


@dataclass
class _Turn:
    """A table's share of the pool: ``threads`` jobs at once, the rest wait holding no thread."""

    semaphore: asyncio.Semaphore
    users: int = 0  # jobs running or waiting (the entry goes with the last)


class IngestService:
    """InsertStream over the insert plane of the daemon at ``daemon_address`` (on the worker's event loop).

    ``start()`` on the loop before serving; ``close()`` after the server stopped.
    """

    def __init__(self, daemon_address: str, *, token: str | None = None, limits: LimitSettings | None = None,
                 threads: int = DEFAULT_THREADS, writer_idle_s: float = WRITER_IDLE_S):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.daemon_address = daemon_address
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.writers = WriterPool(grpc.insecure_channel(daemon_address, options=CHANNEL_OPTIONS), self.metadata,
                                  writer_idle_s)
        self.threads = int(threads)
        self.executor = futures.ThreadPoolExecutor(max_workers=threads * TABLES_AT_ONCE,
                                                   thread_name_prefix="gear-ingest")
        self._turns: dict[str, _Turn] = {}  # tables with pool jobs running or waiting
        self.buffers = ByteBudget(limits or LimitSettings())
        self.refusals = RefusalLog(log)
        self._channel: aio.Channel | None = None
        self._forward = None
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        """The forwarding channel and the task closing idle writers (on the serving loop)."""
        self._channel = aio.insecure_channel(self.daemon_address, options=CHANNEL_OPTIONS)
        self._forward = self._channel.stream_stream(INSERT_STREAM_METHOD, request_serializer=serialize,
                                                    response_deserializer=pb.InsertStreamResponse.FromString)
        self._reaper = asyncio.get_running_loop().create_task(self._close_idle_writers())

    async def close(self) -> None:
        """Stop closing idle writers, close the forwarding channel and every writer (lent ones are ended)."""
        if self._reaper is not None:
            self._reaper.cancel()
        if self._channel is not None:
            await self._channel.close()
        await asyncio.get_running_loop().run_in_executor(None, self.writers.close)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _close_idle_writers(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.writers.idle_s / 2))
            if self.writers.idle():
                await loop.run_in_executor(None, self.writers.close_idle)

    def add_to_server(self, server: aio.Server) -> None:
        handler = grpc.stream_stream_rpc_method_handler(
            self.InsertStream, request_deserializer=pb.InsertStreamRequest.FromString, response_serializer=serialize)
        handlers = grpc.method_handlers_generic_handler(SERVICE_NAME, {"InsertStream": handler})
        server.add_generic_rpc_handlers((handlers,))

    # ------------------------------------------------------------------ the RPC
    async def InsertStream(self, request_iterator: AsyncIterator[pb.InsertStreamRequest],  # noqa: N802 (gRPC name)
                           context: aio.ServicerContext) -> AsyncIterator[pb.InsertStreamResponse]:
        """Requests read ahead (``READ_AHEAD_REQUESTS``) while earlier items commit; what came meanwhile is
        written and committed as one batch (one pool job, one wait, one acknowledgement), so a stream's
        items are not each a commit round trip and the daemon gets fewer, larger commits."""
        chunks: dict[int, Chunk] = {}
        held = self.buffers.stream()
        ahead = ReadAhead()
        reader = asyncio.ensure_future(ahead.read(request_iterator))
        n = -1
        try:
            ended = False
            while not ended:
                batch = await ahead.take_all()
                built: list[_Built] = []
                failure: BaseException | None = None
                for request in batch:
                    if request is STREAM_END:
                        ended = True
                        break
                    if isinstance(request, BaseException):  # reading failed: what came before still goes in
                        failure = request
                        break
                    n += 1
                    try:
                        receive_chunks(request, chunks, held)
                        built += [(item, build_item(item, chunks).validated()) for item in request.items]
                    except Exception as e:  # noqa: BLE001 (after the earlier items: the stream's status)
                        failure = e
                        break
                    for key in request.release_chunk_keys:  # the built items keep the rows they use
                        released = chunks.pop(key, None)
                        if released is not None:
                            held.give(released.nbytes)
                keys, error = await self._insert(built) if built else ([], None)
                if keys:
                    yield pb.InsertStreamResponse(keys=keys)
                if error is not None:
                    self.refusals.info("InsertStream insert refused: %s", error)
                    await _abort_like(error, context)
                if failure is not None:
                    if isinstance(failure, BadRequest):
                        self.refusals.info("InsertStream request %d refused: %s", n, failure)
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(failure))
                    if isinstance(failure, grpc.RpcError | asyncio.CancelledError):
                        raise failure
                    await abort_for(context, failure)
        finally:
            reader.cancel()
            held.close()

    async def _insert(self, built: list[_Built]) -> tuple[list[int], BaseException | None]:
        """A request's items in order: through the insert plane where they fit (a pool job per run of one
        table's items), the others and resends over the daemon's InsertStream. The keys committed, and the
        error that stopped them."""
        keys: list[int] = []
        start = 0
        while start < len(built):
            if not built[start][1].resend:
                written = await self._through_plane(built, start)
                keys += written.committed
                if written.error is not None:
                    return keys, written.error
                start += len(written.keys)
                if start == len(built):
                    break
                if written.next_table:
                    continue  # the next run is another table's: the plane may take it
            stop = start + 1  # this item, and the resends right after it: one call to the daemon
            while stop < len(built) and built[stop][1].resend:
                stop += 1
            committed, error = await self._forward_items(built[start:stop])
            keys += committed
            if error is not None:
                return keys, error
            start = stop
        return keys, None

    async def _through_plane(self, built: list[_Built], start: int) -> _Written:
        """One pool job (``_write``) in the turn of its table; a caller that leaves ends the job's writer."""
        table = built[start][0].table
        turn = self._turns.get(table)
        if turn is None:
            turn = self._turns[table] = _Turn(asyncio.Semaphore(self.threads))
        turn.users += 1
        written = _Written()
        try:
            async with turn.semaphore:
                await asyncio.wrap_future(self.executor.submit(self._write, written, built, start))
        except asyncio.CancelledError:
            written.abandon()
            raise
        finally:
            turn.users -= 1
            if not turn.users:
                del self._turns[table]
        return written

    def _write(self, written: _Written, built: list[_Built], start: int) -> None:
        """Items from ``start`` (one table's) written into reserved slots up to one the plane cannot take,
        then waited for until committed (on the pool, with a writer lent from the pool)."""
        try:
            writer = self.writers.take()
        except Exception as e:  # noqa: BLE001 (the daemon is away or refuses: the call's status)
            written.error = e
            return
        written.writer = writer
        try:
            if written.abandoned:
                raise CallCancelled("the InsertStream call ended")
            table = built[start][0].table
            for message, item in built[start:]:
                if message.table != table:
                    written.next_table = not item.resend
                    break
                if item.resend or not writer.fits(message.table, item.specs, item.lengths,
                                                  message.structure.SerializeToString()):
                    break
                writer.write(message.table, item.key, item.priority, item.pieces, item.lengths, item.episode_ids)
                written.keys.append(item.key)
            writer.wait(0)
            written.error = writer.error
        except Exception as e:  # noqa: BLE001 (reported as the call's status)
            written.error = e
        finally:
            written.writer = None
            if written.error is None:
                written.committed = written.keys
            else:  # read before the writer goes back: another job may take it at once
                uncommitted = set(writer.pending)
                written.committed = [k for k in written.keys if k not in uncommitted]
            if written.abandoned:
                writer.abort()
            self.writers.give(writer)

    async def _forward_items(self, run: list[_Built]) -> tuple[list[int], BaseException | None]:
        """Items inserted by the daemon's own InsertStream (one call); the keys it acknowledged."""
        call = self._forward(wait_for_ready=True, metadata=self.metadata)
        keys: list[int] = []
        try:
            for message, item in run:
                await call.write(forward_request(message, item.pieces))
            await call.done_writing()
            async for response in call:
                keys.extend(response.keys)
        except grpc.RpcError as e:
            return keys, e
        finally:
            if not call.done():
                call.cancel()
        return keys, None


STREAM_END = object()  # the client half-closed its stream


class ReadAhead:
    """A stream's requests read while its earlier items commit: at most ``READ_AHEAD_REQUESTS`` and
    ``READ_AHEAD_BYTES`` wait (one request always may, however large); past that the stream is not
    read, and gRPC's flow control holds the client. Memory per stream stays bounded as when each
    request was read only after the previous one's commit."""

    def __init__(self) -> None:
        self._waiting: deque = deque()
        self._bytes = 0
        self._ready = asyncio.Event()  # something to take
        self._room = asyncio.Event()  # room for the next request
        self._room.set()

    async def read(self, request_iterator: AsyncIterator[pb.InsertStreamRequest]) -> None:
        """Every request, then ``STREAM_END``, or the error that ended the reading (run as a task)."""
        try:
            async for request in request_iterator:
                await self._put(request, request.ByteSize())
            await self._put(STREAM_END, 0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the stream's handler
            await self._put(e, 0)

    async def _put(self, entry: object, nbytes: int) -> None:
        while self._waiting and (len(self._waiting) >= READ_AHEAD_REQUESTS
                                 or self._bytes + nbytes > READ_AHEAD_BYTES):
            self._room.clear()
            await self._room.wait()
        self._waiting.append(entry)
        self._bytes += nbytes
        self._ready.set()

    async def take_all(self) -> list:
        """Every request waiting, in order (waits for one)."""
        while not self._waiting:
            self._ready.clear()
            await self._ready.wait()
        taken = list(self._waiting)
        self._waiting.clear()
        self._bytes = 0
        self._room.set()
        return taken


async def _abort_like(error: BaseException, context: aio.ServicerContext) -> NoReturn:
    """End the call with the daemon's status (the actor sees what the daemon said), or the error's own."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        await context.abort(error.code(), error.details() or "")
    status = status_of(error)
    if status is not None:
        await context.abort(*status)
    log.warning("InsertStream failed: %r", error)
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"ingest worker: the daemon's insert plane failed: {error}")


def _watch_parent(parent: int) -> None:
    """Exit when the daemon that started this worker is gone (this process was re-parented)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(0)


async def serve(args: argparse.Namespace, auth: AuthSettings, limits: LimitSettings) -> int:
    """Serve until SIGTERM (or SIGINT); prints ``PORT <n>`` once serving. The exit code."""
    check = auth.token_check()
    service = IngestService(args.daemon, token=auth.load_token(), limits=limits, threads=args.threads)
    server = aio.server(options=GRPC_OPTIONS, interceptors=[*auth.interceptors(check=check), CallGuard(limits)])
    service.add_to_server(server)
    credentials = auth.server_credentials()
    port = bind(server, args.bind, args.port, credentials)
    if not port:
        print(f"cannot bind {args.bind}:{args.port}", file=sys.stderr, flush=True)
        return 1
    await service.start()
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"PORT {port}", flush=True)
    await stop.wait()
    await server.stop(0.5)
    await service.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gear ingest worker (started by gear-server)")
    parser.add_argument("--daemon", required=True, help="the daemon's local address, e.g. unix:/dev/shm/...sock")
    parser.add_argument("--bind", default="[::]", help="host to listen on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="pool jobs of one table at once: copying rows, waiting for their commits "
                             "(open streams need no thread)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ingest-worker %(levelname)s %(message)s")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="gear-ingest-parent", daemon=True).start()
    auth = AuthSettings(**json.loads(os.environ.pop(ENV_AUTH, "{}")))
    limits = LimitSettings(**json.loads(os.environ.pop(ENV_LIMITS, "{}")))
    loop = new_event_loop()
    try:
        return loop.run_until_complete(serve(args, auth, limits))
    finally:
        loop.close()


if __name__ == "__main__":
    exit_code = main()
    # Straight out: a pool thread may still wait on the daemon (it ends with this process), and the
    # interpreter's exit would join it.
    logging.shutdown()
    os._exit(exit_code)
