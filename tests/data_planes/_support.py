"""Shared pieces of the data-plane tests: a real daemon, checksummed trajectories, an RDMA emulation.

Items follow the core workload: ``{obs: float32[T, D], action: int64[T],
reward: float32[T]}`` (columns in that order: action, obs, reward). Every item
embeds a checksum: ``action[0]`` is the item's seed and ``action[1]`` the CRC32
of its obs and reward bytes, so a torn item (bytes of two items mixed) is caught.
"""

from __future__ import annotations

import itertools
import mmap
import os
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gear_client.data_planes.rdma import DEFAULT_MAX_SEND_WR
from gear_contract import addressing, nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.rdma_verbs import Completion, Region
from gear_server.daemon import Daemon
from gear_server.data_planes.manager import DataPlaneManager
from gear_server.table.table import ItemToInsert

STRUCTURE = nest.structure_of({"obs": 0, "action": 0, "reward": 0})
ACTION, OBS, REWARD = 0, 1, 2
_instances = itertools.count()


def table_config(name: str = "t", max_size: int = 64, *, sampler: str = "uniform", remover: str = "fifo",
                 spare: int | None = None, max_times_sampled: int = 0,
                 rate_limiter: pb.RateLimiterOptions | None = None) -> pb.TableConfig:
    """A table's config; the rate limiter is MinSize(1) unless given."""
    if rate_limiter is None:
        rate_limiter = pb.RateLimiterOptions(samples_per_insert=1.0, min_size_to_sample=1,
                                             min_diff=-sys.float_info.max, max_diff=sys.float_info.max)
    return pb.TableConfig(name=name, max_size=max_size, max_times_sampled=max_times_sampled,
                          sampler=pb.SelectorOptions(**{sampler: True}), remover=pb.SelectorOptions(**{remover: True}),
                          rate_limiter=rate_limiter)


class PlaneDaemon(Daemon):
    """A real daemon whose data-plane manager takes test settings (lease timeouts, an RDMA server)."""

    def __init__(self, config: pb.ServerConfig, **manager_kwargs):
        super().__init__(config, seed=0)
        self.manager_kwargs = {"rdma": None, **manager_kwargs}
        self.manager: DataPlaneManager | None = None

    def build_data_planes(self) -> DataPlaneManager:
        self.manager = DataPlaneManager(self.tables, self.host_id, self.calls, **self.manager_kwargs)
        return self.manager

    def stop(self, grace: float = 1.0) -> None:
        if self.manager is not None:
            self.manager.shutdown()
        super().stop(grace)


def start_daemon(*tables: pb.TableConfig, bind: str = "localhost", **manager_kwargs) -> PlaneDaemon:
    config = pb.ServerConfig(port=0, bind_address=bind, instance_name=f"dptest{os.getpid()}x{next(_instances)}",
                             tables=list(tables) or [table_config()])
    daemon = PlaneDaemon(config, **manager_kwargs)
    daemon.start()
    return daemon


def make_item(seed: int, length: int = 64, dim: int = 1024) -> dict[str, np.ndarray]:
    """A checksummed trajectory (see module docstring)."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((length, dim), dtype=np.float32)
    reward = rng.standard_normal(length, dtype=np.float32)
    action = np.arange(length, dtype=np.int64)
    action[0] = seed
    if length > 1:
        action[1] = zlib.crc32(obs.tobytes() + reward.tobytes())
    return {"action": action, "obs": obs, "reward": reward}


def write_trajectories(address: str, first: int, count: int, length: int, dim: int, *, end_episodes: bool = True,
                       report: Callable[[], dict] | None = None) -> dict:
    """An actor: items of seeds [first, first + count) written step by step through an ordinary
    TrajectoryWriter to table "t". Returns whether its items took the insert plane, and with ``report``
    what that measures once the writer flushed (before it closes)."""
    import gear_client as reverb

    client = reverb.Client(address)
    with client.trajectory_writer(length) as w:
        for seed in range(first, first + count):
            item = make_item(seed, length, dim)
            for t in range(length):
                w.append({k: v[t] for k, v in item.items()})
            w.create_item("t", 1.0, {k: w.history[k][-length:] for k in ("action", "obs", "reward")})
            if end_episodes:
                w.end_episode()
        out = {"insert_plane": w._same_host.writer is not None}
        if report is not None:
            w.flush()
            out.update(report())
    return out


def item_ok(action: np.ndarray, obs: np.ndarray, reward: np.ndarray) -> bool:
    """Whether one item's columns (its own length) carry a matching checksum."""
    return int(action[1]) == zlib.crc32(np.ascontiguousarray(obs).tobytes() + np.ascontiguousarray(reward).tobytes())


def insert(table, seed: int, length: int = 64, dim: int = 1024, key: int | None = None) -> None:
    item = make_item(seed, length, dim)
    table.insert(ItemToInsert(key=seed if key is None else key, priority=1.0, structure=STRUCTURE,
                              columns=[item["action"], item["obs"], item["reward"]], squeeze=[False] * 3))


def fill(table, n: int, start: int = 1, **kwargs) -> None:
    for seed in range(start, start + n):
        insert(table, seed, **kwargs)


def check_batch(batch) -> int:
    """Assert every item of a SampledBatch is intact and matches its key; returns the item count."""
    action, obs, reward = batch.columns
    for i in range(len(batch)):
        n = int(batch.lengths[i, ACTION])
        assert item_ok(action[i, :n], obs[i, :n], reward[i, :n]), f"item {i} (key {batch.keys[i]}) is torn"
        assert int(action[i, 0]) == int(batch.keys[i]), "the data does not belong to the reported key"
    return len(batch)


# ---------------------------------------------------------------- RDMA emulation --
# The daemon and the learner of these tests share a process, so "remote memory"
# is a registry of mapped segments keyed by (address, rkey); the emulated NIC
# copies from there and reports completions the way an RC queue pair does
# (in order per queue pair, only signalled requests complete).

_REGISTERED: dict[tuple[int, int], np.ndarray] = {}
_REG_LOCK = threading.Lock()
_rkeys = itertools.count(0x1000)


def emulated_port(name: str = "emu0", link_layer: str = addressing.LINK_ETHERNET) -> addressing.PortInfo:
    gid = bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])
    return addressing.PortInfo(device=name, port=1, link_layer=link_layer, lid=0 if link_layer != "IB" else 7,
                               gid=gid, gid_index=3, active_mtu=5, max_msg_size=1 << 30, max_qp_rd_atom=16)


@dataclass
class EmulatedResources:
    qp_nums: list[int]
    segment: str | None = None
    region: pb.RdmaRegion | None = None
    mapping: mmap.mmap | None = None
    closed: bool = False


class EmulatedRdmaServer:
    """The daemon side (the RdmaServer interface) over the emulated NIC; counts what it did."""

    def __init__(self):
        self.port = emulated_port()
        self.accepted: list[EmulatedResources] = []
        self.closed_sessions = 0
        self._qpn = itertools.count(0x100)

    def accept(self, learner: pb.RdmaEndpoint):
        addressing.validate_endpoint(learner)
        addressing.address_vector(self.port, learner)
        res = EmulatedResources([next(self._qpn) for _ in learner.qp_nums])
        self.accepted.append(res)
        return res, self.port.endpoint(res.qp_nums, [1] * len(res.qp_nums))

    def attach(self, res: EmulatedResources, layout) -> pb.RdmaRegion:
        fd = os.open(layout.segment, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, layout.segment_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = np.frombuffer(mapping, dtype=np.uint8)
        rkey = next(_rkeys)
        addr = int(view.ctypes.data)
        with _REG_LOCK:
            _REGISTERED[(addr, rkey)] = view
        res.segment, res.mapping = layout.segment, mapping
        res.region = pb.RdmaRegion(addr=addr, rkey=rkey, length=layout.segment_size)
        return res.region

    def close_session(self, res: EmulatedResources) -> None:
        res.closed = True
        self.closed_sessions += 1
        if res.region is not None:
            with _REG_LOCK:
                _REGISTERED.pop((res.region.addr, res.region.rkey), None)

    def close(self) -> None:
        pass


class EmulatedConnection:
    """The learner side: what RdmaPlane needs of a VerbsConnection, over the emulated NIC.

    ``fail_after`` makes the n-th posted chain complete with an error status (12:
    IBV_WC_RETRY_EXC_ERR); ``max_outstanding`` asserts the scheduler never has
    more chains in flight on a queue pair.
    """

    def __init__(self, num_qps: int = 4, *, max_send_wr: int = DEFAULT_MAX_SEND_WR, max_message: int = 1 << 30,
                 fail_after: int | None = None, reorder: bool = True):
        self.port = emulated_port()
        self.num_qps = num_qps
        self.max_send_wr = max_send_wr
        self.max_message = max_message
        self.fail_after = fail_after
        self.reorder = reorder
        self.posted_chains = 0
        self.posted_requests = 0
        self.signalled = 0
        self.connected_to: pb.RdmaEndpoint | None = None
        self.closed = False
        self.max_in_flight_seen = 0
        self._qps = list(range(0x500, 0x500 + num_qps))
        self._in_flight: list[list[Completion]] = [[] for _ in range(num_qps)]
        self._buffers: dict[int, tuple[np.ndarray, Region]] = {}
        self._rng = np.random.default_rng(0)

    def endpoint(self) -> pb.RdmaEndpoint:
        return self.port.endpoint(self._qps, [7] * self.num_qps)

    def connect(self, remote: pb.RdmaEndpoint) -> None:
        addressing.validate_endpoint(remote, expected_qps=self.num_qps)
        self.connected_to = remote

    def allocate(self, nbytes: int) -> np.ndarray:
        buf = np.zeros(max(nbytes, 4096), dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self._buffers[addr] = (buf, Region(addr, buf.nbytes, lkey=addr & 0xFFFF, rkey=0))
        return buf

    def region_of(self, buf: np.ndarray) -> Region:
        return self._buffers[int(buf.ctypes.data)][1]

    def free(self, buf: np.ndarray) -> None:
        del self._buffers[int(buf.ctypes.data)]

    def post_reads(self, queue: int, wr_id: int, ranges: np.ndarray, local: Region, remote: pb.RdmaRegion) -> None:
        self.posted_chains += 1
        self.posted_requests += len(ranges)
        with _REG_LOCK:
            source = _REGISTERED.get((remote.addr, remote.rkey))
        dest = self._buffers[local.addr][0]
        ok = source is not None and (self.fail_after is None or self.posted_chains <= self.fail_after)
        if ok:
            for r_off, l_off, length in ranges.tolist():
                if length > self.max_message or r_off + length > remote.length or l_off + length > local.length:
                    ok = False
                    break
                dest[l_off:l_off + length] = source[r_off:r_off + length]
        self._in_flight[queue].append(Completion(wr_id, ok, 0 if ok else 12, queue))
        self.max_in_flight_seen = max(self.max_in_flight_seen, len(self._in_flight[queue]))

    def poll(self, max_entries: int = 32) -> list[Completion]:
        queues = [q for q in range(self.num_qps) if self._in_flight[q]]
        if self.reorder:
            self._rng.shuffle(queues)
        out = []
        for q in queues:
            while self._in_flight[q] and len(out) < max_entries:
                out.append(self._in_flight[q].pop(0))  # in order within a queue pair
        self.signalled += len(out)
        return out

    def close(self) -> None:
        self.closed = True


class Churn:
    """A writer thread inserting (and so evicting) checksummed items as fast as it can, until stopped."""

    def __init__(self, table, length: int = 64, dim: int = 1024, first_seed: int = 1000):
        self.table = table
        self.inserted = 0
        self._stop = threading.Event()
        self._seeds = itertools.count(first_seed)
        self._args = (length, dim)
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            insert(self.table, next(self._seeds), *self._args)
            self.inserted += 1

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
