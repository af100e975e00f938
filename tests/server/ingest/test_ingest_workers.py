"""Ingest workers on loopback: network-path actors stream to worker processes that write into the
table's segment through the insert plane; the daemon keeps the index."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.insert_plane import finish, items_in_insert_order, run_actor, slots_accounted, start
from tests.support.plane_daemon import table_config
from tests.support.trajectories import item_ok, make_item

NETWORK_PATH = {"GEAR_INSERT_PLANE": "0"}  # actors on this host that behave as remote ones


def test_network_actors_insert_through_the_ingest_workers_and_the_items_are_correct():
    d = start(table_config("t", 128), workers=2)
    try:
        ports = list(pb_grpc.ReplayServiceStub(grpc.insecure_channel(d.address())).ServerInfo(
            pb.ServerInfoRequest(), timeout=10).ingest_ports)
        assert len(ports) == 2 and d.port not in ports
        actors = [run_actor(d.address(), 1000 * (a + 1), 20, 8, 64, env=NETWORK_PATH, wait=False) for a in range(3)]
        assert not any(finish(a)["insert_plane"] for a in actors)
        table = d.tables["t"]
        assert table.size() == 60
        seeds = []
        for item in items_in_insert_order(table):
            assert item_ok(item["action"], item["obs"], item["reward"])
            seed = int(item["action"][0])
            want = make_item(seed, 8, 64)
            assert all(np.array_equal(item[k], want[k]) for k in want)
            seeds.append(seed)
        assert sorted(seeds) == [1000 * (a + 1) + i for a in range(3) for i in range(20)]
        # the workers committed (nearly) everything through the insert plane: the bytes never entered the daemon
        workers = list(d.ingest.pool.processes)
        worker_pids = {p.pid for p in workers}
        assert d.ingest.plane.items_committed >= 50
        assert d.ingest.plane.writer_pids <= worker_pids and d.ingest.plane.writer_pids
        assert slots_accounted(table)
    finally:
        d.stop()
    assert all(p.poll() is not None for p in workers)  # the workers stop with the daemon


def test_a_worker_refuses_bad_requests_and_goes_on_serving():
    d = start(table_config("t", 16), workers=1)
    try:
        port = d.ingest.ports()[0]
        channel = grpc.insecure_channel(f"localhost:{port}")
        stub = pb_grpc.ReplayServiceStub(channel)
        bad = pb.InsertStreamRequest(items=[pb.PrioritizedItem(key=1, table="t", priority=1.0, columns=[
            pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=9, offset=0, length=1)])],
            structure=pb.Structure(kind=pb.Structure.LEAF))])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.InsertStream(iter([bad]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown chunk 9" in e.value.details()
        unknown = pb.InsertStreamRequest(
            chunks=[pb.ChunkData(chunk_key=1, data=pb.Tensor(dtype="<f4", shape=[1], data=b"\0" * 4))],
            items=[pb.PrioritizedItem(key=1, table="nope", priority=1.0, structure=pb.Structure(kind=pb.Structure.LEAF),
                                      columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=1, length=1)])])])
        with pytest.raises(grpc.RpcError) as e:
            list(stub.InsertStream(iter([unknown]), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        result = run_actor(d.address(), 1, 5, 4, 4, env=NETWORK_PATH)
        assert not result["insert_plane"] and d.tables["t"].size() == 5
        channel.close()
    finally:
        d.stop()


def test_a_worker_batches_a_streams_requests_in_order_and_stops_at_a_bad_one():
    """Requests read ahead are inserted as batches: every good one before a bad request is acknowledged
    and in the table, in order; the bad one ends the stream (INVALID_ARGUMENT); nothing after it goes in."""
    d = start(table_config("t", 64), workers=1)
    try:
        port = d.ingest.ports()[0]
        channel = grpc.insecure_channel(f"localhost:{port}")
        stub = pb_grpc.ReplayServiceStub(channel)

        def good(key: int) -> pb.InsertStreamRequest:
            data = np.full(4, key, np.float32).tobytes()
            return pb.InsertStreamRequest(
                chunks=[pb.ChunkData(chunk_key=key, data=pb.Tensor(dtype="<f4", shape=[1, 4], data=data))],
                items=[pb.PrioritizedItem(key=key, table="t", priority=1.0,
                                          structure=pb.Structure(kind=pb.Structure.LEAF),
                                          columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=key, length=1)])])],
                release_chunk_keys=[key])

        bad = pb.InsertStreamRequest(items=[pb.PrioritizedItem(key=999, table="t", priority=1.0, columns=[
            pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=12345, offset=0, length=1)])],
            structure=pb.Structure(kind=pb.Structure.LEAF))])
        requests = [good(k) for k in range(1, 41)] + [bad] + [good(k) for k in range(41, 46)]
        acked: list[int] = []
        call = stub.InsertStream(iter(requests), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            for response in call:
                acked.extend(response.keys)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown chunk 12345" in e.value.details()
        assert acked == list(range(1, 41))
        table = d.tables["t"]
        assert table.size() == 40
        snap = table.snapshot()  # one step per item, oldest first: each item's row holds its key
        assert snap.arrays["lengths"].ravel().tolist() == [1] * 40
        assert snap.arrays["column/0"][:, 0].astype(int).tolist() == list(range(1, 41))
        channel.close()
    finally:
        d.stop()
