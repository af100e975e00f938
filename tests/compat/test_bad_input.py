"""Bad input, over raw gRPC and through the client: a clear error, and nothing lost.

Every test seeds the tables, sends something wrong, and then checks that the
daemon still serves and that its tables are exactly as before (TableInfo
counters, then every item's key, priority and bytes).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from tests.support.compat import (
    BACKEND,
    PROMPT_S,
    contents,
    counters,
    insert_request,
    raw_channel,
    raw_stub,
    reverb,
    spec,
    tensor,
    wait_until,
)

pytestmark = pytest.mark.skipif(BACKEND == "reverb", reason="gear's wire protocol and its bad-input guarantees")

if BACKEND != "reverb":
    import grpc

    from gear_contract._proto import replay_pb2 as pb

SEEDED = ("items", "signed", "fixed_len")
OBS = np.arange(6, dtype=np.float32).reshape(3, 2)


@pytest.fixture(scope="module")
def tables() -> list:
    """This module's server tables (overrides the shared set); uniform samplers so `contents` sees all."""
    sel, rl = reverb.selectors, reverb.rate_limiters
    return [
        reverb.Table("items", sel.Uniform(), sel.Fifo(), 100, rl.MinSize(1)),
        reverb.Table("signed", sel.Uniform(), sel.Fifo(), 100, rl.MinSize(1),
                     signature={"obs": spec((None, 2), np.float32)}),
        reverb.Table("fixed_len", sel.Uniform(), sel.Fifo(), 100, rl.MinSize(1),
                     signature={"obs": spec((3, 2), np.float32)}),
        reverb.Table("episodes", sel.Uniform(), sel.Fifo(), 10_000, rl.MinSize(1)),
    ]


def _snapshot(client) -> tuple[dict, dict]:
    items = {t: contents(client, t) for t in SEEDED}
    infos = client.server_info(timeout=PROMPT_S)
    return items, {t: counters(infos[t]) for t in SEEDED}


@pytest.fixture
def seeded(client):
    """Three items in `items` (float32[2] each), one 3-step item in `signed` and `fixed_len`."""
    for i in range(3):
        client.insert(np.arange(2, dtype=np.float32) + i, {"items": float(i + 1)})
    with client.trajectory_writer(3) as writer:
        for t in range(3):
            writer.append({"obs": OBS[t]})
        writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-3:]})
        writer.create_item("fixed_len", 1.0, {"obs": writer.history["obs"][-3:]})
    return _snapshot(client)


@contextlib.contextmanager
def unchanged(client, before):
    """The tables must be exactly as ``before`` after the block, and the daemon must answer."""
    yield
    items_before, counters_before = before
    infos = client.server_info(timeout=PROMPT_S)  # the daemon is alive
    assert {t: counters(infos[t]) for t in SEEDED} == counters_before
    assert {t: contents(client, t) for t in SEEDED} == items_before


def _rpc_error(fn, codes, match: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    error = info.value
    assert error.code() in codes, f"status {error.code()} ({error.details()}) not in {codes}"
    if match is not None:
        assert re.search(match, error.details() or "", re.IGNORECASE), error.details()
    return error


def _insert(stub, *requests):
    return list(stub.InsertStream(iter(requests), timeout=PROMPT_S))


INVALID = (grpc.StatusCode.INVALID_ARGUMENT,) if BACKEND != "reverb" else ()
NOT_FOUND = (grpc.StatusCode.NOT_FOUND,) if BACKEND != "reverb" else ()


# ------------------------------------------------------------ unknown table ----

def test_unknown_table_raw(server, client, seeded):
    stub = raw_stub(server)
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, insert_request("nope", key=1, priority=1.0, data=np.zeros(2, np.float32))),
                   NOT_FOUND, "nope")
        _rpc_error(lambda: list(stub.Sample(pb.SampleRequest(table="nope", num_samples=1), timeout=PROMPT_S)),
                   NOT_FOUND, "nope")
        _rpc_error(lambda: stub.MutatePriorities(pb.MutatePrioritiesRequest(table="nope", delete_keys=[1]),
                                                 timeout=PROMPT_S), NOT_FOUND, "nope")
        _rpc_error(lambda: stub.Reset(pb.ResetRequest(table="nope"), timeout=PROMPT_S), NOT_FOUND, "nope")


def test_unknown_table_client(client, seeded):
    with unchanged(client, seeded):
        with pytest.raises(ValueError, match="nope"):
            client.insert(np.zeros(2, np.float32), {"nope": 1.0})
        with pytest.raises(RuntimeError, match="nope"):
            list(client.sample("nope", 1))
        with pytest.raises(RuntimeError, match="nope"):
            client.mutate_priorities("nope", deletes=[1])
        with pytest.raises(RuntimeError, match="nope"):
            client.reset("nope")


# ------------------------------------------------------ signature and layout ----

def _signed_request(table: str, obs: np.ndarray, key: int = 77):
    """An item of ``obs`` (all its steps) with the structure {'obs': leaf}."""
    chunk = pb.ChunkData(chunk_key=5, data=tensor(obs), episode_id=9, episode_step=0)
    item = pb.PrioritizedItem(
        key=key, table=table, priority=1.0,
        structure=pb.Structure(kind=pb.Structure.DICT, keys=["obs"], children=[pb.Structure(kind=pb.Structure.LEAF)]),
        columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=5, offset=0, length=obs.shape[0])])],
    )
    return pb.InsertStreamRequest(chunks=[chunk], items=[item])


@pytest.mark.parametrize("obs", [OBS.astype(np.float64), np.zeros((3, 4), np.float32), np.zeros((3,), np.float32)],
                         ids=["dtype", "shape", "rank"])
def test_item_breaking_the_signature_raw(server, client, seeded, obs):
    stub = raw_stub(server)
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, _signed_request("signed", obs)), INVALID, "obs|dtype|shape|signature")


def test_item_breaking_the_signature_client(client, seeded):
    with unchanged(client, seeded):
        with pytest.raises(ValueError):
            with client.trajectory_writer(2, validate_items=False) as writer:
                writer.append({"obs": np.zeros(2, np.float64)})
                writer.create_item("signed", 1.0, {"obs": writer.history["obs"][-1:]})
                writer.flush(timeout_ms=PROMPT_S * 1000)


@pytest.mark.parametrize("data", [np.full(3, 7, np.int64), np.full(5, 7, np.float32), np.full((2, 2), 7, np.float32)],
                         ids=["dtype", "shape", "rank"])
def test_item_of_another_layout_is_kept_raw(server, client, seeded, data):
    """Tables without a signature hold items of any structure, as Reverb's: nothing refused."""
    stub = raw_stub(server)
    _insert(stub, insert_request("items", key=78, priority=1.0, data=data))
    now = contents(client, "items")
    assert {k: v for k, v in now.items() if k != 78} == seeded[0]["items"]  # the others are intact
    assert now[78] == (1.0, (data.tobytes(),))


def test_item_of_another_layout_is_kept_client(client, seeded):
    client.insert(np.full(3, 7, np.int64), {"items": 1.0})
    client.insert({"other": np.zeros(2, np.float32), "structure": np.int32(1)}, {"items": 1.0})
    now = contents(client, "items")
    assert len(now) == 5 and {k: v for k, v in now.items() if k in seeded[0]["items"]} == seeded[0]["items"]
    assert sorted(len(leaves) for _, leaves in now.values()) == [1, 1, 1, 1, 2]


def test_item_longer_than_the_table_allows_raw(server, client, seeded):
    stub = raw_stub(server)
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, _signed_request("fixed_len", np.zeros((4, 2), np.float32))), INVALID)


def test_item_longer_than_the_table_allows_client(client, seeded):
    with unchanged(client, seeded):
        with pytest.raises(ValueError):
            with client.trajectory_writer(4, validate_items=False) as writer:
                for _ in range(4):
                    writer.append({"obs": np.zeros(2, np.float32)})
                writer.create_item("fixed_len", 1.0, {"obs": writer.history["obs"][-4:]})
                writer.flush(timeout_ms=PROMPT_S * 1000)


# ------------------------------------------------------------ priorities ----

@pytest.mark.parametrize("priority", [math.nan, -1.0, -math.inf], ids=["nan", "negative", "-inf"])
def test_bad_priority_raw(server, client, seeded, priority):
    stub = raw_stub(server)
    key = next(iter(seeded[0]["items"]))
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, insert_request("items", key=79, priority=priority,
                                                        data=np.zeros(2, np.float32))), INVALID, "priority")
        _rpc_error(lambda: stub.MutatePriorities(pb.MutatePrioritiesRequest(
            table="items", updates=[pb.KeyWithPriority(key=key, priority=priority)]), timeout=PROMPT_S),
            INVALID, "priority")


@pytest.mark.parametrize("priority", [math.nan, -1.0], ids=["nan", "negative"])
def test_bad_priority_client(client, seeded, priority):
    key = next(iter(seeded[0]["items"]))
    with unchanged(client, seeded):
        with pytest.raises(ValueError):
            client.insert(np.zeros(2, np.float32), {"items": priority})
        with pytest.raises(ValueError):
            client.mutate_priorities("items", updates={key: priority})


def test_a_bad_update_does_not_apply_the_good_ones_of_its_request(server, client, seeded):
    stub = raw_stub(server)
    good, bad = list(seeded[0]["items"])[:2]
    with unchanged(client, seeded):
        _rpc_error(lambda: stub.MutatePriorities(pb.MutatePrioritiesRequest(
            table="items", updates=[pb.KeyWithPriority(key=good, priority=50.0),
                                    pb.KeyWithPriority(key=bad, priority=-1.0)],
            delete_keys=[good]), timeout=PROMPT_S), INVALID)


# ------------------------------------------------------------ empty trajectory ----

def test_empty_trajectory_raw(server, client, seeded):
    stub = raw_stub(server)
    no_columns = pb.InsertStreamRequest(items=[pb.PrioritizedItem(key=80, table="items", priority=1.0,
                                                                  structure=pb.Structure(kind=pb.Structure.LIST))])
    empty_column = insert_request("items", key=81, priority=1.0, data=np.zeros(2, np.float32))
    del empty_column.items[0].columns[0].slices[:]
    zero_steps = insert_request("items", key=82, priority=1.0, data=np.zeros(2, np.float32))
    zero_steps.items[0].columns[0].slices[0].length = 0
    with unchanged(client, seeded):
        for request in (no_columns, empty_column, zero_steps):
            _rpc_error(lambda request=request: _insert(stub, request), INVALID, "empty|column|slice|step")


def test_empty_trajectory_client(client, seeded):
    with unchanged(client, seeded):
        with client.trajectory_writer(2) as writer:
            writer.append({"obs": np.zeros(2, np.float32)})
            with pytest.raises(ValueError):
                writer.create_item("items", 1.0, [])
            with pytest.raises(ValueError):
                writer.create_item("items", 1.0, {"obs": writer.history["obs"][0:0]})


# ------------------------------------------------------------ malformed requests ----

def _garbage_calls(channel):
    """Raw bytes sent to every request type, bypassing protobuf serialization."""
    garbage = [b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
               np.random.default_rng(0).bytes(64), np.random.default_rng(1).bytes(4096)]
    for method in ("MutatePriorities", "Reset", "ServerInfo", "Checkpoint"):
        call = channel.unary_unary(f"/gear.v1.ReplayService/{method}")
        for g in garbage:
            yield method, lambda call=call, g=g: call(g, timeout=PROMPT_S)
    sample = channel.unary_stream("/gear.v1.ReplayService/Sample")
    insert = channel.stream_stream("/gear.v1.ReplayService/InsertStream")
    for g in garbage:
        yield "Sample", lambda g=g: list(sample(g, timeout=PROMPT_S))
        yield "InsertStream", lambda g=g: list(insert(iter([g]), timeout=PROMPT_S))


def test_garbage_bytes_are_refused(server, client, seeded):
    channel = raw_channel(server)
    # INVALID_ARGUMENT for bytes that are no request; a garbage message that happens to parse
    # is answered like that request (an unknown table: NOT_FOUND; Checkpoint without a
    # checkpoint directory: UNIMPLEMENTED). Never INTERNAL or UNKNOWN (a server-side crash).
    refused = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED)
    codes = []
    with unchanged(client, seeded):
        for method, call in _garbage_calls(channel):
            try:
                call()
                codes.append((method, grpc.StatusCode.OK))
            except grpc.RpcError as e:
                assert e.code() in refused, f"{method}: {e.code()} {e.details()}"
                codes.append((method, e.code()))
    assert ("InsertStream", grpc.StatusCode.INVALID_ARGUMENT) in codes
    assert ("MutatePriorities", grpc.StatusCode.INVALID_ARGUMENT) in codes


@pytest.mark.parametrize("mutate", [
    lambda t: setattr(t, "data", t.data[:-1]),
    lambda t: setattr(t, "data", t.data + b"\0"),
    lambda t: t.shape.__setitem__(0, 1000),
    lambda t: t.shape.__setitem__(0, -1),
    lambda t: setattr(t, "dtype", "|O"),
    lambda t: setattr(t, "dtype", "not a dtype"),
    lambda t: t.ClearField("shape"),
], ids=["short", "long", "huge-shape", "negative-dim", "object-dtype", "bad-dtype", "rank-0"])
def test_tensor_that_does_not_match_its_shape(server, client, seeded, mutate):
    stub = raw_stub(server)
    request = insert_request("items", key=83, priority=1.0, data=np.zeros(2, np.float32))
    mutate(request.chunks[0].data)
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, request), INVALID)


def test_reference_to_an_unknown_chunk(server, client, seeded):
    stub = raw_stub(server)
    request = insert_request("items", key=84, priority=1.0, data=np.zeros(2, np.float32))
    request.items[0].columns[0].slices[0].chunk_key = 999
    outside = insert_request("items", key=85, priority=1.0, data=np.zeros(2, np.float32))
    outside.items[0].columns[0].slices[0].offset = 1
    released = insert_request("items", key=86, priority=1.0, data=np.zeros(2, np.float32))
    released.release_chunk_keys.append(1)
    released.ClearField("items")
    later = insert_request("items", key=87, priority=1.0, data=np.zeros(2, np.float32))
    later.ClearField("chunks")
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, request), INVALID, "chunk")
        _rpc_error(lambda: _insert(stub, outside), INVALID, "chunk|slice|outside")
        # A chunk released earlier on the stream is gone for later items.
        _rpc_error(lambda: _insert(stub, released, later), INVALID, "chunk")


def test_structure_that_does_not_match_the_columns(server, client, seeded):
    stub = raw_stub(server)
    two_leaves = insert_request("items", key=88, priority=1.0, data=np.zeros(2, np.float32))
    two_leaves.items[0].structure.CopyFrom(pb.Structure(kind=pb.Structure.TUPLE, children=[
        pb.Structure(kind=pb.Structure.LEAF), pb.Structure(kind=pb.Structure.LEAF)]))
    deep = pb.Structure(kind=pb.Structure.LEAF)
    for _ in range(90):  # deeper than any real nest, within protobuf's own limit of 100
        deep = pb.Structure(kind=pb.Structure.LIST, children=[deep])
    too_deep = insert_request("items", key=89, priority=1.0, data=np.zeros(2, np.float32))
    too_deep.items[0].structure.CopyFrom(deep)
    with unchanged(client, seeded):
        _rpc_error(lambda: _insert(stub, two_leaves), INVALID, "leaves|column|structure")
        _rpc_error(lambda: _insert(stub, too_deep), INVALID + (grpc.StatusCode.INTERNAL,))


def test_bad_sample_requests(server, client, seeded):
    stub = raw_stub(server)
    with unchanged(client, seeded):
        for n in (0, -5):
            _rpc_error(lambda n=n: list(stub.Sample(pb.SampleRequest(table="items", num_samples=n),
                                                    timeout=PROMPT_S)), INVALID, "num_samples")


def test_a_refused_request_keeps_the_items_sent_before_it(server, client, seeded):
    """On one stream, items acknowledged before a bad request stay; the bad request adds nothing."""
    stub = raw_stub(server)
    good = insert_request("items", key=90, priority=1.0, data=np.full(2, 7, np.float32))
    bad = insert_request("items", key=91, priority=1.0, data=np.zeros(2, np.float32), chunk_key=2)
    bad.items[0].columns[0].slices[0].chunk_key = 12345
    acked = []

    def run():
        for response in stub.InsertStream(iter([good, bad]), timeout=PROMPT_S):
            acked.extend(response.keys)

    _rpc_error(run, INVALID, "chunk")
    assert acked == [90]
    info = client.server_info(timeout=PROMPT_S)["items"]
    assert info.current_size == 4
    assert 91 not in contents(client, "items")


# ------------------------------------------------------------ streams cut off ----

def _write_episodes_forever(address: str, table: str) -> None:
    """A child actor: episodes of 10 steps, an item per step over the last 3 steps (obs = episode*100 + t)."""
    import numpy as np

    import gear_client as reverb

    client = reverb.Client(address)
    writer = client.trajectory_writer(3)
    episode = 0
    while True:
        for t in range(10):
            writer.append({"obs": np.full(4, episode * 100 + t, np.float32), "t": np.int32(t)})
            if t >= 2:
                writer.create_item(table, 1.0, {"obs": writer.history["obs"][-3:], "t": writer.history["t"][-3:]})
            if t == 5:
                writer.flush()
        writer.end_episode()
        episode += 1


def _write_episode_item(client) -> None:
    """One item shaped like the actor's: 3 steps of obs float32[4] and t int32."""
    with client.trajectory_writer(3) as writer:
        for t in range(3):
            writer.append({"obs": np.full(4, t, np.float32), "t": np.int32(t)})
        writer.create_item("episodes", 1.0, {"obs": writer.history["obs"][-3:], "t": writer.history["t"][-3:]})


def _whole(sample) -> bool:
    obs, t = sample.data[0], sample.data[1]
    base = obs[0, 0] - t[0]
    return (obs.shape == (3, 4) and list(t) == [t[0], t[0] + 1, t[0] + 2]
            and np.array_equal(obs, np.repeat((base + t).astype(np.float32)[:, None], 4, axis=1)))


def test_actor_killed_mid_episode_leaves_only_whole_items(server, client):
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_write_episodes_forever, args=(f"localhost:{server.port}", "episodes"), daemon=True)
    child.start()
    try:
        assert wait_until(lambda: client.server_info(timeout=PROMPT_S)["episodes"].current_size >= 40, timeout=60)
        time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(PROMPT_S)
    assert child.exitcode == -signal.SIGKILL
    size = client.server_info(timeout=PROMPT_S)["episodes"].current_size
    time.sleep(0.3)  # nothing trickles in after the writer died
    info = client.server_info(timeout=PROMPT_S)["episodes"]
    assert info.current_size == size and info.rate_limiter_info.insert_stats.completed == size
    samples = list(client.sample("episodes", 200, emit_timesteps=False))
    bad = [s for s in samples if not _whole(s)]
    assert bad == []
    # The daemon goes on taking inserts from others.
    _write_episode_item(client)
    assert client.server_info(timeout=PROMPT_S)["episodes"].current_size == size + 1


def test_cancelled_insert_stream_leaves_no_partial_item(server, client, seeded):
    stub = raw_stub(server)
    first = insert_request("items", key=92, priority=1.0, data=np.full(2, 9, np.float32))
    more_data = pb.InsertStreamRequest(chunks=[pb.ChunkData(chunk_key=3, data=tensor(np.zeros((1, 2), np.float32)),
                                                            episode_id=1, episode_step=1)])
    hold = threading.Event()

    def requests():
        yield first
        yield more_data  # mid-episode: data without its item yet
        hold.wait(PROMPT_S)

    call = stub.InsertStream(requests(), timeout=PROMPT_S)
    assert list(next(call).keys) == [92]
    call.cancel()
    hold.set()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    items_before = seeded[0]["items"]
    assert wait_until(lambda: client.server_info(timeout=PROMPT_S)["items"].current_size == 4)
    after = contents(client, "items")
    assert set(after) == set(items_before) | {92}
    assert {k: after[k] for k in items_before} == items_before


def test_cancelled_blocked_sample_takes_nothing(server, client, seeded):
    stub = raw_stub(server)
    call = stub.Sample(pb.SampleRequest(table="episodes", num_samples=1), timeout=PROMPT_S)
    time.sleep(0.3)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        list(call)
    _write_episode_item(client)
    time.sleep(0.5)  # a sampler that survived its cancellation would take the item now
    info = client.server_info(timeout=PROMPT_S)["episodes"]
    assert info.rate_limiter_info.sample_stats.completed == 0 and info.current_size == 1
