"""ShardedClient: Reverb's Client over a table spread across several daemons.

``reverb.Client([a, b, c])`` (or ``"a,b,c"``, or ``"shards:NAME:PORT"`` for a
DNS name with one address per daemon) returns one. Each table is seen as one:

* ``server_info``: global size and counters (sums over the shards); each
  ``TableInfo`` also lists ``shards`` (address, up, failures, last error).
* inserts: a writer (or one ``insert``) goes to the daemon on this host when
  there is one (the same-host insert path applies; several there: in turn),
  else to the live shards in turn from a random start, one shard per writer,
  so an episode's items stay together. Keys are
  random 64-bit numbers made by the writers, unique across shards as on one
  daemon. A writer stays on its shard; new writers avoid shards that are down,
  and with every shard down an insert fails with ``ServiceError``.
* ``mutate_priorities``: keys seen in samples go to the shard that owns them;
  other keys go to every live shard (a daemon ignores keys it does not hold).
* ``sample``: global semantics (gear_client/sharding/selection.py), over each
  shard's best plane.
* ``reset`` and ``checkpoint`` reach every shard; ``checkpoint`` returns the
  shards' checkpoint paths joined by commas.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from gear_client import errors
from gear_client.data_planes.read_ahead import sampling_takes
from gear_client.replay_sample import ReplaySample, emit_sample
from gear_client.sharding.membership import (
    DEFAULT_RETRY_S,
    DEFAULT_TIMEOUT_S,
    Shard,
    ShardSet,
    ShardState,
    is_unreachable,
    shard_addresses,
)
from gear_client.sharding.owners import UNKNOWN
from gear_client.sharding.sampler import ShardedSampler
from gear_client.sharding.selection import sum_table_infos
from gear_client.table_info import TableInfo
from gear_contract import negotiation
from gear_contract._proto import replay_pb2 as pb
from gear_contract.priorities import check_priorities
from gear_contract.wire import priority_arrays

log = logging.getLogger(__name__)

_ITEMS_PER_BATCH = 256  # items per sharded batch when client.sample is asked for many


@dataclass
class ShardedTableInfo(TableInfo):
    """A table's global TableInfo (sums over shards) and the state of each shard."""

    shards: tuple[ShardState, ...] = ()


class ShardedClient:
    """One logical replay service over several daemons (see module docstring)."""

    def __init__(self, server_address: Any, client: Any = None, *, client_type: type, token: str | None = None,
                 root_certificates: Any = None, certificate_chain: Any = None, private_key: Any = None,
                 data_planes: Sequence[str] | None = None, connect_timeout: float | None = None,
                 host_id: str | None = None, seed: int | None = None,
                 shard_timeout_s: float = DEFAULT_TIMEOUT_S, shard_retry_s: float = DEFAULT_RETRY_S):
        """``client_type``: gear_client.Client, the client of one shard (``Client.__new__`` passes it).

        ``host_id``: this client's host identity (default: the local one) for picking its own host's daemon.

        ``connect_timeout``: how long a call waits for one shard's daemon (default ``shard_timeout_s``).
        ``shard_timeout_s``: a shard that does not answer within it is marked down;
        ``shard_retry_s``: how often a down shard is probed. ``seed``: the splits and
        insert placements reproduce.
        """
        del client  # Reverb's "pre-existing client": each shard opens its own channel
        self._client_type = client_type
        addresses = shard_addresses(server_address)
        if addresses is None:
            addresses = [server_address]
        self._spec = list(addresses)
        self._security_args = {k: v for k, v in (("token", token), ("root_certificates", root_certificates),
                                                 ("certificate_chain", certificate_chain),
                                                 ("private_key", private_key)) if v is not None}
        self._data_planes = data_planes
        self._connect_timeout = shard_timeout_s if connect_timeout is None else connect_timeout
        self._options = {"host_id": host_id, "seed": seed, "shard_timeout_s": shard_timeout_s,
                         "shard_retry_s": shard_retry_s, "connect_timeout": connect_timeout}
        self.host_id = host_id or negotiation.local_host_id()
        self._first_writer = int(np.random.default_rng(seed).integers(1 << 30))
        self._writers = 0
        self._seed = seed
        self._lock = threading.Lock()
        self._samplers: dict[str, ShardedSampler] = {}
        self.shard_set = ShardSet(addresses, self._shard_client, timeout_s=shard_timeout_s, retry_s=shard_retry_s)

    def _shard_client(self, address: str) -> Any:
        return self._client_type(address, data_planes=self._data_planes, connect_timeout=self._connect_timeout,
                                 **self._security_args)

    def __reduce__(self):
        return _rebuild, (self._client_type, self._spec, self._security_args, self._data_planes, self._options)

    def __repr__(self) -> str:
        return f"ShardedClient, server_address={','.join(s.address for s in self.shard_set.shards)}"

    @property
    def server_address(self) -> str:
        return ",".join(s.address for s in self.shard_set.shards)

    def shards(self) -> list[ShardState]:
        """Each shard's address, host identity, whether it answers, and how often it went down."""
        self.shard_set.live()  # start probes of the shards due for one
        return self.shard_set.states()

    def close(self) -> None:
        with self._lock:
            samplers, self._samplers = list(self._samplers.values()), {}
        for sampler in samplers:
            sampler.close()
        self.shard_set.close()

    # ------------------------------------------------------------------ inserts
    def _insert_shard(self, exclude: Iterable[Shard] = ()) -> Shard:
        """The daemon a writer uses: this host's if one answers, else the next live shard (see module docstring)."""
        excluded = {s.index for s in exclude}
        live = [s for s in self.shard_set.live() if s.index not in excluded]
        if not live:
            states = "; ".join(f"{s.address}: {s.last_error or 'up'}" for s in self.shard_set.states())
            raise errors.ServiceError(f"insert: no shard is reachable ({states})", grpc.StatusCode.UNAVAILABLE)
        local = [s for s in live if s.host_id == self.host_id]
        candidates = local or live
        with self._lock:  # round robin from a random start: a client's next writers cover every shard
            self._writers += 1
            return candidates[(self._first_writer + self._writers) % len(candidates)]

    def insert(self, data: Any, priorities: Mapping[str, float]) -> None:
        """Insert one single-step item (``Client.insert``) into one shard; another one if that shard is down."""
        tried: list[Shard] = []
        while True:
            shard = self._insert_shard(tried)
            try:  # a daemon that died since it was last seen would hold the insert (it waits for a connection)
                shard.server_info(self.shard_set.timeout_s)
                return shard.client.insert(data, priorities)
            except (grpc.RpcError, errors.ServiceError) as exc:
                if not is_unreachable(exc):
                    raise
                self.shard_set.mark_down(shard, exc)
                tried.append(shard)

    def writer(self, max_sequence_length: int, delta_encoded: bool = False, chunk_length: int | None = None,
               max_in_flight_items: int | None = 25):
        """A legacy ``Writer`` on one shard (see ``_insert_shard``)."""
        return self._insert_shard().client.writer(max_sequence_length, delta_encoded, chunk_length,
                                                  max_in_flight_items)

    def trajectory_writer(self, num_keep_alive_refs: int, *, validate_items: bool = True,
                          get_signature_timeout_ms: int | None = 3000):
        """A ``TrajectoryWriter`` on one shard: all its items (an episode) go there."""
        return self._insert_shard().client.trajectory_writer(
            num_keep_alive_refs, validate_items=validate_items, get_signature_timeout_ms=get_signature_timeout_ms)

    def structured_writer(self, configs: Sequence[Any]):
        """A ``StructuredWriter`` on one shard."""
        return self._insert_shard().client.structured_writer(configs)

    # ------------------------------------------------------------------ samples
    def sampler(self, table: str) -> ShardedSampler:
        """The table's sampler (kept; ``client.sample`` uses it)."""
        with self._lock:
            sampler = self._samplers.get(table)
            if sampler is None:
                seed = None if self._seed is None else self._seed + 1 + len(self._samplers)
                planes = ("inline", *self.shard_set.shards[0].client._data_planes)  # the shard clients' choice
                sampler = self._samplers[table] = ShardedSampler(self.shard_set, table, planes=planes, seed=seed,
                                                                 host_id=self.host_id, from_torch=False)
            return sampler

    def sample(self, table: str, num_samples: int = 1, *, emit_timesteps: bool = True,
               unpack_as_table_signature: bool = False
               ) -> Generator[list[ReplaySample] | ReplaySample, None, None]:
        """``num_samples`` items with global semantics, as ``Client.sample`` yields them."""
        table_info = self._table_info(table)
        structure = None
        if unpack_as_table_signature and table_info.HasField("signature"):
            structure = table_info.signature.structure
        sampler = self.sampler(table)
        remaining = int(num_samples)
        per_call = 1 if sampling_takes(table_info) else _ITEMS_PER_BATCH  # as Client.sample
        while remaining > 0:
            batch = sampler.sample(min(remaining, per_call))
            remaining -= len(batch)
            for i, info in enumerate(batch.item_infos()):
                yield emit_sample(info, batch.item_columns(i), structure, emit_timesteps)

    # ------------------------------------------------------------------ table operations
    def mutate_priorities(self, table: str, updates: Mapping[int, float] | None = None,
                          deletes: Iterable[int] | None = None) -> None:
        """Delete then update keys on the shards that own them (unknown owners: every live shard).

        ValueError naming the first key or priority that is not one (nothing is sent), as one daemon's client.
        """
        keys, priorities, dropped = priority_arrays(updates, deletes)
        check_priorities(keys, priorities)  # one daemon's ValueError, before anything is sent
        live = self.shard_set.live()
        owners = self.shard_set.key_owners
        update_owner, delete_owner = owners.owners(keys), owners.owners(dropped)
        up = np.array([s.index for s in live], np.int64)
        lost = sum(int(np.count_nonzero(~np.isin(o, up) & (o != UNKNOWN))) for o in (update_owner, delete_owner))
        if lost:
            log.warning("mutate_priorities: %d key(s) live on shards that are down; not changed", lost)
        routed: dict[int, tuple[dict[int, float], list[int]]] = {}
        for shard in live:
            mine = (update_owner == shard.index) | (update_owner == UNKNOWN)
            gone = (delete_owner == shard.index) | (delete_owner == UNKNOWN)
            if mine.any() or gone.any():
                routed[shard.index] = (dict(zip(keys[mine].tolist(), priorities[mine].tolist(), strict=True)),
                                       dropped[gone].tolist())
        targets = [self.shard_set.shards[s] for s in routed]
        results = self.shard_set.map(
            lambda s: s.client.mutate_priorities(table, routed[s.index][0], routed[s.index][1]), targets)
        owners.forget(dropped)
        self._raise_first(targets, results, "mutate_priorities")

    def reset(self, table: str) -> None:
        """Empty the table on every shard; ServiceError naming the shards that are down, could not be
        reached or stopped answering (``_on_every_shard``)."""
        self._on_every_shard(lambda s: s.client.reset(table), "reset")

    def checkpoint(self) -> str:
        """Have every shard write a checkpoint; their paths, comma-separated in shard order. ServiceError
        naming the shards that are down, could not be reached or stopped answering (``_on_every_shard``)."""
        return ",".join(self._on_every_shard(lambda s: s.client.checkpoint(), "checkpoint"))

    def _on_every_shard(self, fn: Callable[[Shard], Any], operation: str) -> list[Any]:
        """``fn`` on every live shard (``ShardSet.map_watched``: a hung one is cut off), the others' work
        done; a shard already down is not called (a call to a hung node would hold a pool thread until it
        wakes) and counts as failed. ServiceError naming every failed shard."""
        shards = self.shard_set.shards
        live = {s.index for s in self.shard_set.live()}
        answers = iter(self.shard_set.map_watched(fn, [s for s in shards if s.index in live]))
        results = [next(answers) if s.index in live else
                   errors.ServiceError(f"down ({s.last_error})", grpc.StatusCode.UNAVAILABLE) for s in shards]
        self._raise_first(shards, results, operation)
        return results

    def _raise_first(self, shards: Sequence[Shard], results: list[Any], operation: str) -> None:
        failed = [(s, r) for s, r in zip(shards, results, strict=True) if isinstance(r, BaseException)]
        for shard, error in failed:
            if is_unreachable(error):
                self.shard_set.mark_down(shard, error)
        if failed:
            shard, error = failed[0]
            if len(failed) == 1 and not is_unreachable(error):
                raise error
            names = ", ".join(f"{s.address} ({e})" for s, e in failed)
            raise errors.ServiceError(f"{operation} failed on {len(failed)} of {len(shards)} shard(s): {names}",
                                      getattr(error, "code", None)) from error

    def server_info(self, timeout: float | None = None) -> dict[str, ShardedTableInfo]:
        """Table name -> global TableInfo (sizes and counters summed; ``shards`` marks each shard up or down)."""
        live = self.shard_set.live()
        wait = min(timeout, self.shard_set.timeout_s) if timeout else self.shard_set.timeout_s
        answers = self.shard_set.map(lambda s: s.server_info(wait), live)
        infos: dict[str, list[pb.TableInfo]] = {}
        for shard, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                if not is_unreachable(answer):
                    raise errors.from_rpc_error(answer, "server_info") from answer
                self.shard_set.mark_down(shard, answer)
                continue
            for info in answer.table_info:
                infos.setdefault(info.name, []).append(info)
        if not infos and not any(s.up for s in self.shard_set.shards):
            raise errors.DeadlineExceededError(f"server_info: no shard answered within {wait}s")
        states = tuple(self.shard_set.states())
        out = {}
        for name, per_shard in infos.items():
            base = TableInfo.from_proto(sum_table_infos(per_shard))
            out[name] = ShardedTableInfo(**vars(base), shards=states)
        return out

    def _table_info(self, table: str, refresh: bool = False) -> pb.TableInfo:
        """A live shard's TableInfo of ``table``, as ``Client._table_info`` gives (the datasets read its
        configuration, alike on every shard; its sizes are that shard's: ``server_info`` sums them)."""
        for shard in self.shard_set.live():
            try:
                return shard.client._table_info(table, refresh=refresh)
            except errors.ServiceError as exc:
                if not is_unreachable(exc):
                    raise
                self.shard_set.mark_down(shard, exc)
        raise errors.ServiceError(f"no shard of table '{table}' is reachable", grpc.StatusCode.UNAVAILABLE)


def _rebuild(client_type: type, spec: list[str], security_args: dict[str, Any], data_planes: Any,
             options: dict[str, Any]) -> ShardedClient:
    return ShardedClient(spec, client_type=client_type, data_planes=data_planes, **security_args, **options)
