"""Clients when the daemon is away: a clear error naming the address and the cause within the connect timeout.

Real daemon processes on loopback, a port nothing listens on, a name that does
not resolve, a wrong token, TLS on one side only, and a daemon that starts late.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent import futures

import grpc
import numpy as np
import pytest

import gear_client
from gear_client import errors
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_port
from tests.support.tables_toml import insert_items, tables_toml

TOKEN = "connect-test-token-0123456789"
SLACK_S = 4.0  # a call gives up within connect_timeout + this (one diagnosis probe, a loaded 2-core machine)


def _config(port: int = 0, extra: str = "") -> str:
    return tables_toml(f"conn{uuid.uuid4().hex[:8]}").replace("port = 0", f"port = {port}") + extra


@pytest.fixture
def daemon_factory(tmp_path):
    daemons: list[DaemonProcess] = []

    def start(config: str, name: str = "daemon") -> DaemonProcess:
        daemon = DaemonProcess(tmp_path, config, name=name)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        if daemon.process.poll() is None:
            daemon.kill()


def _raises_connect_error(call, cause: str, address: str, timeout: float) -> errors.ConnectError:
    start = time.monotonic()
    with pytest.raises(errors.ConnectError) as info:
        call()
    elapsed = time.monotonic() - start
    assert info.value.cause == cause, info.value
    assert address in str(info.value)
    assert elapsed < timeout + SLACK_S, f"took {elapsed:.1f} s"
    assert isinstance(info.value, RuntimeError)  # what Reverb code catches
    return info.value


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1", "[::1]", "dns:///localhost", "localhost:0",
                                     "localhost:99999"])
def test_an_address_without_a_port_is_refused(address):
    with pytest.raises(ValueError, match="port"):
        gear_client.Client(address)


def test_addresses_with_ports_and_unix_sockets_are_taken():
    for address in ("localhost:8000", "[::1]:8000", "dns:///localhost:8000", "ipv4:127.0.0.1:8000",
                    "unix:/tmp/gear.sock"):
        assert gear_client.Client(address).server_address == address


def test_a_port_with_nothing_listening_names_the_address_and_refused(caplog):
    address = f"127.0.0.1:{free_port()}"
    client = gear_client.Client(address, connect_timeout=1.0, data_planes=())
    caplog.set_level(logging.WARNING, logger="gear_client.connection.channel")
    error = _raises_connect_error(client.server_info, "refused", address, 1.0)
    assert "connection refused" in str(error) and "1 s" in str(error)
    assert any("waiting for the gear daemon at " + address in r.getMessage() for r in caplog.records)
    _raises_connect_error(lambda: client.trajectory_writer(1), "refused", address, 1.0)
    _raises_connect_error(lambda: next(client.sample("queue")), "refused", address, 1.0)
    _raises_connect_error(lambda: client.insert(np.zeros(2), {"queue": 1.0}), "refused", address, 1.0)
    _raises_connect_error(lambda: client.mutate_priorities("queue", {1: 1.0}), "refused", address, 1.0)
    # Over the shm/rdma negotiation too.
    planes = gear_client.Client(address, connect_timeout=1.0)
    _raises_connect_error(lambda: next(planes.sample("queue")), "refused", address, 1.0)


def test_the_dataset_and_the_env_var(monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("GEAR_CONNECT_TIMEOUT", "1.5")
    dataset = gear_client.TrajectoryDataset(address, "queue", batch_size=2, rate_limiter_timeout_ms=2000)
    try:
        _raises_connect_error(lambda: next(dataset), "refused", address, 1.5 + 1.0)  # + the producer's poll
    finally:
        dataset.close()
    _raises_connect_error(gear_client.Client(address).server_info, "refused", address, 1.5)
    monkeypatch.setenv("GEAR_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="GEAR_CONNECT_TIMEOUT"):
        gear_client.Client(address)
    with pytest.raises(ValueError, match="connect_timeout"):
        gear_client.Client(address, connect_timeout=0)


def test_server_info_timeout_shorter_than_the_connect_timeout_is_a_deadline():
    client = gear_client.Client(f"127.0.0.1:{free_port()}", connect_timeout=30)
    start = time.monotonic()
    with pytest.raises(errors.DeadlineExceededError, match="connection refused"):
        client.server_info(timeout=1)
    assert time.monotonic() - start < 1 + SLACK_S


def test_an_unresolvable_name():
    address = "gear-no-such-host.invalid:5000"
    _raises_connect_error(gear_client.Client(address, connect_timeout=1).server_info, "unresolvable", address, 1)


def test_a_wrong_or_missing_token_fails_at_once(daemon_factory, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    daemon = daemon_factory(_config(extra=f'\n[auth]\ntoken_file = "{token_file}"\n'))
    daemon.wait_ready()
    for token in ("not-the-token", None):
        client = gear_client.Client(daemon.address, token=token, connect_timeout=20, data_planes=())
        error = _raises_connect_error(client.server_info, "token", daemon.address, 0.0)
        assert ("no token" in str(error)) == (token is None)
        _raises_connect_error(lambda c=client: c.insert(np.zeros(2), {"queue": 1.0}), "token", daemon.address, 0.0)
        _raises_connect_error(lambda c=client: next(c.sample("queue")), "token", daemon.address, 0.0)
    good = gear_client.Client(daemon.address, token=TOKEN, data_planes=())
    assert "queue" in good.server_info()


def test_tls_on_one_side_only(daemon_factory, pki):
    tls = daemon_factory(_config(extra=f'\n[auth]\ntls_cert_file = "{pki / "server.crt"}"\n'
                                        f'tls_key_file = "{pki / "server.key"}"\n'), name="tls")
    plain = daemon_factory(_config(), name="plain")
    tls_port, plain_port = tls.wait_ready(), plain.wait_ready()
    address = f"localhost:{tls_port}"
    error = _raises_connect_error(gear_client.Client(address, connect_timeout=1.5).server_info, "tls", address, 1.5)
    assert "root_certificates" in str(error)
    address = f"localhost:{plain_port}"
    client = gear_client.Client(address, root_certificates=str(pki / "ca.crt"), connect_timeout=1.5)
    _raises_connect_error(client.server_info, "tls", address, 1.5)
    wrong_ca = gear_client.Client(f"localhost:{tls_port}", root_certificates=str(pki / "otherca.crt"),
                                  connect_timeout=1.5)
    _raises_connect_error(wrong_ca.server_info, "tls", f"localhost:{tls_port}", 1.5)
    right = gear_client.Client(f"localhost:{tls_port}", root_certificates=str(pki / "ca.crt"), data_planes=())
    assert "queue" in right.server_info()


def test_a_daemon_that_starts_late_and_restarts(daemon_factory, caplog):
    port = free_port()
    address = f"127.0.0.1:{port}"
    client = gear_client.Client(address, connect_timeout=60, data_planes=())
    caplog.set_level(logging.WARNING, logger="gear_client.connection.channel")
    started: list[DaemonProcess] = []
    timer = threading.Timer(2.0, lambda: started.append(daemon_factory(_config(port))))
    timer.start()
    try:
        start = time.monotonic()
        assert set(client.server_info()) == {"queue", "prio"}
        assert time.monotonic() - start >= 2.0
    finally:
        timer.join()
    waits = [r.getMessage() for r in caplog.records if "waiting for the gear daemon" in r.getMessage()]
    assert waits and address in waits[0] and "server_info" in waits[0] and "refused" in waits[0]
    insert_items(client, [1.0])
    assert started[0].wait_ready() == port

    # The daemon restarts on the same port: the next call waits for it instead of failing.
    assert started[0].stop() == 0
    restarted = threading.Timer(1.0, lambda: started.append(daemon_factory(_config(port), name="again")))
    restarted.start()
    try:
        assert client.server_info()["queue"].current_size == 0  # a fresh daemon (no checkpoint loaded)
    finally:
        restarted.join()
    insert_items(client, [2.0])
    assert [s.data[0][0] for s in client.sample("queue", 1, emit_timesteps=False)][0][0] == 2.0


class _BusyReplay(pb_grpc.ReplayServiceServicer):
    def ServerInfo(self, request, context):  # noqa: N802 - gRPC's name
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many streams (limits.max_streams)")


def test_a_daemon_that_answers_with_an_error_is_not_waited_for():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_ReplayServiceServicer_to_server(_BusyReplay(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = gear_client.Client(f"127.0.0.1:{port}", connect_timeout=20, data_planes=())
        start = time.monotonic()
        with pytest.raises(errors.ServiceError, match="max_streams") as info:
            client.server_info()
        assert not isinstance(info.value, errors.ConnectError)
        client._wait_ready("trajectory_writer")  # the daemon is there: no wait for the connect timeout
        assert time.monotonic() - start < SLACK_S
    finally:
        server.stop(0)
