"""Shared pieces of the operations tests: a tiny real gRPC server and per-method raw calls."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent import futures

import grpc

from gear_client._proto import replay_pb2 as pb
from gear_client._proto import replay_pb2_grpc as pb_grpc

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(interceptors=(), credentials=None, add=None) -> tuple[grpc.Server, int]:
    """A real gRPC server on loopback serving EchoReplay (plus whatever ``add(server)`` registers)."""
    server = grpc.server(futures.ThreadPoolExecutor(8), interceptors=list(interceptors))
    pb_grpc.add_ReplayServiceServicer_to_server(EchoReplay(), server)
    if add is not None:
        add(server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, port


# ------------------------------------------------------------------ tables ----

SHM_DIR = "/dev/shm"
OBS_ACT = pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs"], children=[pb.Structure(), pb.Structure()])
NO_LIMIT = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1, min_diff=-1.7976931348623157e308,
                                 max_diff=1.7976931348623157e308)


def table_config(name: str, sampler: pb.SelectorOptions, remover: pb.SelectorOptions, max_size: int = 50,
                 max_times_sampled: int = 0) -> pb.TableConfig:
    return pb.TableConfig(name=name, sampler=sampler, remover=remover, max_size=max_size, rate_limiter=NO_LIMIT,
                          max_times_sampled=max_times_sampled)


def make_item(key: int, priority: float, length: int, episode: int):
    """{'act': int64 scalar (squeezed), 'obs': float32 [length, 3]}; values encode the key."""
    import numpy as np

    from gear_server.table import ItemToInsert

    obs = np.arange(length * 3, dtype=np.float32).reshape(length, 3) + 1000 * key
    return ItemToInsert(key=key, priority=priority, structure=OBS_ACT, columns=[np.array(key, np.int64), obs],
                        squeeze=[True, False], episode_ids=frozenset({episode}))
