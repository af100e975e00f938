"""An in-process daemon whose data planes take test settings, and the table configs it serves."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

from gear_contract._proto import replay_pb2 as pb
from gear_server.config import DaemonSettings
from gear_server.daemon import Daemon
from gear_server.data_planes.manager import DataPlaneManager
from gear_server.data_planes.nixl_server import NixlServer
from gear_server.data_planes.settings import DataPlaneSettings
from gear_server.data_planes.stream_server import StreamServer, open_stream_server
from gear_server.ops.auth import AuthSettings

_instances = itertools.count()


def table_config(name: str = "t", max_size: int = 64, *, sampler: str = "uniform", remover: str = "fifo",
                 spare: int | None = None, max_times_sampled: int = 0,
                 rate_limiter: pb.RateLimiterOptions | None = None) -> pb.TableConfig:
    """A table's config; the rate limiter is MinSize(1) unless given."""
    if rate_limiter is None:
        rate_limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                             min_diff=-sys.float_info.max, max_diff=sys.float_info.max)
    return pb.TableConfig(name=name, max_size=max_size, max_times_sampled=max_times_sampled,
                          sampler=pb.SelectorOptions(**{sampler: True}), remover=pb.SelectorOptions(**{remover: True}),
                          rate_limiter=rate_limiter)


def queue_config(name: str, size: int = 32) -> pb.TableConfig:
    """What Table.queue configures: FIFO in and out, each item sampled once, a Queue limiter."""
    return table_config(name, size, sampler="fifo", remover="fifo", max_times_sampled=1,
                        rate_limiter=pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                                           min_diff=0.0, max_diff=float(size)))


class PlaneDaemon(Daemon):
    """A real daemon whose data-plane manager takes test settings (lease timeouts, an RDMA server, a stream
    server: ``stream=True`` or ``stream=DataPlaneSettings(...)`` opens the daemon's own; ``nixl=True`` its
    NIXL agent)."""

    def __init__(self, config: pb.ServerConfig | DaemonSettings, **manager_kwargs):
        settings = config if isinstance(config, DaemonSettings) else DaemonSettings.from_server_config(config)
        # Some of these daemons bind addresses other hosts reach (netns peers, every interface), without
        # credentials: the exposure check's opt-out, said explicitly (credentials given are kept).
        settings.auth = dataclasses.replace(settings.auth or AuthSettings(), allow_insecure=True)
        super().__init__(settings, seed=0)
        self.manager_kwargs = {"rdma": None, **manager_kwargs}
        self.manager: DataPlaneManager | None = None

    def build_data_planes(self) -> DataPlaneManager:
        kwargs = dict(self.manager_kwargs)
        stream = kwargs.pop("stream", None)
        if stream is not None and not isinstance(stream, StreamServer):  # True or [data_planes] settings
            settings = stream if isinstance(stream, DataPlaneSettings) else DataPlaneSettings()
            stream, kwargs["stream_off"] = open_stream_server(settings, self.config.bind_address or "[::]",
                                                              self.settings.auth)
        if kwargs.get("nixl") is True:
            kwargs["nixl"], kwargs["nixl_off"] = NixlServer.open(DataPlaneSettings())
        self.manager = DataPlaneManager(self.tables, self.host_id, self.calls, stream=stream, **kwargs)
        return self.manager

    def stop(self, grace: float = 1.0) -> None:
        if self.manager is not None:
            self.manager.shutdown()
        super().stop(grace)


def start_daemon(*tables: pb.TableConfig, bind: str = "localhost", **manager_kwargs) -> PlaneDaemon:
    config = pb.ServerConfig(port=0, bind_address=bind, instance_name=f"dptest{os.getpid()}x{next(_instances)}",
                             tables=list(tables) or [table_config()])
    daemon = PlaneDaemon(config, **manager_kwargs)
    daemon.start()
    return daemon
