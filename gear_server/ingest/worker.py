"""An ingest worker: a process of its own that serves InsertStream for network actors.

The daemon starts ``[ingest] workers`` of them (``gear_server.ingest.workers``).
Each listens on its own TCP port (advertised in ``ServerInfoResponse.ingest_ports``)
and does what the daemon's InsertStream would do with the bytes: parses the
requests, checks the items, and writes their rows straight into the table's
shared-memory segment through the insert plane (``gear_contract.insert_plane``),
committing them over the daemon's local socket. The daemon keeps the one index
(selection, rate limiters, leases); the bytes never pass through its
interpreter, so N workers use N cores. An item the insert plane cannot take
(a table still learning its layout, or an item longer than its slots) is
forwarded to the daemon's own InsertStream, after the worker's earlier items
are committed (order kept).

Acknowledgements, errors and back-pressure are InsertStream's: a request's keys
are acknowledged once its items are committed (after the rate limiter let them
in); a bad item ends the stream with INVALID_ARGUMENT.

Run as ``python -m gear_server.ingest.worker --daemon unix:PATH --bind HOST``; it
prints ``PORT <n>`` once it serves and exits when its parent daemon goes away.
Security settings (the daemon's ``[auth]``) come as JSON in ``GEAR_INGEST_AUTH``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_contract.channel import CHANNEL_OPTIONS
from gear_contract.insert_plane import SlotWriter
from gear_server.auth import AuthSettings
from gear_server.errors import TableNotFoundError
from gear_server.items import BadRequest, tensor_to_array
from gear_server.service import SERVICE_NAME, _Chunk, _serialize, build_item

log = logging.getLogger("gear_server.ingest.worker")

ENV_AUTH = "GEAR_INGEST_AUTH"
# Items written but not yet committed before the worker reads the next request.
MAX_UNCOMMITTED_ITEMS = 64
_INSERT_STREAM = "/gear.v1.ReplayService/InsertStream"


def forward_request(item: pb.PrioritizedItem, columns: list[list[np.ndarray]]) -> pb.InsertStreamRequest:
    """One self-contained InsertStreamRequest for an item (a chunk per column)."""
    request = pb.InsertStreamRequest()
    out = request.items.add(key=item.key, table=item.table, priority=item.priority)
    out.structure.CopyFrom(item.structure)
    for c, (pieces, column) in enumerate(zip(columns, item.columns, strict=True)):
        data = np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces)
        request.chunks.add(chunk_key=c + 1, data=pb.Tensor(dtype=data.dtype.str, shape=list(data.shape),
                                                           data=data.tobytes()))
        out.columns.add(squeeze=column.squeeze).slices.add(chunk_key=c + 1, offset=0, length=data.shape[0])
    return request


class IngestService:
    """InsertStream over the insert plane of the daemon at ``daemon_channel``."""

    def __init__(self, daemon_channel: grpc.Channel, token: str | None = None):
        self.channel = daemon_channel
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._forward = daemon_channel.stream_stream(_INSERT_STREAM, request_serializer=_serialize,
                                                     response_deserializer=pb.InsertStreamResponse.FromString)

    def add_to_server(self, server: grpc.Server) -> None:
        handler = grpc.stream_stream_rpc_method_handler(
            self.InsertStream, request_deserializer=pb.InsertStreamRequest.FromString, response_serializer=_serialize)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"InsertStream": handler}),))

    def InsertStream(self, request_iterator: Iterator[pb.InsertStreamRequest],  # noqa: N802 (gRPC name)
                     context: grpc.ServicerContext) -> Iterator[pb.InsertStreamResponse]:
        chunks: dict[int, _Chunk] = {}
        writer: SlotWriter | None = None
        try:
            for request in request_iterator:
                try:
                    for chunk in request.chunks:
                        chunks[chunk.chunk_key] = _Chunk(
                            tensor_to_array(chunk.data, f"chunk {chunk.chunk_key}", min_rank=1), chunk.episode_id,
                            len(chunk.data.data))
                    built = [(item, build_item(item, chunks).validated()) for item in request.items]
                except BadRequest as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                if built and writer is None:
                    writer = SlotWriter(self.channel, metadata=self.metadata)
                keys = []
                for message, item in built:
                    structure = message.structure.SerializeToString()
                    if writer.fits(message.table, item.specs, item.lengths, structure):
                        writer.write(message.table, item.key, item.priority, item.pieces, item.lengths,
                                     item.episode_ids)
                    else:
                        self._drain(writer, 0, context)
                        self._insert_directly(message, item.pieces, context)
                    keys.append(item.key)
                for key in request.release_chunk_keys:
                    chunks.pop(key, None)
                if writer is not None:
                    self._drain(writer, 0, context)
                if keys:
                    yield pb.InsertStreamResponse(keys=keys)
        finally:
            if writer is not None:
                writer.close()

    @staticmethod
    def _drain(writer: SlotWriter, max_items: int, context: grpc.ServicerContext) -> None:
        writer.wait(max_items)
        if writer.error is not None:
            _abort_like(writer.error, context)

    def _insert_directly(self, message: pb.PrioritizedItem, pieces: list[list[np.ndarray]],
                         context: grpc.ServicerContext) -> None:
        """The daemon's own InsertStream for an item the insert plane cannot take."""
        try:
            for _ in self._forward(iter([forward_request(message, pieces)]), wait_for_ready=True,
                                   metadata=self.metadata):
                pass
        except grpc.RpcError as e:
            _abort_like(e, context)


def _abort_like(error: BaseException, context: grpc.ServicerContext) -> None:
    """End the call with the daemon's status (the actor sees what the daemon said)."""
    if isinstance(error, grpc.RpcError) and isinstance(error, grpc.Call):
        context.abort(error.code(), error.details() or "")
    if isinstance(error, TableNotFoundError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(error))
    context.abort(grpc.StatusCode.UNAVAILABLE, f"ingest worker: the daemon's insert plane failed: {error}")


def _watch_parent(parent: int, server: grpc.Server) -> None:
    """Stop when the daemon that started this worker is gone (re-parented)."""
    stop = threading.Event()
    while not stop.wait(0.5):
        if os.getppid() != parent:
            server.stop(0)
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gear ingest worker (started by gear-server)")
    parser.add_argument("--daemon", required=True, help="the daemon's local address, e.g. unix:/dev/shm/...sock")
    parser.add_argument("--bind", default="[::]", help="host to listen on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--threads", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ingest-worker %(levelname)s %(message)s")
    parent = os.getppid()
    auth = AuthSettings(**json.loads(os.environ.pop(ENV_AUTH, "{}")))
    channel = grpc.insecure_channel(args.daemon, options=CHANNEL_OPTIONS)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.threads, thread_name_prefix="gear-ingest"),
                         options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)], interceptors=auth.interceptors())
    IngestService(channel, auth.load_token()).add_to_server(server)
    credentials = auth.server_credentials()
    address = f"{args.bind}:{args.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not port and args.bind == "[::]":
        address = f"0.0.0.0:{args.port}"
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not port:
        print(f"cannot bind {address}", file=sys.stderr, flush=True)
        return 1
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0.5))
    threading.Thread(target=_watch_parent, args=(parent, server), daemon=True).start()
    print(f"PORT {port}", flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
