"""What a sampler can be pointed at: a Client, a channel, a stub or an address, as the stub and calls it uses."""

from __future__ import annotations

from typing import Any

import grpc

from gear_client.connection.channel import DaemonChannel
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc


def connect(target: Any) -> tuple[Any, Any, Any, DaemonChannel | None]:
    """(stub, raw sample call or None, owned channel or None, daemon channel or None) for a Client, a
    channel, a stub or an address. With a daemon channel, calls wait for the daemon at most its connect
    timeout (gear_client.connection.channel); otherwise they wait for it forever."""
    if hasattr(target, "_connect"):  # gear_client.Client
        _, stub, sample_call = target._connect()
        return stub, sample_call, None, target._daemon_channel()
    if isinstance(target, str):
        from gear_client.connection.auth import ChannelSecurity
        from gear_client.connection.channel import connect_timeout_option

        # An address alone: token, TLS and connect timeout come from the GEAR_* environment.
        daemon = DaemonChannel(target, ChannelSecurity.build(), connect_timeout_option(None))
        return daemon.stub, daemon.sample_call, daemon, daemon
    if isinstance(target, grpc.Channel):
        return pb_grpc.ReplayServiceStub(target), _raw_sample_call(target), None, None
    return target, None, None, None  # a stub


def _raw_sample_call(channel: grpc.Channel):
    return channel.unary_stream("/gear.v1.ReplayService/Sample",
                                request_serializer=pb.SampleRequest.SerializeToString, response_deserializer=None)
