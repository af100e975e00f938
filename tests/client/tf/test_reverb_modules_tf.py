"""Reverb's own dataset and structured-writer modules under `import reverb` (gear's alias) with TensorFlow.

Each check runs Reverb-shaped code in a real subprocess with alias/reverb on
the path, against a gear server: ``reverb.trajectory_dataset`` /
``timestep_dataset`` / ``pattern_dataset`` give Reverb's tf.data classes with
Reverb's signatures, ``infer_signature`` gives tf.TensorSpecs, and a process
whose datasets are still waiting exits within a bound.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tf,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                 reason="tensorflow is not installed")]

ROOT = Path(__file__).resolve().parents[3]
EXIT_BOUND_S = 60

DATASET_MODULES = r"""
import numpy as np
import tensorflow as tf
import reverb
from reverb import pattern_dataset, structured_writer, timestep_dataset, trajectory_dataset

assert trajectory_dataset.TrajectoryDataset is reverb.TrajectoryDataset
assert timestep_dataset.TimestepDataset is reverb.TimestepDataset
assert pattern_dataset.PatternDataset is reverb.PatternDataset
signature = {"obs": tf.TensorSpec([3, 2], tf.float32), "act": tf.TensorSpec([], tf.int64)}
server = reverb.Server([reverb.Table("t", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                                     max_size=10, rate_limiter=reverb.rate_limiters.MinSize(1),
                                     signature=signature)])
address = f"localhost:{server.port}"
client = reverb.Client(address)
with client.trajectory_writer(3) as writer:
    for i in range(3):
        writer.append({"obs": np.full(2, i, np.float32), "act": np.int64(i)})
    writer.create_item("t", 1.0, {"obs": writer.history["obs"][-3:], "act": writer.history["act"][-1]})

# Reverb's keywords, a constant tensor for the address, as Reverb's own tests call it
dataset = trajectory_dataset.TrajectoryDataset(tf.constant(address), table=tf.constant("t"),
                                               dtypes={"obs": tf.float32, "act": tf.int64},
                                               shapes={"obs": tf.TensorShape([3, 2]), "act": tf.TensorShape([])},
                                               max_in_flight_samples_per_worker=2)
assert isinstance(dataset, tf.data.Dataset) and isinstance(dataset, trajectory_dataset.TrajectoryDataset)
assert hasattr(dataset, "make_initializable_iterator")  # Reverb's are DatasetV1s (TF1 code uses it)
sample = next(iter(dataset))
assert sample.data["obs"].shape == (3, 2) and int(sample.data["act"]) == 2, sample
assert sample.info.key.dtype == tf.uint64

from_signature = trajectory_dataset.TrajectoryDataset.from_table_signature(address, "t", 2)
assert from_signature.element_spec.data == signature, from_signature.element_spec
steps = timestep_dataset.TimestepDataset.from_table_signature(address, "t", 2)
assert steps.element_spec.data == signature

for bad in (dict(max_in_flight_samples_per_worker=0), dict(max_in_flight_samples_per_worker=1, max_samples=0)):
    try:
        trajectory_dataset.TrajectoryDataset(address, "t", {"obs": tf.float32, "act": tf.int64},
                                             {"obs": [3, 2], "act": []}, **bad)
    except ValueError as e:
        assert "must be a positive integer" in str(e), e
    else:
        raise AssertionError(f"{bad} was accepted")

# Requested specs that cannot be the table signature's: Reverb's error, raised through tf.data
wrong = timestep_dataset.TimestepDataset(address, "t", dtypes=(tf.float32,), shapes=(tf.TensorShape([3]),),
                                         max_in_flight_samples_per_worker=2)
try:
    next(iter(wrong))
except tf.errors.InvalidArgumentError as e:
    assert "Inconsistent number of tensors requested from table 't'." in str(e), e
else:
    raise AssertionError("a wrong spec was sampled")

# structured_writer: tf.TensorSpecs, compared as Reverb code compares them
ref = structured_writer.create_reference_step({"d": None})
config = structured_writer.create_config({"x": ref["d"][-2], "y": ref["d"][-3:]}, "t")
inferred = structured_writer.infer_signature([config], {"d": tf.TensorSpec([2], tf.int32)})
assert inferred == {"x": tf.TensorSpec([2], tf.int32, "x"), "y": tf.TensorSpec([3, 2], tf.int32, "y")}, inferred

# pattern_dataset: the writer's patterns over a dataset of steps, no server
steps = tf.data.Dataset.from_tensor_slices({"d": [0, 1, 2, 3, 4, 5], "last": [False, False, True] * 2})
ref = structured_writer.create_reference_step(steps.element_spec)
pairs = pattern_dataset.PatternDataset(
    input_dataset=steps, configs=[structured_writer.create_config({"a": ref["d"][-2], "b": ref["d"][-1]}, "t")],
    respect_episode_boundaries=True, is_end_of_episode=lambda step: step["last"])
assert [(int(p["a"]), int(p["b"])) for p in pairs] == [(0, 1), (1, 2), (3, 4), (4, 5)]
server.stop()
print("reverb modules ran on gear")
"""

LINGERING = r"""
import numpy as np
import tensorflow as tf
import reverb
from reverb import trajectory_dataset

server = reverb.Server([reverb.Table("t", sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                                     max_size=10, rate_limiter=reverb.rate_limiters.MinSize(1))])
address = f"localhost:{server.port}"
reverb.Client(address).insert(np.float32(1), {"t": 1.0})
dataset = tf.data.Dataset.range(3).interleave(
    lambda _: trajectory_dataset.TrajectoryDataset(address, "t", tf.float32, tf.TensorShape([1]), 3),
    cycle_length=3, num_parallel_calls=3).batch(3)
iterator = iter(dataset)
for _ in range(3):
    next(iterator)
empty = trajectory_dataset.TrajectoryDataset(address, "t", tf.float32, tf.TensorShape([1]), 3)
server.stop()  # the readers wait on a daemon that is gone; the script ends without closing anything
print("done", flush=True)
"""


LIMITED_READERS = r"""
import numpy as np
import tensorflow as tf
import reverb
from tf_agents.replay_buffers import reverb_replay_buffer

server = reverb.Server([reverb.Table("t", sampler=reverb.selectors.Prioritized(1.0), remover=reverb.selectors.Fifo(),
                                     max_size=3, max_times_sampled=10, rate_limiter=reverb.rate_limiters.MinSize(1))])
client = reverb.Client(f"localhost:{server.port}")
for priority in (0.0, 1.0, 2.0):
    client.insert(np.float32(priority), {"t": priority})
replay = reverb_replay_buffer.ReverbReplayBuffer(tf.TensorSpec([], tf.float32), table_name="t",
                                                 sequence_length=None, local_server=server)
iterator = iter(replay.as_dataset(sample_batch_size=3, num_parallel_calls=3))
counts = {}
for _ in range(10):  # 30 samples: every item's budget
    _, info = next(iterator)
    for key in info.key.numpy().ravel().tolist():
        counts[key] = counts.get(key, 0) + 1
assert sorted(counts.values()) == [10, 10, 10], counts
assert client.server_info()["t"].current_size == 0
print("ten batches", flush=True)
"""


def _run(script: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "alias" / "reverb"), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def test_reverb_dataset_and_structured_writer_modules(tmp_path):
    run = _run(DATASET_MODULES, tmp_path, timeout=240)
    assert run.returncode == 0 and "reverb modules ran on gear" in run.stdout, run.stderr[-4000:]


@pytest.mark.skipif(importlib.util.find_spec("tf_agents") is None, reason="tf_agents is not installed")
def test_tf_agents_readers_of_a_max_times_sampled_table_get_every_sample(tmp_path):
    """Three parallel readers, batches of 3: ten batches, each item sampled exactly its 10 times (as Reverb)."""
    run = _run(LIMITED_READERS, tmp_path, timeout=240)
    assert run.returncode == 0 and "ten batches" in run.stdout, run.stderr[-4000:]


def test_a_process_with_tf_datasets_still_reading_exits(tmp_path):
    start = time.monotonic()
    try:
        run = _run(LINGERING, tmp_path, timeout=180 + EXIT_BOUND_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the process did not exit: {(e.stderr or b'')[-3000:]!r}") from None
    assert "done" in run.stdout, run.stderr[-4000:]
    assert time.monotonic() - start < 180 + EXIT_BOUND_S
