"""A learner's Select and Release over the daemon's local lane: same batches, errors and cancellation as gRPC.

A real daemon on loopback is on this host, so its samplers take the lane;
``GEAR_LOCAL_LANE=0`` keeps them on gRPC. The daemon's lane handlers are
wrapped with counters, so each test sees which path its calls took.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest

from gear_client.data_planes.sampler import PlaneSampler, SamplerClosedError
from gear_contract._proto import replay_pb2 as pb
from gear_contract.lane_frames import RELEASE, SELECT
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import ACTION, check_batch, fill, make_item

LENGTH, DIM = 8, 64


def _count_lane_calls(daemon) -> Counter:
    """Count (at the daemon) the Selects and Releases its local lane receives, and how each ended."""
    lane = daemon.service.local_lane
    assert lane is not None, "the daemon offers no local lane"
    calls: Counter = Counter()
    for kind in (SELECT, RELEASE):
        handler = lane.handlers[kind]

        async def counted(request, context, handler=handler, kind=kind):
            calls[kind] += 1
            try:
                answer = await handler(request, context)
            except BaseException as exc:
                calls[kind, type(exc).__name__] += 1
                raise
            calls[kind, "ok"] += 1
            return answer

        lane.handlers[kind] = counted
    return calls


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _as_truth(batch) -> None:
    """Every item of ``batch`` is intact and byte for byte the item inserted under its key."""
    check_batch(batch)
    action, obs, reward = batch.columns
    for i, key in enumerate(batch.keys.tolist()):
        truth = make_item(int(key), LENGTH, DIM)
        assert np.array_equal(action[i], truth["action"]) and np.array_equal(obs[i], truth["obs"])
        assert np.array_equal(reward[i], truth["reward"])


def _batches(sampler: PlaneSampler, n: int) -> list:
    out = [sampler.sample(4) for _ in range(n)]
    stream = sampler.batches(4)
    out += [next(stream) for _ in range(n)]
    stream.close()
    return out


@pytest.fixture
def daemon():
    d = start_daemon(table_config("t", 32))
    try:
        fill(d.tables["t"], 24, length=LENGTH, dim=DIM)
        yield d
    finally:
        d.stop()


def test_batches_over_the_lane_match_the_grpc_path(daemon, monkeypatch):
    calls = _count_lane_calls(daemon)
    with PlaneSampler(daemon.address(), "t") as lane_sampler:
        assert lane_sampler.open() == "shm"
        on_lane = _batches(lane_sampler, 12)
        lane_selects = lane_sampler.selects
    assert calls[SELECT, "ok"] >= lane_selects > 0 and not calls[SELECT, "LaneAbort"]  # answered on the lane
    assert calls[RELEASE, "ok"] >= 12  # sample() releases each lease; the pipeline's drain releases the rest
    monkeypatch.setenv("GEAR_LOCAL_LANE", "0")
    before = calls.copy()
    with PlaneSampler(daemon.address(), "t") as grpc_sampler:
        on_grpc = _batches(grpc_sampler, 12)
        assert grpc_sampler.selects > 0
    assert calls == before  # nothing on the lane
    for batch in on_lane + on_grpc:
        _as_truth(batch)
    # the same fields either way: SampleInfo of a uniform table of 24 items
    for a, b in zip(on_lane, on_grpc, strict=True):
        assert a.columns[ACTION].shape == b.columns[ACTION].shape and np.array_equal(a.lengths, b.lengths)
        assert np.allclose(a.probabilities, 1 / 24) and np.allclose(b.probabilities, 1 / 24)
        assert np.array_equal(a.table_sizes, b.table_sizes)
    assert _wait_for(lambda: daemon.tables["t"].active_leases() == 0)


def test_grpc_only_when_the_lane_is_switched_off(daemon, monkeypatch):
    monkeypatch.setenv("GEAR_LOCAL_LANE", "0")
    calls = _count_lane_calls(daemon)
    with PlaneSampler(daemon.address(), "t") as s:
        for batch in _batches(s, 4):
            _as_truth(batch)
        assert s._daemon._lane is None
    assert not calls and daemon.service.local_lane.connections == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_close_ends_a_select_blocked_on_the_rate_limiter_over_the_lane(pipelined):
    d = start_daemon(table_config("t", 32))  # empty: MinSize(1) holds every Select
    try:
        calls = _count_lane_calls(d)
        s = PlaneSampler(d.address(), "t")
        s.open()
        outcome = []

        def learner():
            try:
                if pipelined:
                    next(s.batches(2))
                else:
                    s.sample(2)
                outcome.append("batch")
            except SamplerClosedError:
                outcome.append("closed")
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on below
                outcome.append(repr(exc))

        thread = threading.Thread(target=learner)
        thread.start()
        assert _wait_for(lambda: calls[SELECT] >= 1 and d.service.data_planes._selects)  # waiting, on the lane
        time.sleep(0.1)
        assert thread.is_alive()
        started = time.monotonic()
        s.close()
        thread.join(10)
        assert not thread.is_alive() and outcome == ["closed"]
        assert time.monotonic() - started < 5
        assert calls[SELECT, "ok"] == 0 and calls[SELECT, "LaneAbort"] >= 1  # ended by the daemon (CANCELLED)
        assert _wait_for(lambda: not d.service.data_planes._selects)
        assert d.tables["t"].active_leases() == 0
    finally:
        d.stop()


def test_a_reaped_session_recovers_over_the_lane():
    d = start_daemon(table_config("t", 32), lease_timeout_s=5, idle_timeout_s=0.3, reap_interval_s=0.05)
    try:
        fill(d.tables["t"], 16, length=LENGTH, dim=DIM)
        calls = _count_lane_calls(d)
        with PlaneSampler(d.address(), "t") as s:
            _as_truth(s.sample(4))
            first = s._session.session_id
            assert _wait_for(lambda: not d.service.data_planes.sessions._sessions)  # reaped while idle
            _as_truth(s.sample(4))  # NOT_FOUND over the lane, re-opened, selected again
            assert s.reopens == 1 and s._session.session_id != first
            assert calls[SELECT, "LaneAbort"] == 1 and calls[SELECT, "ok"] == 2
            # the pipeline too: reaped again, it drains and recovers through sample()
            stream = s.batches(4, batches_per_select=1)
            _as_truth(next(stream))
            assert _wait_for(lambda: not d.service.data_planes.sessions._sessions)
            for _ in range(8):
                _as_truth(next(stream))
            stream.close()
            assert s.reopens == 2
        assert _wait_for(lambda: d.tables["t"].active_leases() == 0)
    finally:
        d.stop()


def test_a_select_in_flight_when_the_lane_goes_is_sent_again_over_grpc():
    d = start_daemon(table_config("t", 32))  # empty: the Select waits in the daemon
    try:
        calls = _count_lane_calls(d)
        with PlaneSampler(d.address(), "t") as s:
            s.open()
            result = []
            thread = threading.Thread(target=lambda: result.append(s.sample(2)))
            thread.start()
            assert _wait_for(lambda: calls[SELECT] == 1 and d.service.data_planes._selects)
            d.service.close_local_lane()  # the daemon lets the waiting lane call go: LaneBroken
            assert _wait_for(lambda: calls[SELECT, "CancelledError"] == 1)
            assert _wait_for(lambda: d.service.data_planes._selects)  # waiting again, over gRPC
            fill(d.tables["t"], 8, length=LENGTH, dim=DIM)
            thread.join(10)
            assert not thread.is_alive() and len(result) == 1
            _as_truth(result[0])
            assert s._daemon._lane is None  # dropped: later calls take gRPC until it is asked for again
            _as_truth(s.sample(4))
            stream = s.batches(2)
            for _ in range(4):
                _as_truth(next(stream))
            stream.close()
            assert calls[SELECT] == 1
        assert _wait_for(lambda: d.tables["t"].active_leases() == 0)
    finally:
        d.stop()


def test_lane_errors_are_the_rpc_errors(daemon):
    """A Select the daemon refuses ends with the RPC's status on either path."""
    for lane in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GEAR_LOCAL_LANE", lane)
            with PlaneSampler(daemon.address(), "t") as s:
                s.open()
                session = s._session
                with pytest.raises(grpc.RpcError) as info:
                    session.select(0, None, None)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_samples" in info.value.details()
                assert session.release([12345]) == {12345}  # an unknown lease is stale
                session.close()
                with pytest.raises(grpc.RpcError) as info:
                    session.select_async(2, None, None, []).result(timeout=10)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert (s._daemon._lane is not None) == (lane == "1")


def test_lane_select_in_a_request_body_is_the_rpc_message(daemon):
    """The session sends the SelectRequest the RPC would carry (decoded by the daemon as such)."""
    seen = []
    lane = daemon.service.local_lane
    handler = lane.handlers[SELECT]

    async def recording(request, context):
        seen.append(pb.SelectRequest.FromString(request))
        return await handler(request, context)

    lane.handlers[SELECT] = recording
    with PlaneSampler(daemon.address(), "t") as s:
        s.sample(3, timeout=2.5)
        assert seen and seen[-1].num_samples == 3 and seen[-1].packed and seen[-1].timeout_ms == 2500
        assert seen[-1].session_id == s._session.session_id
