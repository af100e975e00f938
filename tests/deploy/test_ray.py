"""gear_ray on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``: every node a raylet of its own on
this machine). Each node has its own host identity (``GEAR_HOST_ID``) and shared-memory folder
(``GEAR_RAY_SHM_DIR``), set on its raylet and so inherited by every worker there, as two machines would differ.

Runs in ``make test-ray`` (.venv-ray: ``pip install -e '.[dev,ray]'``); skipped where Ray is not installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tests.support.paths import ROOT

ray = pytest.importorskip("ray", reason="Ray is not installed (make test-ray)")
from ray.cluster_utils import Cluster  # noqa: E402

import gear_client  # noqa: E402
import gear_ray  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

NODES = ("a", "b")
CONFIG = """
bind_address = "127.0.0.1"
instance_name = "raytest"

[[tables]]
name = "replay"
sampler = "uniform"
remover = "fifo"
max_size = 1000
rate_limiter = { min_size = 1 }

[tables.signature]
observation = { dtype = "float32", shape = [-1, 8] }
step = { dtype = "int64", shape = [-1] }

[logging]
level = "WARNING"
"""
STEPS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes, each with the custom resources "gear" (gets a daemon) and "node_<x>" (pins tasks)."""
    folder = tmp_path_factory.mktemp("ray")
    tag = uuid.uuid4().hex[:8]
    nodes = {}
    ray_cluster = Cluster()
    for x in NODES:
        env = {"GEAR_HOST_ID": f"raytest-{tag}-{x}", "GEAR_RAY_SHM_DIR": str(folder / f"shm-{x}")}
        nodes[x] = ray_cluster.add_node(num_cpus=2, resources={"gear": 1, f"node_{x}": 1}, env_vars=env)
    ray.init(address=ray_cluster.address)
    try:
        yield {"folder": folder, "cluster": ray_cluster, "nodes": {x: n.node_id for x, n in nodes.items()},
               "host_ids": {x: f"raytest-{tag}-{x}" for x in NODES}}
    finally:
        ray.shutdown()
        ray_cluster.shutdown()


@pytest.fixture(scope="module")
def replay(cluster):
    deployment = gear_ray.start(CONFIG, name="rt", port=0, resource="gear",
                                checkpoint_root=str(cluster["folder"] / "ckpt"), timeout_s=180)
    yield deployment
    try:
        deployment.stop(timeout_s=60)
    except LookupError:
        pass


@ray.remote(num_cpus=0)
class Actor:
    """An RL actor: writes episodes through gear_ray's client from the node it is pinned to."""

    def host_id(self) -> str:
        return os.environ["GEAR_HOST_ID"]

    def write(self, name: str, episodes: int, first_step: int) -> None:
        client = gear_ray.client(name)
        with client.trajectory_writer(STEPS) as writer:
            for e in range(episodes):
                for s in range(STEPS):
                    step = first_step + e * STEPS + s
                    writer.append({"observation": np.full(8, step, np.float32), "step": np.int64(step)})
                writer.create_item("replay", 1.0, {k: writer.history[k][-STEPS:] for k in ("observation", "step")})
                writer.end_episode()
            writer.flush()
        client.close()


@ray.remote(num_cpus=0)
def learn(name: str, batch_size: int, batches: int) -> dict:
    """A learner: batches over every shard; what it saw and how it read each shard."""
    shards = gear_ray.addresses(name)
    keys, sizes, probabilities, firsts = [], [], [], []
    with gear_client.TrajectoryDataset(shards, "replay", batch_size, rate_limiter_timeout_ms=30_000) as dataset:
        for i, sample in enumerate(dataset):
            keys += [int(k) for k in sample.info.key]
            sizes += [int(s) for s in sample.info.table_size]
            probabilities += [float(p) for p in sample.info.probability]
            steps = np.asarray(sample.data["step"])
            observations = np.asarray(sample.data["observation"])
            assert (observations == steps[..., None]).all()  # every item's bytes are its own
            firsts += [int(s) for s in steps[:, 0]]
            if i + 1 == batches:
                break
        plane = dataset.plane
    return {"keys": keys, "sizes": sizes, "probabilities": probabilities, "firsts": firsts, "plane": plane,
            "host_id": os.environ["GEAR_HOST_ID"]}


def _on(x: str) -> dict:
    return {"resources": {f"node_{x}": 0.01}}


def _shard_sizes(replay) -> dict[str, int]:
    """node letter -> items in that node's daemon, asked of each daemon alone."""
    out = {}
    for shard in replay.shards():
        client = gear_client.Client(shard["address"], connect_timeout=30)
        out[shard["host_key"].rsplit("-", 1)[-1]] = client.server_info()["replay"].current_size
        client.close()
    return out


def _wait_shard_back(replay, node_id: str, starts: int, timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for shard in replay.shards():
            if shard["node_id"] == node_id and shard["starts"] >= starts:
                return shard
        time.sleep(0.5)
    raise AssertionError(f"the daemon of node {node_id} did not come back within {timeout} s: {replay.shards()}")


def test_one_daemon_per_node_found_through_the_registry(cluster, replay):
    shards = replay.shards()
    assert sorted(s["node_id"] for s in shards) == sorted(cluster["nodes"].values())
    assert len({s["address"] for s in shards}) == 2
    assert {s["host_key"] for s in shards} == set(cluster["host_ids"].values())
    for shard in shards:  # each node's checkpoints in its own folder
        assert shard["state_dir"].endswith(f"rt/{shard['host_key']}")
    assert gear_ray.addresses("rt") == [s["address"] for s in shards]
    # A second deployment of the same name is refused; a bad config never starts an actor.
    with pytest.raises(ValueError, match="runs already"):
        gear_ray.start(CONFIG, name="rt", port=0, resource="gear")
    with pytest.raises(ValueError, match="max_size"):
        gear_ray.start(CONFIG.replace("max_size = 1000", "max_size = -1"), name="bad", port=0, resource="gear")
    with pytest.raises(ValueError, match="no alive Ray node has resource 'nope'"):
        gear_ray.start(CONFIG, name="bad", port=0, resource="nope")
    with pytest.raises(LookupError, match="no gear deployment named 'bad'"):
        gear_ray.attach("bad")


def test_a_registry_that_dies_is_restarted_and_relearns_the_daemons(replay):
    before = replay.shards()
    ray.kill(ray.get_actor("gear_ray.rt"), no_restart=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the restarted registry starts empty, then every daemon registers again
        try:
            after = replay.shards()
        except ray.exceptions.RayActorError:
            after = []
        if len(after) == 2 and all(a["registered_at"] > b["registered_at"] for a, b in zip(after, before, strict=True)):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the daemons did not register again: {before} -> {replay.shards()}")
    assert gear_ray.addresses("rt") == [b["address"] for b in before]
    assert [a["pid"] for a in after] == [b["pid"] for b in before]  # the daemons themselves went on


def test_actors_insert_on_their_node_and_a_learner_samples_both_shards(cluster, replay):
    actor_a = Actor.options(**_on("a")).remote()
    actor_b = Actor.options(**_on("b")).remote()
    assert ray.get(actor_a.host_id.remote()) == cluster["host_ids"]["a"]
    ray.get(actor_a.write.remote("rt", 20, 0))
    ray.get(actor_b.write.remote("rt", 10, 10_000))
    # Each actor's episodes went to its own node's daemon.
    assert _shard_sizes(replay) == {"a": 20, "b": 10}
    # The learner on node B: every shard, global semantics (uniform: 1 / global size), its own shard over shm.
    seen = ray.get(learn.options(**_on("b")).remote("rt", 16, 8))
    assert seen["host_id"] == cluster["host_ids"]["b"]
    assert len(seen["keys"]) == 128
    assert set(seen["sizes"]) == {30}
    assert np.allclose(seen["probabilities"], 1 / 30)
    from_a = [f for f in seen["firsts"] if f < 10_000]
    from_b = [f for f in seen["firsts"] if f >= 10_000]
    assert from_a and from_b  # P(128 uniform picks miss a shard of 10 or 20 of 30) < 1e-22
    assert 0.5 < len(from_a) / len(from_b) < 4.0  # 2:1 expected
    assert seen["plane"] == "shm+stream"  # its own node's shard over shm, the other over the stream plane


def test_a_killed_daemon_is_restarted_by_ray_and_comes_back_with_its_items(cluster, replay):
    sizes = _shard_sizes(replay)
    assert sum(sizes.values()) > 0
    watcher = replay.client(shard_timeout_s=2.0, shard_retry_s=0.5)  # made before the kill: sees it go and return
    assert watcher.server_info()["replay"].current_size == sum(sizes.values())
    assert replay.client().checkpoint().count(",") == 1  # every shard writes its checkpoint
    node_a = cluster["nodes"]["a"]
    before = next(s for s in replay.shards() if s["node_id"] == node_a)
    os.kill(before["pid"], signal.SIGKILL)
    after = _wait_shard_back(replay, node_a, before["starts"] + 1)
    assert after["pid"] != before["pid"] and after["address"] == before["address"]
    assert after["restarted"]  # Ray restarted the actor, pinned to its node
    assert _shard_sizes(replay) == sizes  # the checkpoint came back
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = watcher.server_info()["replay"]
        if all(s.up for s in info.shards) and info.current_size == sum(sizes.values()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the client did not take the shard back: {watcher.shards()}")
    watcher.close()
    seen = ray.get(learn.options(**_on("b")).remote("rt", 16, 2))
    assert any(f < 10_000 for f in seen["firsts"])  # node A's items are sampled again


def test_an_actor_process_that_dies_is_restarted_with_its_nodes_checkpoint(cluster, replay):
    """The actor's worker killed (not the daemon): Ray ends the dead worker's children, the daemon among them
    (maybe in the middle of its final checkpoint, which the next start discards), and restarts the actor,
    whose new daemon restores the node's last complete checkpoint at the same address."""
    ray.get(Actor.options(**_on("b")).remote().write.remote("rt", 3, 30_000))
    sizes = _shard_sizes(replay)
    client = replay.client()
    client.checkpoint()
    client.close()
    node_b = cluster["nodes"]["b"]
    before = next(s for s in replay.shards() if s["node_id"] == node_b)
    os.kill(before["actor_pid"], signal.SIGKILL)
    after = _wait_shard_back(replay, node_b, before["starts"] + 1)
    assert after["actor_pid"] != before["actor_pid"] and after["pid"] != before["pid"]
    assert after["address"] == before["address"] and after["restarted"]
    assert _shard_sizes(replay) == sizes


def test_stop_drains_and_a_new_start_restores_every_node(cluster, replay):
    actor_b = Actor.options(**_on("b")).remote()
    ray.get(actor_b.write.remote("rt", 5, 20_000))  # after the last explicit checkpoint
    sizes = _shard_sizes(replay)
    replay.stop(timeout_s=60)  # SIGTERM to each daemon: its final checkpoint
    with pytest.raises(LookupError):
        gear_ray.attach("rt")
    again = gear_ray.start(CONFIG, name="rt", port=0, resource="gear",
                           checkpoint_root=str(cluster["folder"] / "ckpt"), timeout_s=180)
    try:
        assert _shard_sizes(again) == sizes
    finally:
        again.stop(timeout_s=60)


DRIVER = """
import sys
import numpy as np
import ray
import gear_ray

ray.init(address=sys.argv[1])
replay = gear_ray.start(sys.argv[2], name="exit", port=0, resource="gear", checkpoint_root=sys.argv[3], timeout_s=180)
client = replay.client()
with client.trajectory_writer(4) as writer:
    for e in range(6):
        for s in range(4):
            writer.append({"observation": np.full(8, s, np.float32), "step": np.int64(s)})
        writer.create_item("replay", 1.0, {k: writer.history[k][-4:] for k in ("observation", "step")})
        writer.end_episode()
client.close()
print("wrote 6 items; exiting without stop()", flush=True)
"""


def test_a_driver_that_exits_without_stop_drains_its_deployment(cluster):
    root = cluster["folder"] / "ckpt-exit"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", DRIVER, cluster["cluster"].address, CONFIG, str(root)], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "wrote 6 items" in out.stdout, out.stdout + out.stderr[-3000:]
    again = gear_ray.start(CONFIG, name="exit", port=0, resource="gear", checkpoint_root=str(root), timeout_s=180)
    try:
        assert sum(_shard_sizes(again).values()) == 6  # every item came from the final checkpoints
    finally:
        again.stop(timeout_s=60)
