"""TensorFlow learners on gear (`make test-tf`; skipped where TensorFlow is not installed).

Reverb's tf.data datasets (TrajectoryDataset / TimestepDataset / ReplayDataset,
``from_table_signature``), ``TFClient`` and tf.TensorSpec signatures, against a
real daemon on loopback, written as Reverb code: ``import reverb`` (the alias
distribution, alias/reverb, from the source tree). Acme's ``make_reverb_dataset`` and TF-Agents'
``ReverbReplayBuffer.as_dataset`` are reproduced call for call (the libraries
themselves are not installed here).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parents[3]
# Acme and TF-Agents say `import reverb`: the alias distribution's package, from the source tree.
sys.path.insert(0, str(ROOT / "alias" / "reverb"))

import reverb

from gear_client.tf import datasets as tf_datasets

T = 4
Step = collections.namedtuple("Step", ["observation", "action", "reward"])  # a TF-Agents-like Trajectory
STEP_SIGNATURE = Step(observation={"pixels": tf.TensorSpec([2, 3], tf.uint8), "pos": tf.TensorSpec([2], tf.float32)},
                      action=tf.TensorSpec([], tf.int64), reward=tf.TensorSpec([], tf.float32))


def _outer(spec: tf.TensorSpec, n: int | None) -> tf.TensorSpec:
    return tf.TensorSpec([n, *spec.shape], spec.dtype, spec.name)


def _step(i: int) -> Step:
    return Step(observation={"pixels": np.full((2, 3), i % 256, np.uint8), "pos": np.full(2, i, np.float32)},
                action=np.int64(i), reward=np.float32(i / 10))


@pytest.fixture(scope="module")
def server():
    trajectory = tf.nest.map_structure(lambda s: _outer(s, None), STEP_SIGNATURE)
    srv = reverb.Server(tables=[
        reverb.Table("traj", reverb.selectors.Uniform(), reverb.selectors.Fifo(), 1000,
                     reverb.rate_limiters.MinSize(1), signature=trajectory),
        reverb.Table("fixed", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 1000,
                     reverb.rate_limiters.MinSize(1), signature=tf.nest.map_structure(lambda s: _outer(s, T),
                                                                                         STEP_SIGNATURE)),
        reverb.Table.queue("queue", 100),
        reverb.Table.queue("plain", 100),
    ])
    client = reverb.Client(f"localhost:{srv.port}")
    with client.trajectory_writer(num_keep_alive_refs=T) as writer:
        for i in range(12):
            writer.append(_step(i))
            if i >= T - 1:
                item = tf.nest.map_structure(lambda column: column[-T:], writer.history)
                writer.create_item("traj", 1.0, item)
                writer.create_item("fixed", 1.0, item)
    yield srv
    srv.stop()


def _address(server) -> str:
    return f"localhost:{server.port}"


def test_signatures_given_as_tf_tensorspec_come_back_as_tf_tensorspec(server):
    signature = reverb.Client(_address(server)).server_info()["traj"].signature
    assert isinstance(signature, Step)
    assert signature.observation["pixels"] == tf.TensorSpec([None, 2, 3], tf.uint8)
    assert all(isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(signature))


def test_trajectory_dataset_from_table_signature_has_the_signatures_specs(server):
    dataset = reverb.TrajectoryDataset.from_table_signature(_address(server), "traj",
                                                            max_in_flight_samples_per_worker=4)
    assert isinstance(dataset, tf.data.Dataset)
    assert dataset.element_spec.data == tf.nest.map_structure(lambda s: _outer(s, None), STEP_SIGNATURE)
    assert dataset.element_spec.info.key == tf.TensorSpec([], tf.uint64)
    for sample in dataset.take(5):
        actions = sample.data.action.numpy()
        assert actions.shape == (T,) and list(actions) == list(range(actions[0], actions[0] + T))
        np.testing.assert_array_equal(sample.data.observation["pos"].numpy()[:, 0], actions.astype(np.float32))
        assert sample.info.table_size.numpy() == 9 and sample.info.probability.numpy() == pytest.approx(1 / 9)


def test_items_of_fully_defined_shapes_come_in_whole_batches_and_leave_as_items(server):
    """A table read ahead whose specs are fully defined: one generator element per fetched batch, unbatched."""
    dataset = reverb.TrajectoryDataset.from_table_signature(_address(server), "fixed",
                                                            max_in_flight_samples_per_worker=4)
    assert dataset.element_spec.data.observation["pixels"] == tf.TensorSpec([T, 2, 3], tf.uint8)
    samples = list(dataset.take(8))
    keys = [int(s.info.key) for s in samples]
    for sample in samples:
        actions = sample.data.action.numpy()
        assert list(actions) == list(range(actions[0], actions[0] + T))
        np.testing.assert_array_equal(sample.data.observation["pixels"].numpy()[:, 0, 0], actions.astype(np.uint8))
        assert sample.info.table_size.numpy() == 9
    assert all(k == keys[0] for k in keys)  # a fifo sampler picks the oldest item every time
    assert [int(s.info.times_sampled) for s in samples[:2]] == [int(samples[0].info.times_sampled) + i
                                                                 for i in range(2)]


def test_acme_make_reverb_dataset(server):
    """Acme's make_reverb_dataset: from_table_signature per worker, interleaved, batched, prefetched."""

    def make_reverb_dataset(server_address, batch_size=None, prefetch_size=None, table="traj", num_parallel_calls=2,
                            max_in_flight_samples_per_worker=None, postprocess=None):
        if max_in_flight_samples_per_worker is None and batch_size is None:
            raise ValueError("max_in_flight_samples_per_worker or batch_size")
        if max_in_flight_samples_per_worker is None:
            max_in_flight_samples_per_worker = 2 * batch_size

        def _make_dataset(unused_idx):
            dataset = reverb.TrajectoryDataset.from_table_signature(
                server_address=server_address, table=table,
                max_in_flight_samples_per_worker=max_in_flight_samples_per_worker)
            if postprocess is not None:
                dataset = dataset.map(postprocess)
            if batch_size:
                dataset = dataset.batch(batch_size, drop_remainder=True)
            return dataset

        dataset = tf.data.Dataset.range(num_parallel_calls).interleave(
            map_func=_make_dataset, cycle_length=num_parallel_calls, num_parallel_calls=num_parallel_calls,
            deterministic=False)
        if prefetch_size:
            dataset = dataset.prefetch(prefetch_size)
        return dataset

    dataset = make_reverb_dataset(_address(server), batch_size=3, prefetch_size=2,
                                  postprocess=lambda sample: sample._replace(data=sample.data._replace(
                                      reward=sample.data.reward * 10)))
    batches = list(dataset.take(4))
    assert len(batches) == 4
    for batch in batches:
        assert batch.data.observation["pixels"].shape == (3, T, 2, 3)
        np.testing.assert_allclose(batch.data.reward.numpy(), batch.data.action.numpy().astype(np.float32), rtol=1e-5)


def test_tf_agents_reverb_replay_buffer_as_dataset(server):
    """TF-Agents' ReverbReplayBuffer.as_dataset: signature add_outer_dim, from_table_signature, per-sequence
    map into the data spec, num_steps windows, sample_batch_size batches."""
    data_spec = STEP_SIGNATURE
    sample_batch_size, num_steps = 2, 2

    def per_sequence_fn(sample):
        data = tf.nest.pack_sequence_as(data_spec, tf.nest.flatten(sample.data))
        return data, sample.info

    dataset = reverb.TrajectoryDataset.from_table_signature(
        server_address=_address(server), table="traj", max_in_flight_samples_per_worker=2 * sample_batch_size,
        rate_limiter_timeout_ms=-1)
    dataset = dataset.map(per_sequence_fn)
    # sequence_length (T) differs from num_steps: split each sequence into num_steps windows.
    dataset = dataset.map(lambda data, info: (tf.nest.map_structure(
        lambda t: tf.reshape(t, [T // num_steps, num_steps, *t.shape[1:]]), data), info))
    dataset = dataset.map(lambda data, info: data).unbatch()
    dataset = dataset.batch(sample_batch_size, drop_remainder=True).prefetch(1)
    for data in dataset.take(3):
        assert isinstance(data, Step)
        assert data.action.shape == (sample_batch_size, num_steps)
        assert data.observation["pixels"].dtype == tf.uint8
        actions = data.action.numpy()
        assert (actions[:, 1] - actions[:, 0] == 1).all()


def test_timestep_and_replay_datasets(server):
    address = _address(server)
    step_dtypes = tf.nest.map_structure(lambda s: s.dtype, STEP_SIGNATURE)
    step_shapes = tf.nest.map_structure(lambda s: s.shape, STEP_SIGNATURE)
    timesteps = tf_datasets.TimestepDataset(address, "fixed", shapes=step_shapes, dtypes=step_dtypes,
                                            max_in_flight_samples_per_worker=2)
    steps = list(timesteps.take(2 * T))
    assert [int(s.data.action) for s in steps[:T]] == list(range(T))  # fifo: the first item, step by step
    assert len({int(s.info.key) for s in steps[:T]}) == 1  # one item's steps carry its SampleInfo
    first = int(steps[0].info.times_sampled)
    assert int(steps[T].info.times_sampled) == first + 1  # the fifo sampler picked the same item again

    sequences = reverb.ReplayDataset(address, "fixed", dtypes=step_dtypes,
                                     shapes=tf.nest.map_structure(lambda s: [T, *s], step_shapes),
                                     max_in_flight_samples_per_worker=2, sequence_length=T, emit_timesteps=False)
    first = next(iter(sequences))
    assert first.data.observation["pos"].shape == (T, 2)
    by_signature = reverb.ReplayDataset.from_table_signature(address, "fixed", max_in_flight_samples_per_worker=2,
                                                             sequence_length=T, emit_timesteps=False)
    with pytest.raises(ValueError, match="sequence_length"):
        reverb.ReplayDataset(address, "fixed", dtypes=step_dtypes, shapes=step_shapes,
                             max_in_flight_samples_per_worker=2, sequence_length=T, emit_timesteps=False)
    assert by_signature.element_spec.data.action.shape == (T, T)  # the signature already holds the time dim


def test_rate_limiter_timeout_ends_the_dataset_and_bad_tables_are_value_errors(server):
    address = _address(server)
    dataset = tf_datasets.TrajectoryDataset(address, "queue", shapes=[], dtypes=tf.float32,
                                            max_in_flight_samples_per_worker=1, rate_limiter_timeout_ms=300)
    start = time.monotonic()
    assert list(dataset) == []
    assert time.monotonic() - start < 20
    with pytest.raises(ValueError, match="does not have a signature"):
        reverb.TrajectoryDataset.from_table_signature(address, "queue", max_in_flight_samples_per_worker=1)
    with pytest.raises(ValueError, match="no-such-table"):
        reverb.TrajectoryDataset.from_table_signature(address, "no-such-table", max_in_flight_samples_per_worker=1)
    with pytest.raises(ValueError, match="max_in_flight"):
        tf_datasets.TrajectoryDataset(address, "queue", shapes=[], dtypes=tf.float32,
                                      max_in_flight_samples_per_worker=0)


def test_tf_client_insert_sample_update_priorities_and_dataset(server):
    address = _address(server)
    client = reverb.TFClient(address)
    client.insert([tf.constant([1.0, 2.0]), tf.constant(7, tf.int64)], tables=tf.constant(["plain"]),
                  priorities=tf.constant([1.5], tf.float64))

    @tf.function
    def insert_in_graph(x):
        return client.insert([x, tf.constant(8, tf.int64)], tf.constant(["plain"]), tf.constant([2.5], tf.float64))

    insert_in_graph(tf.constant([3.0, 4.0]))
    sample = client.sample("plain", [tf.float32, tf.int64])
    assert isinstance(sample.info.key, tf.Tensor) and sample.info.key.dtype == tf.uint64
    np.testing.assert_array_equal(sample.data[0].numpy(), [[1.0, 2.0]])  # Client.insert items are one step long
    assert int(sample.data[1].numpy()[0]) == 7 and float(sample.info.priority) == 1.5
    client.update_priorities("plain", keys=[], priorities=tf.constant([], tf.float64))
    with pytest.raises(ValueError, match="rank 1"):
        client.insert([tf.constant(1.0)], tables=tf.constant("plain"), priorities=tf.constant([1.0], tf.float64))
    with pytest.raises(ValueError, match="float64"):
        client.insert([tf.constant(1.0)], tables=tf.constant(["plain"]), priorities=tf.constant([1.0]))
    rest = client.dataset("plain", dtypes=[tf.float32, tf.int64], shapes=[[1, 2], [1]], emit_timesteps=False,
                          rate_limiter_timeout_ms=300)
    assert [int(s.data[1][0]) for s in rest] == [8]


def test_tf_client_update_priorities_changes_the_table(server):
    address = _address(server)
    client = reverb.TFClient(address)
    sample = client.sample("traj", tf.nest.map_structure(lambda s: s.dtype, STEP_SIGNATURE))
    key = sample.info.key
    client.update_priorities("traj", keys=tf.stack([key]), priorities=tf.constant([5.0], tf.float64))
    priorities = {}
    for s in reverb.Client(address).sample("traj", num_samples=60, emit_timesteps=False):
        priorities[s.info.key] = s.info.priority
    assert priorities[int(key)] == 5.0
    assert all(p == 1.0 for k, p in priorities.items() if k != int(key))


def test_a_queue_item_is_handed_over_without_waiting_for_the_next(server):
    """One item in a queue: next(iter(dataset)) returns it (tf.data's injected prefetch held it back)."""
    address = _address(server)
    client = reverb.Client(address)
    for round_ in range(5):
        client.insert(np.float32(round_), {"queue": 1.0})
        dataset = tf_datasets.TrajectoryDataset(address, "queue", shapes=[1], dtypes=tf.float32,
                                                max_in_flight_samples_per_worker=2)
        got: list = []
        reader = threading.Thread(target=lambda d=dataset, out=got: out.append(next(iter(d))), daemon=True)
        reader.start()
        reader.join(30)
        assert got, f"round {round_}: the queue's one item was not handed over within 30 s"
        assert float(got[0].data[0]) == round_


def test_gear_client_keeps_python_datasets_and_exports_the_tf_ones():
    import gear_client

    assert reverb.TrajectoryDataset is tf_datasets.TrajectoryDataset
    assert gear_client.TrajectoryDataset is not tf_datasets.TrajectoryDataset
    assert gear_client.tf.datasets.TimestepDataset is reverb.TimestepDataset
    assert gear_client.ReplayDataset is reverb.ReplayDataset


def test_import_reverb_in_a_fresh_process_gives_the_tf_datasets(server, tmp_path):
    script = f"""
import tensorflow as tf
import reverb
from reverb import tf_client
dataset = reverb.TrajectoryDataset.from_table_signature("{_address(server)}", "traj",
                                                        max_in_flight_samples_per_worker=2)
assert isinstance(dataset, tf.data.Dataset), type(dataset)
sample = next(iter(dataset))
assert sample.data.action.shape == ({T},)
assert reverb.TFClient is tf_client.TFClient
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "alias" / "reverb"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]


def test_tf_dataset_over_a_list_of_shards_reports_global_probabilities():
    """``TrajectoryDataset.from_table_signature([a, b], ...)``: one table over two daemons, as tf.data sees it
    (the dataset reads the table's configuration from a shard; sizes and probabilities are global)."""
    spec = {"x": tf.TensorSpec([3], tf.float32)}
    servers = [reverb.Server(tables=[reverb.Table("p", reverb.selectors.Prioritized(1.0), reverb.selectors.Fifo(),
                                                  100, reverb.rate_limiters.MinSize(1), signature=spec)])
               for _ in range(2)]
    try:
        for shard, srv in enumerate(servers):
            with reverb.Client(_address(srv)).trajectory_writer(num_keep_alive_refs=1) as writer:
                for _ in range(2 + shard):  # 2 items of priority 1 on one shard, 3 of priority 4 on the other
                    writer.append({"x": np.full(3, shard, np.float32)})
                    writer.create_item("p", float((1 + shard) ** 2), {"x": writer.history["x"][-1]})
        dataset = reverb.TrajectoryDataset.from_table_signature([_address(s) for s in servers], "p",
                                                                max_in_flight_samples_per_worker=4)
        seen = set()
        for sample in dataset.take(40):
            shard = int(sample.data["x"].numpy()[0])
            assert sample.info.table_size.numpy() == 5
            assert sample.info.probability.numpy() == pytest.approx((1 + shard) ** 2 / 14)
            seen.add(shard)
        assert seen == {0, 1}
    finally:
        for srv in servers:
            srv.stop()
