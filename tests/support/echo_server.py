"""A tiny real gRPC server on loopback answering every ReplayService call, and per-method raw calls."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc import aio

from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_server.rpc.event_loop import LoopThread

REPLAY = pb.DESCRIPTOR.services_by_name["ReplayService"]
CALL_TIMEOUT_S = 10.0


def replay_methods() -> list[str]:
    return [m.name for m in REPLAY.methods]


def call_method(channel: grpc.Channel, name: str, metadata=None) -> grpc.StatusCode:
    """Call ReplayService.<name> with an empty request; the status code it ends with."""
    method = REPLAY.methods_by_name[name]
    path = f"/{REPLAY.full_name}/{name}"
    request_cls = getattr(pb, method.input_type.name)
    response_cls = getattr(pb, method.output_type.name)
    kwargs = {"request_serializer": request_cls.SerializeToString, "response_deserializer": response_cls.FromString}
    request = request_cls()
    try:
        if method.client_streaming and method.server_streaming:
            call = channel.stream_stream(path, **kwargs)
            list(call(iter([request]), timeout=CALL_TIMEOUT_S, metadata=metadata))
        elif method.client_streaming:
            channel.stream_unary(path, **kwargs)(iter([request]), timeout=CALL_TIMEOUT_S, metadata=metadata)
        elif method.server_streaming:
            list(channel.unary_stream(path, **kwargs)(request, timeout=CALL_TIMEOUT_S, metadata=metadata))
        else:
            channel.unary_unary(path, **kwargs)(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class EchoReplay(pb_grpc.ReplayServiceServicer):
    """Answers every ReplayService call with an empty response (streams: one)."""

    def __getattribute__(self, name: str):
        method = REPLAY.methods_by_name.get(name)
        if method is None:
            return super().__getattribute__(name)
        response = getattr(pb, method.output_type.name)

        if method.server_streaming:
            def stream(request, context) -> Iterator:
                if method.client_streaming:
                    for _ in request:
                        pass
                yield response()
            return stream

        def unary(request, context):
            if method.client_streaming:
                for _ in request:
                    pass
            return response()
        return unary


class AioServer:
    """A grpc.aio server on its own event loop thread (as the daemon runs one); ``stop(grace)`` ends both."""

    def __init__(self, interceptors, credentials, add) -> None:
        self.loop = LoopThread("test-aio-server")

        async def build() -> int:
            server = aio.server(futures.ThreadPoolExecutor(8), interceptors=list(interceptors))
            pb_grpc.add_ReplayServiceServicer_to_server(EchoReplay(), server)
            if add is not None:
                add(server)
            if credentials is None:
                port = server.add_insecure_port("127.0.0.1:0")
            else:
                port = server.add_secure_port("127.0.0.1:0", credentials)
            await server.start()
            self.server = server
            return port

        self.port = self.loop.run(build(), timeout=30)

    def stop(self, grace: float | None = None) -> None:
        self.loop.run(self.server.stop(grace), timeout=30)
        self.loop.stop()


def start_server(interceptors=(), credentials=None, add=None) -> tuple[AioServer, int]:
    """A real grpc.aio server on loopback serving EchoReplay (plus whatever ``add(server)`` registers, on its loop)."""
    server = AioServer(interceptors, credentials, add)
    return server, server.port
