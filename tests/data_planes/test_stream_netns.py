"""The stream plane across hosts for real: learners in another network namespace, joined by a veth pair.

The daemon listens on the host side of the pair; learner processes run in the
namespace (``ip netns exec``), so their host identity differs, shm is not
offered and every byte crosses the veth link over the stream plane's TCP
connections.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import fill, insert

ROOT = Path(__file__).resolve().parents[2]

_LEARNER = """
import json, sys, time
import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from tests.support.trajectories import check_batch
address, seconds = sys.argv[1], float(sys.argv[2])
out = {}
with PlaneSampler(address, "t") as s:
    out["kind"] = s.open()
    checked = 0
    deadline = time.monotonic() + seconds
    for batch in s.batches(8):
        checked += check_batch(batch)
        if time.monotonic() > deadline:
            break
    out["pipelined"] = checked
    out["one_by_one"] = sum(check_batch(s.sample(8)) for _ in range(10))
    out["stale"] = s.stale_batches
with reverb.TrajectoryDataset(address, "t", batch_size=4, max_samples=40) as ds:
    out["dataset_items"] = sum(check_batch(b) for b in ds.batches())
    out["dataset_plane"] = ds.plane
print(json.dumps(out))
"""

_LOOPING_LEARNER = """
import sys
from gear_client.data_planes.sampler import PlaneSampler
s = PlaneSampler(sys.argv[1], "t")
print(s.open(), flush=True)
for b in s.batches(16):
    pass
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GEAR_HOST_ID", None)
    return env


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_learner_in_another_namespace_reads_over_streams_never_torn_under_churn(namespace):
    ns, host_ip = namespace
    d = start_daemon(table_config("t", 16), bind=host_ip, stream=True)
    stop = threading.Event()
    inserted = [0]

    def churn() -> None:
        seed = 1000
        while not stop.is_set():
            insert(d.tables["t"], seed, length=32, dim=2048)  # 256 KiB items, evicting as fast as it can
            seed += 1
            inserted[0] += 1
            time.sleep(0.001)

    writer = threading.Thread(target=churn)
    try:
        fill(d.tables["t"], 16, length=32, dim=2048)
        writer.start()
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _LEARNER, f"{host_ip}:{d.port}", "4"],
                             capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        d.stop()
    assert result["kind"] == "stream" and result["dataset_plane"] == "stream"
    assert result["pipelined"] >= 100 and result["one_by_one"] == 80 and result["dataset_items"] == 40
    assert inserted[0] >= 100  # the slots were rewritten all along


def test_a_learner_killed_in_another_namespace_is_reaped_and_others_keep_reading(namespace):
    ns, host_ip = namespace
    d = start_daemon(table_config("t", 32), bind=host_ip, stream=True)
    try:
        fill(d.tables["t"], 32, length=32, dim=2048)
        address = f"{host_ip}:{d.port}"
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _LOOPING_LEARNER, address],
                                stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
        try:
            assert proc.stdout.readline().strip() == "stream"
            assert _wait_for(lambda: d.manager.stream.connection_count() == 4)
            time.sleep(0.5)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert _wait_for(lambda: d.manager.stream.connection_count() == 0)
        assert _wait_for(lambda: len(d.manager.sessions) == 0) and d.manager.sessions.active_leases() == 0
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _LEARNER, address, "1"],
                             capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1])["kind"] == "stream"
    finally:
        d.stop()


_ACTOR = """
import json, sys
from tests.support.trajectories import write_trajectories
print(json.dumps(write_trajectories(sys.argv[1], 1000, 40, 16, 1024)))
"""


def test_an_actor_in_another_namespace_inserts_over_the_stream(namespace):
    import numpy as np

    from tests.support.insert_plane import items_in_insert_order
    from tests.support.trajectories import make_item

    ns, host_ip = namespace
    d = start_daemon(table_config("t", 64), bind=host_ip, stream=True)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _ACTOR, f"{host_ip}:{d.port}"],
                             capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout.strip().splitlines()[-1])["insert_plane"]  # reserve/commit over gRPC
        table = d.tables["t"]
        assert table.size() == 40 and d.ingest.plane.items_committed >= 39  # rows over the stream
        for seed, item in zip(range(1000, 1040), items_in_insert_order(table), strict=True):
            want = make_item(seed, 16, 1024)
            assert all(np.array_equal(item[k], want[k]) for k in want), seed
        assert _wait_for(lambda: d.ingest.plane.outstanding() == 0 and d.manager.stream.connection_count() == 0)
    finally:
        d.stop()
