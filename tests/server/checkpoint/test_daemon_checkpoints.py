"""Checkpoints of a real daemon process: SIGKILL mid-write, damaged files, SIGTERM, periodic, readiness."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid

import grpc
import pytest

import gear_client
from gear_server.checkpoint.checkpointer import COMPLETE, MANIFEST, REFUSED, TEST_PAUSE_ENV
from gear_server.ops import health
from tests.support.daemon_process import DaemonProcess
from tests.support.tables_toml import drain_queue, insert_items, tables_toml


def _config(tmp_path, **checkpoint) -> str:
    section = {"dir": str(tmp_path / "checkpoints"), "on_stop": False, **checkpoint}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in section.items())
    return tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f"\n[checkpoint]\n{lines}\n"


def _sizes(client) -> dict[str, int]:
    return {name: info.current_size for name, info in client.server_info(timeout=30).items()}


def _checkpoints(tmp_path) -> list:
    return sorted((tmp_path / "checkpoints").iterdir())


def test_sigkill_during_a_checkpoint_leaves_the_previous_one_intact(tmp_path):
    config = _config(tmp_path)
    daemon = DaemonProcess(tmp_path, config, "first", env={TEST_PAUSE_ENV: "0.05"})
    try:
        daemon.wait_ready()
        client = gear_client.Client(daemon.address)
        insert_items(client, range(10))
        first = client.checkpoint()
        assert first.endswith(_checkpoints(tmp_path)[0].name) and (tmp_path / "checkpoints" / first).is_dir()
        insert_items(client, range(10, 15))

        errors = []
        writer = threading.Thread(target=lambda: errors.append(_try(client.checkpoint)))
        writer.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # kill once the second checkpoint has some files on disk
            partial = [p for p in (tmp_path / "checkpoints").glob(".tmp-*") if len(list(p.rglob("*.npy"))) >= 2]
            if partial:
                break
            time.sleep(0.01)
        assert partial, f"the second checkpoint never started; log:\n{daemon.log}"
        daemon.kill()
        writer.join(30)
        assert errors and isinstance(errors[0], Exception)  # the client saw the daemon die
        assert not (partial[0] / COMPLETE).exists()
    finally:
        daemon.close()

    second = DaemonProcess(tmp_path, config, "second")
    try:
        second.wait_ready()
        client = gear_client.Client(second.address)
        assert _sizes(client) == {"queue": 10, "prio": 10}
        assert drain_queue(client, 10) == list(range(10))  # items and insertion order of the first checkpoint
        assert "restored checkpoint path=" in second.log and first in second.log
        assert "interrupted" in second.log
        assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the partial write was cleaned up
    finally:
        second.stop()


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 (the test inspects it)
        return exc


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_and_the_previous_one_restores(tmp_path, damage):
    config = _config(tmp_path)
    daemon = DaemonProcess(tmp_path, config, "first")
    try:
        daemon.wait_ready()
        client = gear_client.Client(daemon.address)
        insert_items(client, range(6))
        older = client.checkpoint()
        insert_items(client, range(6, 9))
        newer = client.checkpoint()
    finally:
        assert daemon.stop() == 0

    manifest = json.loads((tmp_path / "checkpoints" / newer / MANIFEST).read_text())
    victim_name = next(n for n in manifest["files"] if "queue" in n and "column" in n)
    victim = tmp_path / "checkpoints" / newer / victim_name
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x01
    else:
        del data[-16:]
    victim.write_bytes(bytes(data))

    second = DaemonProcess(tmp_path, config, "second")
    try:
        second.wait_ready()
        client = gear_client.Client(second.address)
        assert _sizes(client) == {"queue": 6, "prio": 6}
        assert drain_queue(client, 6) == list(range(6))
        log = second.log
        reason = "fails its SHA-256 check" if damage == "flip" else "truncated or corrupted"
        assert "checkpoint refused" in log and victim_name in log and reason in log, log
        assert f"restored checkpoint path={tmp_path / 'checkpoints' / older}" in log or older in log
        assert (tmp_path / "checkpoints" / newer / REFUSED).exists()
    finally:
        second.stop()


def test_sigterm_writes_a_final_checkpoint_that_restores_every_counter(tmp_path):
    config = _config(tmp_path, on_stop=True, interval_s=0.3, keep=2)
    daemon = DaemonProcess(tmp_path, config, "first")
    try:
        daemon.wait_ready()
        assert any(m.startswith("STATUS=restoring") for m in daemon.messages)  # restore came before READY
        with grpc.insecure_channel(daemon.address) as channel:
            check = health.health_pb2_grpc.HealthStub(channel).Check
            assert check(health.health_pb2.HealthCheckRequest(), timeout=10).status == health.SERVING
        client = gear_client.Client(daemon.address)
        insert_items(client, range(8))
        assert drain_queue(client, 3) == [0, 1, 2]
        prio = list(client.sample("prio", num_samples=20, emit_timesteps=False))
        times = {}
        for s in prio:
            times[int(s.info.key)] = max(times.get(int(s.info.key), 0), s.info.times_sampled)
        mutated = int(prio[0].info.key)
        client.mutate_priorities("prio", updates={mutated: 50.0})
        before = client.server_info(timeout=30)
        time.sleep(1.0)  # periodic checkpoints every 0.3 s, keep 2
        assert daemon.stop(signal.SIGTERM) == 0
        assert any("STOPPING=1" in m for m in daemon.messages)
    finally:
        daemon.close()
    log = daemon.log
    assert "final checkpoint" in "".join(daemon.messages)
    complete = [p for p in _checkpoints(tmp_path) if (p / COMPLETE).exists()]
    assert len(complete) == 2  # keep = 2
    final = complete[-1]
    assert int(final.name.split("-")[1]) >= 3  # periodic checkpoints came before the final one
    assert log.index("received SIGTERM") < log.index(f"checkpoint written path={final}"), log

    second = DaemonProcess(tmp_path, config, "second")
    try:
        second.wait_ready()
        client = gear_client.Client(second.address)
        after = client.server_info(timeout=30)
        for name in ("queue", "prio"):
            assert after[name].current_size == before[name].current_size
            assert after[name].num_episodes == before[name].num_episodes
            assert after[name].rate_limiter_info.num_deletes == before[name].rate_limiter_info.num_deletes
            assert after[name].num_unique_samples == before[name].num_unique_samples
        assert drain_queue(client, 5) == [3, 4, 5, 6, 7]
        # Priorities and times sampled carry on where they were.
        seen = set()
        for s in client.sample("prio", num_samples=30, emit_timesteps=False):
            key = int(s.info.key)
            seen.add(key)
            value = int(s.data[0].reshape(-1)[0])
            assert s.info.priority == (50.0 if key == mutated else value + 1.0)
            assert s.info.times_sampled >= times.get(key, 0) + 1
            times[key] = s.info.times_sampled
        assert mutated in seen  # priority 50 against 3..9: missed in 30 draws with probability < 1e-10
    finally:
        second.stop()


def test_a_checkpoint_dir_that_cannot_be_created_stops_the_start(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should go")
    config = tables_toml(f"ops{uuid.uuid4().hex[:8]}") + f'\n[checkpoint]\ndir = "{blocker / "checkpoints"}"\n'
    daemon = DaemonProcess(tmp_path, config)
    try:
        assert daemon.process.wait(60) == 1
    finally:
        daemon.close()
    assert f"checkpoint dir {blocker / 'checkpoints'}" in daemon.log
    assert not any(m.startswith("READY=1") for m in daemon.messages)
