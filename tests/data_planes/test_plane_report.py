"""The daemon's start-up line: which data planes it offers and, for each one off, why."""

from __future__ import annotations

import logging
import os

import pytest

from gear_contract import rdma_verbs as verbs
from gear_contract._proto import replay_pb2 as pb
from gear_server.config import ConfigError, parse_config
from gear_server.daemon import Daemon
from gear_server.data_planes.offers import plane_report
from gear_server.data_planes.settings import DataPlaneSettings
from tests.support.plane_daemon import table_config


def test_the_report_names_offered_planes_best_first_and_why_the_others_are_off():
    on = plane_report(None)
    assert on.offered == ("shm", "rdma", "nixl", "stream", "inline") and on.off == {}
    off = plane_report("pyverbs missing", "no GPU: CuPy or a CUDA device is missing", "[data_planes] stream = false",
                       "NIXL not installed")
    assert off.offered == ("shm", "inline")
    assert off.line() == ("data planes offered: shm, inline; off: rdma (pyverbs missing), nixl (NIXL not installed), "
                          "stream ([data_planes] stream = false), gpu (no GPU: CuPy or a CUDA device is missing)")


def test_a_daemon_logs_its_planes_at_start(caplog):
    if verbs.unavailable_reason() is None:
        pytest.skip("pyverbs is importable here: the reason would be about devices")
    config = pb.ServerConfig(port=0, bind_address="127.0.0.1", instance_name=f"report{os.getpid()}",
                             tables=[table_config("t", 8)])
    with caplog.at_level(logging.INFO, logger="gear_server.daemon"), Daemon(config):
        pass
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data planes offered")]
    assert len(lines) == 1 and lines[0].startswith("data planes offered: shm, stream, inline; off: rdma (pyverbs ")


def test_data_plane_settings_parse_and_refuse_bad_values():
    base = {"tables": [{"name": "t", "sampler": "uniform", "remover": "fifo", "max_size": 4,
                        "rate_limiter": {"min_size": 1}}]}
    settings = parse_config({**base, "data_planes": {"max_sessions_per_peer": 16, "rdma_service_level": 3,
                                                     "rdma_traffic_class": 106, "rdma": False}})
    assert settings.data_planes == DataPlaneSettings(max_sessions_per_peer=16, rdma_service_level=3,
                                                     rdma_traffic_class=106, rdma=False)
    for bad, key in (({"rdma_service_level": 16}, "rdma_service_level"), ({"max_sessions_per_peer": 0},
                     "max_sessions_per_peer"), ({"rdma": "yes"}, "rdma"), ({"sessions": 1}, "unknown key"),
                     ({"stream": 1}, "stream"), ({"stream_connections": 17}, "stream_connections"),
                     ({"stream_advertise": ""}, "stream_advertise")):
        with pytest.raises(ConfigError, match=key):
            parse_config({**base, "data_planes": bad})


def test_the_operator_switches_nixl_off():
    from gear_server.data_planes.nixl_server import NixlServer

    server, why = NixlServer.open(DataPlaneSettings.from_toml({"nixl": False}))
    assert server is None and why == "turned off ([data_planes] nixl = false)"
    with pytest.raises(ValueError, match="nixl must be true or false"):
        DataPlaneSettings.from_toml({"nixl": "yes"})
