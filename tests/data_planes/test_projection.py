"""Column projection: ``columns=`` moves only the wanted fields' bytes on every CPU plane (shm gathers with
NumPy, rdma over the emulated NIC, inline answers), counted; the values are the stored ones; the batch's
structure holds only what was asked; unknown paths refused before anything is picked."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import gear_client as reverb
from gear_client.data_planes.sampler import PlaneSampler
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from gear_contract.projection import column_indices, leaf_paths, prune_structure
from gear_kernels import gpu_available
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.rdma_emulation import EmulatedConnection, EmulatedRdmaServer
from tests.support.trajectories import fill, make_item

pytestmark = pytest.mark.timeout(120)
T, D, N = 8, 64, 6
# bytes of one item per field (columns: action int64[T], obs float32[T, D], reward float32[T])
FIELD_BYTES = {"action": T * 8, "obs": T * D * 4, "reward": T * 4}


@pytest.fixture(scope="module")
def daemon():
    server = EmulatedRdmaServer()
    d = start_daemon(table_config("t", 32), rdma=server)
    try:
        fill(d.tables["t"], 24, length=T, dim=D)
        yield d
    finally:
        d.stop()


def rdma_sampler(d, **kwargs) -> PlaneSampler:
    return PlaneSampler(d.address(), "t", host_id="learner-on-another-host", planes=["rdma"],
                        rdma_connection=lambda: EmulatedConnection(num_qps=2), **kwargs)


def shm_sampler(d, **kwargs) -> PlaneSampler:
    return PlaneSampler(d.address(), "t", planes=["shm"], **kwargs)


def inline_sampler(d, **kwargs) -> PlaneSampler:
    return PlaneSampler(d.address(), "t", planes=["inline"], **kwargs)


def moved(sampler: PlaneSampler) -> int:
    """The bytes the sampler's plane moved: read from the segment (shm, rdma) or received (inline)."""
    return sampler.bytes_moved


def assert_values(batch, fields: list[str]) -> None:
    got = nest.unflatten(batch.structure, batch.columns)
    assert sorted(got) == sorted(fields)
    for i, key in enumerate(batch.keys.tolist()):
        item = make_item(int(key), T, D)
        for field in fields:
            assert np.array_equal(np.asarray(got[field][i]), item[field]), (key, field)


@pytest.mark.parametrize("make", [shm_sampler, rdma_sampler], ids=["shm", "rdma"])
@pytest.mark.parametrize("columns, fields", [(["obs"], ["obs"]), ("reward", ["reward"]),
                                             ({"action": True, "reward": True}, ["action", "reward"])])
def test_reading_planes_read_only_the_wanted_columns(daemon, make, columns, fields):
    with make(daemon, columns=columns) as s:
        batch = s.sample(N)
        assert s.kind == make.__name__[:-len("_sampler")]
        assert_values(batch, fields)
        assert moved(s) == N * sum(FIELD_BYTES[f] for f in fields)  # the others' bytes were never touched
    with make(daemon) as whole:
        whole.sample(N)
        assert moved(whole) == N * sum(FIELD_BYTES.values())


def test_inline_answers_carry_only_the_wanted_columns(daemon):
    with inline_sampler(daemon, columns=["reward"]) as s:
        batch = s.sample(N)
        assert s.kind == "inline"
        assert_values(batch, ["reward"])
        projected = moved(s)
    with inline_sampler(daemon) as whole:
        whole.sample(N)
        full = moved(whole)
    left_out = N * (FIELD_BYTES["obs"] + FIELD_BYTES["action"])
    assert projected >= N * FIELD_BYTES["reward"]
    assert full - projected >= left_out  # what the projection left out never crossed the socket
    assert projected < N * FIELD_BYTES["reward"] + 2048  # beyond the wanted bytes: the infos and headers only


def test_a_dataset_with_columns_gives_the_pruned_structure(daemon):
    with reverb.TrajectoryDataset(daemon.address(), "t", batch_size=4, max_samples=8, columns="obs") as ds:
        batches = list(ds.batches())
    assert len(batches) == 2
    for batch in batches:
        assert_values(batch, ["obs"])


@pytest.mark.parametrize("make", [shm_sampler, rdma_sampler, inline_sampler], ids=["shm", "rdma", "inline"])
def test_an_unknown_path_is_refused_naming_it_and_takes_nothing(daemon, make):
    table = daemon.tables["t"]
    before = int(table.meta.times_sampled[table.meta.valid].sum())
    with make(daemon, columns=["obs", "nope/x"]) as s:
        with pytest.raises(ValueError, match="unknown field path 'nope/x'"):
            s.sample(N)
    if make is inline_sampler:  # resolved before the call: nothing picked
        assert int(table.meta.times_sampled[table.meta.valid].sum()) == before
    with pytest.raises(TypeError, match="columns must be"):
        make(daemon, columns=3)


def test_the_daemon_refuses_a_column_out_of_range_before_picking(daemon):
    table = daemon.tables["t"]
    before = int(table.meta.times_sampled[table.meta.valid].sum())
    with grpc.insecure_channel(daemon.address()) as channel:
        stub = pb_grpc.ReplayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Sample(pb.SampleRequest(table="t", num_samples=2, columns=[1, 7])))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "column 7" in caught.value.details()
    assert int(table.meta.times_sampled[table.meta.valid].sum()) == before


def test_paths_and_pruned_structures():
    structure = nest.structure_of({"obs": {"rgb": 0, "depth": 0}, "act": (0, 0), "r": 0})
    assert leaf_paths(structure) == ["act/0", "act/1", "obs/depth", "obs/rgb", "r"]
    assert column_indices(structure, "obs") == [2, 3]
    assert column_indices(structure, ["r", "act/1"]) == [1, 4]
    assert column_indices(structure, {"obs": {"rgb": 1}}) == [3]
    pruned = prune_structure(structure, [1, 3])
    assert nest.unflatten(pruned, ["a1", "rgb"]) == {"act": (None, "a1"), "obs": {"rgb": "rgb"}}
    with pytest.raises(ValueError, match="unknown field path 'obs/ir'"):
        column_indices(structure, "obs/ir")
    with pytest.raises(ValueError, match="names no field"):
        column_indices(structure, [])


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_shm_into_gpu_memory_gathers_only_the_wanted_columns(daemon):
    with shm_sampler(daemon, columns=["obs", "reward"], device="cuda") as s:
        batch = s.sample(N)
        assert moved(s) == N * (FIELD_BYTES["obs"] + FIELD_BYTES["reward"])
        got = nest.unflatten(batch.structure, [c.get() for c in batch.columns])
    assert sorted(got) == ["obs", "reward"]
    for i, key in enumerate(batch.keys.tolist()):
        item = make_item(int(key), T, D)
        assert np.array_equal(got["obs"][i], item["obs"]) and np.array_equal(got["reward"][i], item["reward"])


@pytest.mark.parametrize("planes", [None, []], ids=["shm", "inline"])
def test_client_sample_with_columns(daemon, planes):
    client = reverb.Client(daemon.address(), data_planes=planes)
    samples = list(client.sample("t", 5, emit_timesteps=False, unpack_as_table_signature=True,
                                 columns=["obs"]))
    assert len(samples) == 5
    for sample in samples:
        assert sorted(sample.data) == ["obs"]
        assert np.array_equal(sample.data["obs"], make_item(int(sample.info.key), T, D)["obs"])
    flat = next(client.sample("t", 1, emit_timesteps=False, columns="reward"))
    assert len(flat.data) == 1 and flat.data[0].shape == (T,)
    with pytest.raises(ValueError, match="unknown field path 'nope'"):
        next(client.sample("t", 1, columns="nope"))
