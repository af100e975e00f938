"""Writers whose daemon stops answering without closing the connection never wait for ever.

The daemon is a real child process on loopback. ``SIGSTOP`` leaves its sockets
open and its answers away, as a wedged daemon or a host cut off the network
does: no gRPC error ever comes. The writer must give its items up after the
client's connect timeout with an error naming the address and the keys, on the
same-host insert plane and on InsertStream alike; a daemon that holds inserts
back on its rate limiter for longer than that is still waited for.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

import gear_client as reverb
from gear_client.errors import ItemsNotInsertedError
from gear_client.writers import routes
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT_S = 2.0
# The give-up comes after the connect timeout, plus a probe's time and polling; a loaded machine adds more.
GIVE_UP_BOUND_S = CONNECT_TIMEOUT_S + 10.0


@pytest.fixture(params=["insert_plane", "insert_stream"])
def route(request, monkeypatch) -> str:
    """Each test runs over the same-host insert plane (opened at the first item, however small) and over
    InsertStream (``GEAR_INSERT_PLANE=0``)."""
    if request.param == "insert_stream":
        monkeypatch.setenv("GEAR_INSERT_PLANE", "0")
    else:
        monkeypatch.setattr(routes, "PLANE_MIN_ITEM_BYTES", 0)
    return request.param


def _writer_route(writer) -> str:
    return "insert_plane" if writer._same_host._writer is not None else "insert_stream"


def _settle(writer, route: str, start: int) -> int:
    """Create items until the writer's route is settled (the insert plane has learned the table's layout:
    until then an item goes over InsertStream and the next one asks the daemon again); the next index."""
    i = start
    while route == "insert_plane" and writer._same_host._writer._tables["q"].mapping is None:
        assert i < start + 50, "the insert plane never got the table's layout"
        _create(writer, i, 1)
        writer.flush(timeout_ms=20_000)
        i += 1
    return i


def _stop(server: reverb.Server) -> None:
    """SIGSTOP the daemon and wait until it is stopped (the signal takes effect asynchronously)."""
    os.kill(server.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the daemon did not stop"
        time.sleep(0.01)


def _kill(server: reverb.Server) -> None:
    os.kill(server.pid, signal.SIGKILL)
    os.kill(server.pid, signal.SIGCONT)
    server.stop()


def _create(writer, start: int, count: int) -> None:
    for i in range(start, start + count):
        writer.append({"x": np.int64(i)})
        writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})


def test_a_stopped_daemon_gives_the_items_up_after_the_connect_timeout(route):
    port = free_port()
    server = reverb.Server([reverb.Table.queue("q", max_size=1000)], port=port)
    try:
        client = reverb.Client(f"localhost:{port}", connect_timeout=CONNECT_TIMEOUT_S)
        writer = client.trajectory_writer(1)
        _create(writer, 0, 3)
        writer.flush(timeout_ms=20_000)
        assert _writer_route(writer) == route
        n = _settle(writer, route, 3)
        _stop(server)
        started = time.monotonic()
        created = 0
        with pytest.raises(ItemsNotInsertedError) as info:
            for i in range(n, n + 5):  # taken while the writer has room (the item whose call raises is not)
                _create(writer, i, 1)
                created += 1
            writer.flush()  # no flush without a timeout may wait for ever
        waited = time.monotonic() - started
        message = str(info.value)
        assert f"localhost:{port}" in message, message
        assert created >= 1 and len(info.value.keys) == created and len(set(info.value.keys)) == created
        assert str(info.value.keys[0]) in message
        assert CONNECT_TIMEOUT_S <= waited < GIVE_UP_BOUND_S, waited
        writer.close()
    finally:
        _kill(server)


def test_a_daemon_holding_inserts_on_its_rate_limiter_is_waited_for(route):
    """Commits held back longer than the connect timeout: the daemon answers probes, so the writer waits."""
    limiter = reverb.rate_limiters.SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=1.0)
    table = reverb.Table("q", sampler=reverb.selectors.Fifo(), remover=reverb.selectors.Fifo(), max_size=1000,
                         rate_limiter=limiter)
    port = free_port()
    with reverb.Server([table], port=port) as server:
        client = reverb.Client(f"localhost:{port}", connect_timeout=CONNECT_TIMEOUT_S)
        done = threading.Event()
        errors: list[BaseException] = []
        routes: list[str] = []

        def actor() -> None:
            try:
                with client.trajectory_writer(1) as writer:
                    _create(writer, 0, 6)
                    routes.append(_writer_route(writer))
                    writer.flush()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
            finally:
                done.set()

        thread = threading.Thread(target=actor, daemon=True)
        thread.start()
        # Held back: the ratio lets about two items in before any sample.
        assert not done.wait(2.5 * CONNECT_TIMEOUT_S), errors
        assert server.pid > 0
        sampler = reverb.Client(f"localhost:{port}")
        taken = 0
        while taken < 6:  # the ratio allows one sample per insert: each lets the next insert in
            assert not errors, errors
            taken += len(list(sampler.sample("q", 1, emit_timesteps=False)))
        thread.join(30)
        assert done.is_set() and errors == []
        assert routes == [route]


def test_items_written_before_a_kill_are_resent_to_the_restarted_daemon_and_logged_in_words(route, caplog):
    """SIGSTOP, items taken, SIGKILL (the connection breaks), restart on the same port within the timeout."""
    port = free_port()
    server = reverb.Server([reverb.Table.queue("q", max_size=1000)], port=port)
    try:
        client = reverb.Client(f"localhost:{port}", connect_timeout=30)
        writer = client.trajectory_writer(1)
        _create(writer, 0, 2)
        writer.flush(timeout_ms=20_000)
        assert _writer_route(writer) == route
        n = _settle(writer, route, 2)
        _stop(server)
        caplog.set_level(logging.INFO, logger="gear_client")
        _create(writer, n, 4)  # written, their commits never answered
        _kill(server)
        server = reverb.Server([reverb.Table.queue("q", max_size=1000)], port=port)
        writer.flush(timeout_ms=30_000)
        got = [int(np.asarray(s.data[0]).reshape(-1)[-1]) for s in client.sample("q", 4, emit_timesteps=False)]
        assert got == list(range(n, n + 4))
        assert client.server_info(timeout=10)["q"].current_size == 0
        writer.close()
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "Rendezvous" not in text and "debug_error_string" not in text, text
        assert f"localhost:{port} lost (UNAVAILABLE" in text, text
    finally:
        server.stop()
