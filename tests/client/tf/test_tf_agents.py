"""TF-Agents' own ReverbReplayBuffer and ReverbAddTrajectoryObserver on gear, unchanged (`make test-tf`).

The library's code says ``import reverb``; the alias distribution (alias/reverb,
from the source tree) gives it gear. Skipped where tf_agents is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Found, not imported: tf_agents needs TF_USE_LEGACY_KERAS=1 before TensorFlow loads (the script sets it).
pytestmark = [pytest.mark.tf,
              pytest.mark.skipif(importlib.util.find_spec("tf_agents") is None, reason="tf_agents is not installed")]

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import numpy as np
import tensorflow as tf
import reverb
from tf_agents.replay_buffers import reverb_replay_buffer, reverb_utils
from tf_agents.specs import tensor_spec
from tf_agents.trajectories import trajectory

data_spec = trajectory.Trajectory(
    step_type=tensor_spec.TensorSpec([], tf.int32, "step_type"), observation=tensor_spec.TensorSpec([3], tf.float32),
    action=tensor_spec.BoundedTensorSpec([], tf.int64, 0, 4), policy_info=(),
    next_step_type=tensor_spec.TensorSpec([], tf.int32, "next_step_type"),
    reward=tensor_spec.TensorSpec([], tf.float32, "reward"),
    discount=tensor_spec.BoundedTensorSpec([], tf.float32, 0, 1, "discount"))
signature = tensor_spec.add_outer_dim(tensor_spec.from_spec(data_spec))
server = reverb.Server([reverb.Table("uniform_table", max_size=1000, sampler=reverb.selectors.Uniform(),
                                     remover=reverb.selectors.Fifo(), rate_limiter=reverb.rate_limiters.MinSize(1),
                                     signature=signature)])
replay = reverb_replay_buffer.ReverbReplayBuffer(data_spec, table_name="uniform_table", sequence_length=2,
                                                 local_server=server)
observer = reverb_utils.ReverbAddTrajectoryObserver(replay.py_client, "uniform_table", sequence_length=2)
for i in range(20):
    observer(trajectory.Trajectory(step_type=np.int32(1), observation=np.full(3, i, np.float32),
                                   action=np.int64(i % 5), policy_info=(), next_step_type=np.int32(1),
                                   reward=np.float32(i), discount=np.float32(1)))
observer.flush()
assert replay.num_frames() == 19, replay.num_frames()
dataset = replay.as_dataset(sample_batch_size=4, num_steps=2, num_parallel_calls=2).prefetch(2)
for experience, info in dataset.take(3):
    assert experience.observation.shape == (4, 2, 3)
    rewards = experience.reward.numpy()
    assert (rewards[:, 1] - rewards[:, 0] == 1).all(), rewards
    np.testing.assert_array_equal(experience.observation.numpy()[:, :, 0], rewards)
observer.close()
server.stop()
print("tf-agents ran on gear")
"""


def test_tf_agents_reverb_replay_buffer_runs_unchanged(tmp_path):
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "alias" / "reverb"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert run.returncode == 0 and "tf-agents ran on gear" in run.stdout, run.stderr[-4000:]
