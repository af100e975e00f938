"""Acme's adders into tables with Acme's tf.TensorSpec signatures, read back by tf.data (`make test-tf`).

The adders of tests/support/reverb_users.py (Acme's, retold, ``import reverb``
through the alias) write N-step transitions and StructuredWriter items into
tables whose signatures are built the way Acme builds them (named
``tf.TensorSpec``s, a namedtuple with an empty ``extras``); the learner side is
Acme's ``make_reverb_dataset``: ``TrajectoryDataset.from_table_signature`` then
``batch``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.tf
tf = pytest.importorskip("tensorflow")
pytest.importorskip("tree")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "alias" / "reverb"))

import reverb

from tests.support import reverb_users as users

OBS = tf.TensorSpec([3], tf.float32, name="observation")


def _scalar(name: str, dtype) -> tf.TensorSpec:
    return tf.TensorSpec([], tf.as_dtype(np.dtype(dtype)), name=name)


STEP_SPEC = users.create_step_spec(OBS, tf.TensorSpec([], tf.int32, name="action"), _scalar)
N_STEP_CONFIGS = users.n_step_transition_configs(STEP_SPEC, 2, table="structured")
TRANSITION_SIGNATURE = users.Transition(
    observation=OBS, action=tf.TensorSpec([], tf.int32, "action"), reward=tf.TensorSpec([], tf.float32, "reward"),
    discount=tf.TensorSpec([], tf.float32, "discount"), next_observation=tf.TensorSpec([3], tf.float32, "next"),
    extras=())


@pytest.fixture(scope="module")
def server():
    sel, rl = reverb.selectors, reverb.rate_limiters
    srv = reverb.Server(tables=[
        reverb.Table(name=users.DEFAULT_PRIORITY_TABLE, sampler=sel.Prioritized(0.6), remover=sel.Fifo(), max_size=100,
                     rate_limiter=rl.MinSize(1), signature=TRANSITION_SIGNATURE),
        reverb.Table(name="structured", sampler=sel.Uniform(), remover=sel.Fifo(), max_size=100,
                     rate_limiter=rl.MinSize(1),
                     signature=reverb.structured_writer.infer_signature(N_STEP_CONFIGS, STEP_SPEC)),
    ])
    client = reverb.Client(f"localhost:{srv.port}")
    adder = users.NStepTransitionAdder(client, n_step=2, discount=0.9)
    structured = users.StructuredAdder(client, max_in_flight_items=2, configs=N_STEP_CONFIGS, step_spec=STEP_SPEC)
    for a in (adder, structured):
        a.add_first(users.first_timestep())
        for action, timestep in users.episode(5):
            a.add(action, timestep)
    adder.close()
    structured.close()
    yield srv
    srv.stop()


def test_server_info_gives_back_acmes_signature(server):
    signature = reverb.Client(f"localhost:{server.port}").server_info()[users.DEFAULT_PRIORITY_TABLE].signature
    assert type(signature).__name__ == "Transition" and signature._fields == users.Transition._fields
    assert signature.extras == ()
    assert signature.observation == tf.TensorSpec([3], tf.float32, "observation")


def test_make_reverb_dataset_on_n_step_transitions(server):
    dataset = reverb.TrajectoryDataset.from_table_signature(
        server_address=f"localhost:{server.port}", table=users.DEFAULT_PRIORITY_TABLE,
        max_in_flight_samples_per_worker=4)
    dataset = dataset.batch(3, drop_remainder=True).prefetch(1)
    spec = dataset.element_spec
    assert spec.data.extras == () and spec.data.observation.shape.as_list() == [3, 3]
    assert spec.info.key.dtype == tf.uint64 and spec.info.probability.dtype == tf.float64
    sample = next(iter(dataset))
    transition = sample.data
    first = transition.observation.numpy()[:, 0]
    last = transition.next_observation.numpy()[:, 0]
    assert np.all((last - first >= 1) & (last - first <= 2))
    np.testing.assert_array_equal(transition.action.numpy(), first.astype(np.int32))
    assert transition.reward.dtype == tf.float32


def test_structured_adder_items_through_tf_data(server):
    dataset = reverb.TrajectoryDataset.from_table_signature(
        server_address=f"localhost:{server.port}", table="structured", max_in_flight_samples_per_worker=2)
    spec = dataset.element_spec.data
    assert spec.observation.shape.as_list() == [2, 3]   # first and last observation
    assert spec.reward.shape.as_list() == [None]          # 1 or 2 rewards
    for sample in dataset.take(6):
        obs = sample.data.observation.numpy()[:, 0]
        assert sample.data.reward.shape[0] == obs[1] - obs[0]
