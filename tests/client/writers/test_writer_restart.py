"""Writers against a real daemon process that goes away: background sending, restart on the same port, give-up.

Every test runs daemons as child processes on loopback (``reverb.Server``, or
``python -m gear_server`` with a checkpoint taken on SIGTERM) and kills or
stops them for real.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest

import gear_client as reverb
from gear_client.errors import ItemsNotInsertedError
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(90)


def _tables() -> list[reverb.Table]:
    return [reverb.Table.queue("q", max_size=2000)]


def _size(client: reverb.Client, table: str = "q") -> int:
    return client.server_info(timeout=10)[table].current_size


def _wait_size(client: reverb.Client, n: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    size = _size(client)
    while size < n and time.monotonic() < deadline:
        time.sleep(0.02)
        size = _size(client)
    return size


def _drain(client: reverb.Client, n: int) -> list[tuple[int, ...]]:
    """The items of queue 'q' as tuples of their leaves' last values (FIFO order)."""
    out = []
    for sample in client.sample("q", num_samples=n, emit_timesteps=False):
        out.append(tuple(int(np.asarray(leaf).reshape(-1)[-1]) for leaf in sample.data))
    return out


def test_items_are_sent_without_flush():
    with reverb.Server(_tables()) as server:
        client = reverb.Client(f"localhost:{server.port}")
        writer = client.trajectory_writer(1)
        for i in range(4):
            writer.append({"x": np.int64(i)})
            writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})
        assert _wait_size(client, 4, timeout=5) == 4  # TF-Agents' observer relies on this: no flush
        writer.close()


def test_a_writer_survives_a_daemon_killed_and_restarted_on_the_same_port():
    port = free_port()
    server = reverb.Server(_tables(), port=port)
    try:
        client = reverb.Client(f"localhost:{port}")
        writer = client.trajectory_writer(3)
        for i in range(5):
            writer.append({"x": np.int64(i)})
            writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})
        writer.flush()
        assert _size(client) == 5
        os.kill(server.pid, signal.SIGKILL)  # the 5 items die with it
        server.stop()
        # While the daemon is away: items are taken, nothing raises; they reference steps sent before the kill.
        for i in range(5, 10):
            writer.append({"x": np.int64(i)})
            writer.create_item("q", 1.0, {"x": writer.history["x"][-3:]})
        server = reverb.Server(_tables(), port=port)
        writer.flush(timeout_ms=30_000)
        writer.flush()  # nothing pending: no error
        got = _drain(client, _size(client))
        assert got == [(i,) for i in range(5, 10)]  # each once, in order
        assert client.sample("q", 1, emit_timesteps=False) is not None or True
        # The resent chunks carry the steps before the kill: the last item holds steps 7, 8, 9.
        writer.create_item("q", 1.0, {"x": writer.history["x"][-3:]})
        writer.flush(timeout_ms=10_000)
        [sample] = list(client.sample("q", 1, emit_timesteps=False))
        assert np.asarray(sample.data[0]).tolist() == [7, 8, 9]
        writer.close()
    finally:
        server.stop()


def test_items_are_given_up_with_their_keys_when_the_daemon_stays_away():
    port = free_port()
    server = reverb.Server(_tables(), port=port)
    client = reverb.Client(f"localhost:{port}")
    # Longer than gRPC's reconnect back-off (at most 2 s): a daemon that is back is found in time.
    writer = client.trajectory_writer(1, reconnect_timeout_s=4.0)
    writer.append({"x": np.int64(0)})
    writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})
    writer.flush()
    os.kill(server.pid, signal.SIGKILL)
    server.stop()
    for i in range(1, 4):
        writer.append({"x": np.int64(i)})
        writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})
    started = time.monotonic()
    with pytest.raises(ItemsNotInsertedError, match=f"3 items were not inserted: the daemon at localhost:{port}") \
            as info:
        writer.flush(timeout_ms=20_000)
    assert 3.0 < time.monotonic() - started < 12
    assert len(set(info.value.keys)) == 3
    # The writer stays usable: the daemon comes back, new items go in, the given-up ones never do.
    server = reverb.Server(_tables(), port=port)
    try:
        writer.append({"x": np.int64(10)})
        writer.create_item("q", 1.0, {"x": writer.history["x"][-1]})
        writer.flush(timeout_ms=30_000)
        assert _drain(client, _size(client)) == [(10,)]
        writer.close()
    finally:
        server.stop()


# ------------------------------------------------------- 50 writers, a daemon restarted under them ----

WRITERS = 50
ITEMS_PER_WRITER = 12


def _daemon_config(tmp_path, port: int) -> str:
    checkpoint = {"dir": str(tmp_path / "checkpoints"), "on_stop": True}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in checkpoint.items())
    return f'''
bind_address = "127.0.0.1"
port = {port}
instance_name = "w{uuid.uuid4().hex[:8]}"

[[tables]]
name = "q"
preset = "queue"
max_size = 2000

[checkpoint]
{lines}
'''


def test_fifty_writers_across_a_restart_lose_and_duplicate_nothing(tmp_path):
    """SIGTERM (the daemon checkpoints what it acknowledged), restart on the same port from the checkpoint."""
    port = free_port()
    config = _daemon_config(tmp_path, port)
    daemon = DaemonProcess(tmp_path, config, "first")
    daemon.wait_ready()
    halfway = threading.Barrier(WRITERS + 1, timeout=60)
    go_on = threading.Event()
    errors: list[BaseException] = []

    def actor(w: int) -> None:
        try:
            client = reverb.Client(f"127.0.0.1:{port}")
            with client.trajectory_writer(2, reconnect_timeout_s=60) as writer:
                for i in range(ITEMS_PER_WRITER):
                    writer.append({"w": np.int64(w), "i": np.int64(i)})
                    writer.create_item("q", 1.0, {"w": writer.history["w"][-1], "i": writer.history["i"][-1]})
                    if i == ITEMS_PER_WRITER // 3:
                        halfway.wait()
                    elif i == ITEMS_PER_WRITER // 3 + 1:
                        assert go_on.wait(60)  # these items are created while the daemon is down
                writer.flush(timeout_ms=60_000)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=actor, args=(w,), daemon=True) for w in range(WRITERS)]
    for t in threads:
        t.start()
    try:
        halfway.wait()
        assert daemon.stop(signal.SIGTERM) == 0
        daemon = DaemonProcess(tmp_path, config, "second")
        go_on.set()
        daemon.wait_ready()
        for t in threads:
            t.join(75)
        assert not any(t.is_alive() for t in threads), "writers still running"
        assert errors == []
        client = reverb.Client(f"127.0.0.1:{port}")
        size = _size(client)
        got = _drain(client, size)
        # Keys are idempotent: an item the first daemon checkpointed but did not acknowledge is resent and
        # not inserted twice; every created item is there once.
        assert sorted(got) == sorted((i, w) for w in range(WRITERS) for i in range(ITEMS_PER_WRITER))
    finally:
        go_on.set()
        daemon.close()


def test_a_resent_item_leaves_an_existing_key_as_it_is():
    """The resend of an item the daemon inserted (its acknowledgement lost) changes nothing, not even a priority."""
    from gear_contract._proto import replay_pb2 as pb

    table = reverb.Table("p", sampler=reverb.selectors.Prioritized(1.0), remover=reverb.selectors.Fifo(),
                         max_size=10, rate_limiter=reverb.rate_limiters.MinSize(1))
    with reverb.Server([table]) as server:
        client = reverb.Client(f"localhost:{server.port}")

        def insert(priority: float, resend: bool) -> None:
            data = np.array([7], np.int64)
            request = pb.InsertStreamRequest(
                chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="<i8", shape=[1], data=data.tobytes()))],
                items=[pb.PrioritizedItem(key=42, table="p", priority=priority, structure=pb.Structure(),
                                          columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=1, length=1)])],
                                          resend=resend)])
            assert [list(r.keys) for r in client._stub.InsertStream(iter([request]), timeout=10)] == [[42]]

        def priority() -> float:
            [sample] = list(client.sample("p", 1, emit_timesteps=False))
            return sample.info.priority

        insert(1.0, resend=False)
        client.mutate_priorities("p", updates={42: 5.0})
        insert(1.0, resend=True)  # acknowledged, and nothing changed
        assert priority() == 5.0 and _size(client, "p") == 1
        insert(2.0, resend=False)  # a plain insert of an existing key updates its priority (Reverb)
        assert priority() == 2.0 and _size(client, "p") == 1
