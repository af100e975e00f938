"""Third-party Reverb code run on gear, as a user would run it.

Two ways in, both unmodified Reverb code: the adders and observers of
``tests/support/reverb_users.py`` (Acme's reverb adders, TF-Agents' observers, retold) say
``import reverb`` and find gear's opt-in alias (alias/reverb, put on the path
here as ``pip install ./alias/reverb`` would); the tutorial-style tests below
say ``import gear_client as reverb``. Each test checks what the item holds,
the SampleInfo and TableInfo fields such code reads, and the errors it catches.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tree", reason="dm-tree (Acme's and Reverb's nest library) is a dev dependency")

ALIAS_DIR = Path(__file__).resolve().parents[2] / "alias" / "reverb"
if importlib.util.find_spec("reverb") is None:  # what `pip install ./alias/reverb` provides
    sys.path.insert(0, str(ALIAS_DIR))

import gear_client as reverb
from tests.support import reverb_users as users
from tests.support.compat import gear_only

pytestmark = gear_only

OBS = reverb.specs.TensorSpec([3], np.float32)


def _scalar(name: str, dtype) -> reverb.specs.TensorSpec:
    return reverb.specs.TensorSpec([], dtype, name=name)


STEP_SPEC = users.create_step_spec(OBS, reverb.specs.TensorSpec([], np.int32, name="action"), _scalar)
N_STEP = 2
STRUCTURED_N_STEP = users.n_step_transition_configs(STEP_SPEC, N_STEP, table="structured_n_step")
STRUCTURED_SEQ = users.sequence_configs(STEP_SPEC, 3, 2, table="structured_seq")
TRANSITION_SIGNATURE = users.Transition(
    observation=OBS, action=reverb.specs.TensorSpec([], np.int32), reward=reverb.specs.TensorSpec([], np.float32),
    discount=reverb.specs.TensorSpec([], np.float32), next_observation=OBS, extras=())
TFA_SIGNATURE = users.TFAgentsTrajectory(
    step_type=reverb.specs.TensorSpec([None], np.int32),
    observation={"pixels": reverb.specs.TensorSpec([None, 2, 2], np.uint8),
                 "velocity": reverb.specs.TensorSpec([None], np.float32)},
    action=reverb.specs.TensorSpec([None], np.int64), policy_info=(),
    next_step_type=reverb.specs.TensorSpec([None], np.int32), reward=reverb.specs.TensorSpec([None], np.float32),
    discount=reverb.specs.TensorSpec([None], np.float32))


def _one_shot(name: str, signature=None) -> reverb.Table:
    """A table that gives back every item once, in insertion order (reads all a writer wrote)."""
    sel = reverb.selectors
    return reverb.Table(name=name, sampler=sel.Fifo(), remover=sel.Fifo(), max_size=1000,
                        rate_limiter=reverb.rate_limiters.MinSize(1), max_times_sampled=1, signature=signature)


@pytest.fixture(scope="module")
def server():
    sel, rl = reverb.selectors, reverb.rate_limiters
    srv = reverb.Server(tables=[
        _one_shot("transitions", TRANSITION_SIGNATURE),
        _one_shot("sequences"),
        _one_shot("structured_n_step", reverb.structured_writer.infer_signature(STRUCTURED_N_STEP, STEP_SPEC)),
        _one_shot("structured_seq"),
        _one_shot("tfa_fifo", TFA_SIGNATURE),
        reverb.Table("tfa_uniform", sel.Uniform(), sel.Fifo(), 1000, rl.MinSize(1), signature=TFA_SIGNATURE),
        _one_shot("episodes_a"),
        _one_shot("episodes_b"),
        reverb.Table("my_table", sel.Prioritized(priority_exponent=0.8), sel.Fifo(), 100, rl.MinSize(1)),
        reverb.Table.queue("small_queue", 2),
    ])
    yield srv
    srv.stop()


@pytest.fixture
def address(server) -> str:
    return f"localhost:{server.port}"


@pytest.fixture
def client(address):
    c = reverb.Client(address)
    for name in c.server_info():
        c.reset(name)
    return c


def _drain(client, table: str, n: int, **kwargs) -> list:
    """All ``n`` items of a one-shot table, in insertion order."""
    return [next(client.sample(table, emit_timesteps=False, **kwargs)) for _ in range(n)]


# Acme ----------------------------------------------------------------------------------------------------------


def _n_step_expected(length: int, n: int, gamma: float) -> list[tuple[int, int, float, float]]:
    """(first obs, last obs, n-step return, total discount) of Acme's N-step transitions of one episode."""
    pairs = [(max(0, t - n), t) for t in range(1, length + 1)] + [(i, length) for i in range(max(0, length - n) + 1,
                                                                                              length)]
    out = []
    for i, j in pairs:
        rewards = [float(k + 1) for k in range(i, j)]
        discounts = [0.0 if k == length - 1 else 1.0 for k in range(i, j)]
        ret, disc = rewards[0], discounts[0]
        for k in range(1, j - i):
            disc *= gamma
            ret += rewards[k] * disc
            disc *= discounts[k]
        out.append((i, j, ret, disc))
    return out


def _run_episode(adder, length: int) -> None:
    adder.add_first(users.first_timestep())
    for action, timestep in users.episode(length):
        adder.add(action, timestep)


def test_acme_n_step_transition_adder(client):
    """Partial steps, positive history indices, ``[a:b].numpy()``, a namedtuple item with an empty ``extras``."""
    gamma = 0.5
    adder = users.NStepTransitionAdder(client, n_step=N_STEP, discount=gamma,
                                       priority_fns={"transitions": lambda t: float(t.reward) + 1.0})
    _run_episode(adder, 4)
    _run_episode(adder, 1)
    adder.close()
    expected = _n_step_expected(4, N_STEP, gamma) + _n_step_expected(1, N_STEP, gamma)
    info = client.server_info()["transitions"]
    assert info.current_size == len(expected) == 6
    assert info.num_episodes == 2
    samples = _drain(client, "transitions", len(expected), unpack_as_table_signature=True)
    for sample, (i, j, ret, disc) in zip(samples, expected, strict=True):
        t = sample.data
        assert type(t).__name__ == "Transition" and t._fields == users.Transition._fields
        assert t.extras == ()
        np.testing.assert_array_equal(t.observation, np.full(3, i, np.float32))
        np.testing.assert_array_equal(t.next_observation, np.full(3, j, np.float32))
        assert t.action.dtype == np.int32 and int(t.action) == i
        assert t.reward.dtype == np.float32 and float(t.reward) == pytest.approx(ret)
        assert float(t.discount) == pytest.approx(disc)
        assert sample.info.priority == pytest.approx(ret + 1.0)


def test_acme_sequence_adder_zero_pads_the_last_sequence(client):
    """``itemgetter(slice(-L-1, -1))`` over the whole history mid-episode, zero rows appended at the end."""
    adder = users.SequenceAdder(client, sequence_length=3, period=2, priority_fns={"sequences": None})
    _run_episode(adder, 5)
    adder.close()
    samples = _drain(client, "sequences", 3)
    obs_rows = [[int(row[0]) for row in s.data[0]] for s in samples]   # data: the Trajectory's leaves in order
    assert obs_rows == [[0, 1, 2], [2, 3, 4], [4, 5, 0]]
    actions = [list(s.data[1]) for s in samples]
    assert actions == [[0, 1, 2], [2, 3, 4], [4, 0, 0]]     # the last real row's action is the zero "dummy" step
    start_of_episode = samples[0].data[4]
    assert start_of_episode.dtype == np.bool_ and list(start_of_episode) == [True, False, False]
    assert all(s.info.priority == 1.0 for s in samples)


def test_acme_structured_adder_n_step_configs(client):
    """Acme's StructuredAdder with its N-step configs: strided ``x[-(n+1)::n]`` references, None holes, conditions."""
    adder = users.StructuredAdder(client, max_in_flight_items=2, configs=STRUCTURED_N_STEP, step_spec=STEP_SPEC)
    _run_episode(adder, 4)
    adder.close()
    expected = sorted((i, j) for i, j, _, _ in _n_step_expected(4, N_STEP, 0.5))
    size = client.server_info()["structured_n_step"].current_size
    assert size == len(expected)
    got = []
    for s in _drain(client, "structured_n_step", size, unpack_as_table_signature=True):
        traj = s.data
        first, last = (int(row[0]) for row in traj.observation)
        assert traj.observation.shape == (2, 3) and traj.action.shape == (1,)
        assert len(traj.reward) == last - first and list(traj.reward) == [k + 1.0 for k in range(first, last)]
        got.append((first, last))
    assert sorted(got) == expected


def test_acme_structured_sequence_configs_truncate(client):
    adder = users.StructuredAdder(client, max_in_flight_items=2, configs=STRUCTURED_SEQ, step_spec=STEP_SPEC)
    _run_episode(adder, 5)
    adder.close()
    size = client.server_info()["structured_seq"].current_size
    obs = sorted([int(row[0]) for row in s.data[0]] for s in _drain(client, "structured_seq", size))
    assert obs == [[0, 1, 2], [2, 3, 4], [4, 5]]


def test_acme_structured_adder_refuses_add_before_add_first(client):
    adder = users.StructuredAdder(client, max_in_flight_items=2, configs=STRUCTURED_SEQ, step_spec=STEP_SPEC)
    with pytest.raises(ValueError, match="add_first"):
        adder.add(np.int32(0), users.episode(2)[0][1])


def test_acme_learner_updates_priorities_with_numpy_keys(client, address):
    """Learners hand back the batch's uint64 keys and float32 priorities as a dict of NumPy scalars."""
    for k in range(4):
        client.insert(np.float32(k), priorities={"my_table": 1.0})
    with reverb.TrajectoryDataset(address, "my_table", batch_size=4, max_samples=4) as dataset:
        batch = next(iter(dataset))
    keys = batch.info.key
    assert isinstance(keys, np.ndarray) and keys.dtype == np.uint64
    new = np.arange(1, 5, dtype=np.float32) * 10
    updates = dict(zip(keys, new, strict=True))   # a batch may hold a key twice: the last one wins
    client.mutate_priorities(table="my_table", updates=updates)
    seen = {s.info.key: s.info.priority for s in client.sample("my_table", num_samples=40, emit_timesteps=False)}
    assert seen == {k: float(updates.get(np.uint64(k), 1.0)) for k in seen}


# TF-Agents ------------------------------------------------------------------------------------------------------


def test_tf_agents_trajectory_observer_windows_into_two_tables(client):
    observer = users.ReverbAddTrajectoryObserver(client, ["tfa_fifo", "tfa_uniform"], sequence_length=2,
                                                 priority=1)
    for step in users.tf_agents_episode(4):
        observer(step)
    observer.flush()
    infos = client.server_info()
    assert infos["tfa_fifo"].current_size == infos["tfa_uniform"].current_size == 3   # ReverbReplayBuffer.num_frames
    samples = _drain(client, "tfa_fifo", 3, unpack_as_table_signature=True)
    for start, sample in enumerate(samples):
        traj = sample.data
        assert type(traj).__name__ == "TFAgentsTrajectory" and traj.policy_info == ()
        assert traj.observation["pixels"].shape == (2, 2, 2) and traj.observation["pixels"].dtype == np.uint8
        assert list(traj.observation["velocity"]) == [start, start + 1]
        assert traj.action.dtype == np.int64 and list(traj.step_type) == [0 if start == 0 else 1, 1 if start < 2 else 2]
        assert isinstance(sample.info.priority, float) and sample.info.priority == 1.0
    uniform = next(client.sample("tfa_uniform", emit_timesteps=False))
    assert uniform.info.probability == pytest.approx(1 / 3) and uniform.info.table_size == 3
    observer.close()


def test_tf_agents_trajectory_observer_pads_the_episode_end(client):
    observer = users.ReverbAddTrajectoryObserver(client, "tfa_fifo", sequence_length=3, pad_end_of_episodes=True)
    for step in users.tf_agents_episode(3):
        observer(step)
    observer.flush()
    size = client.server_info()["tfa_fifo"].current_size
    rows = [s.data for s in _drain(client, "tfa_fifo", size, unpack_as_table_signature=True)]
    assert [list(r.observation["velocity"]) for r in rows] == [[0, 1, 2], [1, 2, 0], [2, 0, 0]]
    assert list(rows[-1].step_type) == [2, 2, 2]
    observer.close()


def test_tf_agents_episode_observer_items_of_varying_length(client):
    observer = users.ReverbAddEpisodeObserver(client, ["episodes_a", "episodes_b"], max_sequence_length=6)
    for length in (4, 2):
        for step in users.tf_agents_episode(length):
            observer(step)
    observer.flush()
    for table in ("episodes_a", "episodes_b"):
        lengths = [len(s.data[0]) for s in _drain(client, table, 2)]
        assert lengths == [4, 2]
    observer.close()


def test_tf_agents_replay_buffer_clear_and_size(client):
    """ReverbReplayBuffer.clear is Client.reset; num_frames reads TableInfo.current_size."""
    observer = users.ReverbAddTrajectoryObserver(client, "tfa_uniform", sequence_length=2)
    for step in users.tf_agents_episode(3):
        observer(step)
    observer.flush()
    assert client.server_info()["tfa_uniform"].current_size == 2
    client.reset("tfa_uniform")
    info = client.server_info()["tfa_uniform"]
    assert info.current_size == 0 and info.rate_limiter_info.insert_stats.completed == 0
    observer.close()


# Reverb's README and tutorials (``import gear_client as reverb``) -------------------------------------------------


def test_readme_insert_and_sample_timesteps(client):
    client.insert([np.zeros((3, 3)), np.ones((3, 3), np.int32)], priorities={"my_table": 1.0})
    samples = list(client.sample("my_table", num_samples=2))
    assert len(samples) == 2
    for timesteps in samples:        # emit_timesteps=True: a list of per-step samples
        assert isinstance(timesteps, list) and len(timesteps) == 1
        step = timesteps[0]
        zeros, ones = step.data
        assert zeros.shape == (3, 3) and zeros.dtype == np.float64 and ones.dtype == np.int32
        info = step.info
        assert isinstance(info.key, int) and isinstance(info.probability, float)
        assert isinstance(info.table_size, int) and isinstance(info.priority, float)
        assert isinstance(info.times_sampled, int)
        assert (info.probability, info.table_size, info.priority) == (1.0, 1, 1.0)
    assert [s[0].info.times_sampled for s in samples] == [1, 2]


def test_tutorial_python_scalars_keep_numpy_default_dtypes(client):
    with client.trajectory_writer(num_keep_alive_refs=3) as writer:
        writer.append({"a": 2, "b": 12.5})
        writer.append({"a": 3, "b": 13.5})
        writer.create_item(table="episodes_a", priority=1.5,
                           trajectory={"a": writer.history["a"][:], "b": writer.history["b"][-1]})
    sample = next(client.sample("episodes_a", emit_timesteps=False))
    a, b = sample.data     # no signature: the leaves in nest order
    assert a.dtype == np.int64 and list(a) == [2, 3]
    assert b.dtype == np.float64 and b.shape == () and float(b) == 13.5
    assert sample.info.priority == 1.5


def test_trajectory_columns_from_history_references(client):
    """Columns built by hand from the history's references (``list(column)``), with Reverb's shape and dtype."""
    with client.trajectory_writer(num_keep_alive_refs=3) as writer:
        writer.append({"a": np.int32(1), "b": np.float32(100)})
        writer.append({"a": np.int32(2), "b": np.float32(200)})
        column = reverb.TrajectoryColumn(list(writer.history["a"]))
        assert column.shape == (2,) and column.dtype == np.int32 and len(column) == 2
        last_b = reverb.TrajectoryColumn([list(writer.history["b"])[-1]], squeeze=True)
        assert last_b.shape == () and last_b.is_squeezed
        writer.create_item("episodes_a", 1.0, {"all_a": column, "last_b": last_b})
    all_a, last_b = next(client.sample("episodes_a", emit_timesteps=False)).data
    assert list(all_a) == [1, 2] and float(last_b) == 200.0


def test_history_before_any_append_is_a_runtime_error(client):
    writer = client.trajectory_writer(num_keep_alive_refs=2)
    try:
        with pytest.raises(RuntimeError):
            writer.history  # noqa: B018
        assert writer.episode_steps == 0
    finally:
        writer.close()


def test_frame_stacking_items_share_the_frames(client):
    """Reverb's frame-stacking example: each item stacks the last 4 frames; the frames are stored once."""
    with client.trajectory_writer(num_keep_alive_refs=4) as writer:
        for t in range(6):
            writer.append({"frame": np.full((2, 2), t, np.uint8), "action": np.int64(t)})
            if writer.episode_steps >= 4:
                writer.create_item("episodes_a", 1.0, {"stacked": writer.history["frame"][-4:],
                                                       "action": writer.history["action"][-1]})
        writer.end_episode()
    stacks = [s.data for s in _drain(client, "episodes_a", 3)]
    assert [int(a) for a, _ in stacks] == [3, 4, 5]
    assert [[int(f[0, 0]) for f in frames] for _, frames in stacks] == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]


def test_legacy_writer_readme_example(client):
    with client.writer(max_sequence_length=3) as writer:
        writer.append([np.zeros(2, np.float32), np.int64(0)])
        writer.create_item(table="episodes_a", num_timesteps=1, priority=1.0)
        writer.append_sequence([np.ones((2, 2), np.float32), np.array([1, 2], np.int64)])
        writer.create_item(table="episodes_a", num_timesteps=3, priority=1.0)
    one, three = _drain(client, "episodes_a", 2)
    assert one.data[0].shape == (1, 2) and list(three.data[1]) == [0, 1, 2]


def test_flush_and_end_episode_time_out_on_a_full_queue(client):
    """A writer blocked by the rate limiter raises DeadlineExceededError (reverb.errors and top level)."""
    writer = client.trajectory_writer(num_keep_alive_refs=1)
    try:
        for t in range(3):
            writer.append({"x": np.int32(t)})
            writer.create_item("small_queue", 1.0, {"x": writer.history["x"][-1]})
        with pytest.raises(reverb.errors.DeadlineExceededError):
            writer.flush(timeout_ms=200)
        with pytest.raises(reverb.DeadlineExceededError):
            writer.end_episode(timeout_ms=200)
        assert next(client.sample("small_queue", emit_timesteps=False)).data == [0]
        writer.flush(timeout_ms=5000)
    finally:
        writer.close()
    assert client.server_info()["small_queue"].current_size == 2


def test_dataset_rate_limiter_timeout_ends_iteration(client, address):
    """TF-Agents' ``rate_limiter_timeout_ms``: an empty table ends the dataset instead of blocking forever."""
    with reverb.TrajectoryDataset(address, "small_queue", batch_size=1,
                                  rate_limiter_timeout_ms=200) as dataset:
        assert list(dataset) == []


def test_dataset_sample_info_dtypes_match_reverb(client, address):
    """Reverb's SampleInfo tensors: key uint64, probability float64, table_size int64, priority float64,
    times_sampled int32."""
    for k in range(2):
        client.insert(np.float32(k), priorities={"my_table": 1.0})
    with reverb.TrajectoryDataset(address, "my_table", batch_size=2, max_samples=2) as dataset:
        info = next(iter(dataset)).info
    assert {f: np.asarray(getattr(info, f)).dtype for f in ("key", "probability", "table_size", "priority",
                                                              "times_sampled")} == {
        "key": np.uint64, "probability": np.float64, "table_size": np.int64, "priority": np.float64,
        "times_sampled": np.int32}


def test_table_info_fields_read_by_learners(client):
    client.insert(np.float32(1), priorities={"my_table": 2.0})
    next(client.sample("my_table", emit_timesteps=False))
    info = client.server_info()["my_table"]
    assert isinstance(info, reverb.TableInfo)
    assert (info.name, info.max_size, info.current_size, info.max_times_sampled) == ("my_table", 100, 1, 0)
    assert info.rate_limiter_info.insert_stats.completed == 1
    assert info.rate_limiter_info.sample_stats.completed == 1
    assert info.num_unique_samples == 1
    assert info.signature is None
    assert info.sampler_options.HasField("prioritized")
    assert info.sampler_options.prioritized.priority_exponent == pytest.approx(0.8)
    assert info.remover_options.fifo


def test_checkpoint_restores_into_a_new_server(tmp_path):
    checkpointer = reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path))
    tables = [reverb.Table("kept", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10,
                           reverb.rate_limiters.MinSize(1))]
    first = reverb.Server(tables=tables, checkpointer=checkpointer)
    try:
        c = first.localhost_client()
        c.insert([np.arange(3, dtype=np.int16)], priorities={"kept": 3.0})
        path = c.checkpoint()
        assert isinstance(path, str) and path.startswith(str(tmp_path))
    finally:
        first.stop()
    second = reverb.Server(tables=[reverb.Table("kept", reverb.selectors.Fifo(), reverb.selectors.Fifo(), 10,
                                                reverb.rate_limiters.MinSize(1))],
                           checkpointer=reverb.checkpointers.DefaultCheckpointer(path=str(tmp_path)))
    try:
        s = next(second.localhost_client().sample("kept", emit_timesteps=False))
        assert s.info.priority == 3.0 and s.data[0].dtype == np.int16 and list(s.data[0][0]) == [0, 1, 2]
    finally:
        second.stop()


def test_server_wait_returns_after_stop_from_another_thread():
    server = reverb.Server(tables=[reverb.Table.queue("q", 1)])
    waiter = threading.Thread(target=server.wait)
    waiter.start()
    server.stop()
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_client_pickles_for_actor_processes(client):
    clone = pickle.loads(pickle.dumps(client))
    clone.insert(np.int8(5), priorities={"episodes_a": 1.0})
    assert int(next(client.sample("episodes_a", emit_timesteps=False)).data[0][0]) == 5



def test_optional_names_are_absent_not_broken_without_tensorflow():
    """``from reverb import *``, ``hasattr`` and ``getattr(..., None)`` work whether TensorFlow is installed or not."""
    namespace: dict = {}
    exec("from gear_client import *", namespace)  # noqa: S102 - what a user's star import does
    assert namespace["Client"] is reverb.Client and namespace["TrajectoryDataset"] is reverb.TrajectoryDataset
    has_tf = importlib.util.find_spec("tensorflow") is not None
    for name in ("TFClient", "ReplayDataset", "tf_datasets"):
        assert hasattr(reverb, name) is has_tf and (name in namespace) is has_tf
    if not has_tf:
        assert getattr(reverb, "TFClient", None) is None
        with pytest.raises(AttributeError, match="needs tensorflow"):
            reverb.ReplayDataset  # noqa: B018


def test_trajectory_writer_refuses_use_after_close(client):
    """append/create_item/flush after close() raise RuntimeError (as the legacy Writer does); close twice is fine."""
    writer = client.trajectory_writer(num_keep_alive_refs=2)
    writer.append({"x": np.float32(1)})
    ref = writer.history["x"][-1:]
    writer.close()
    try:
        with pytest.raises(RuntimeError, match="TrajectoryWriter is closed"):
            writer.append({"x": np.float32(2)})
        with pytest.raises(RuntimeError, match="TrajectoryWriter is closed"):
            writer.create_item("episodes_a", 1.0, {"x": ref})
        with pytest.raises(RuntimeError, match="TrajectoryWriter is closed"):
            writer.flush(timeout_ms=2000)
        writer.close()
    finally:
        assert client.server_info()["episodes_a"].current_size == 0


def test_a_large_keep_alive_window_costs_nothing_until_used(client):
    import tracemalloc

    writer = client.trajectory_writer(num_keep_alive_refs=10**7)
    try:
        tracemalloc.start()
        writer.append({"x": np.float32(1)})
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 8 * 2**20, f"one scalar step allocated {peak / 2**20:.0f} MiB"
    finally:
        writer.close()


def test_a_wide_item_does_not_stall_the_daemon(client, address):
    """An item of 4,000 columns (a flattened observation dict) goes in while another client is served promptly.

    The item check named every column by walking the whole structure once per column (quadratic): 4,000
    columns held the daemon's event loop for about 13 s, 20,000 for minutes.
    """
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        other = reverb.Client(address)
        while not done.is_set():
            start = time.monotonic()
            other.server_info(timeout=60)
            latencies.append(time.monotonic() - start)
            done.wait(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            writer.append({f"k{i}": np.float32(i) for i in range(4000)})
            writer.create_item("episodes_a", 1.0, {k: v[-1] for k, v in writer.history.items()})
            writer.flush(timeout_ms=30_000)
    finally:
        done.set()
        poller.join()
    assert max(latencies) < 3.0, f"server_info waited {max(latencies):.1f} s behind the wide item"
    data = next(client.sample("episodes_a", emit_timesteps=False)).data
    assert len(data) == 4000
