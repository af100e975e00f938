"""One table over several daemons (docs/SHARDING.md).

``membership`` (which daemons, which answer), ``selection`` (the global split and
probabilities), ``assembly`` (one batch from the shards' parts), ``sampler``
(ShardedSampler: a learner's batches) and ``client`` (ShardedClient: Reverb's
Client over the shards). ``reverb.Client([a, b, c])`` and the datasets'
``server_address=[a, b, c]`` come here.
"""

from __future__ import annotations

from typing import Any

from gear_client.sharding.membership import ShardState, shard_addresses

__all__ = ["ShardState", "is_sharded", "shard_addresses", "sharded_sampler"]


def is_sharded(target: Any) -> bool:
    """Whether ``target`` (an address spec or a client) names several daemons."""
    from gear_client.sharding.client import ShardedClient

    return isinstance(target, ShardedClient) or shard_addresses(target) is not None


def sharded_sampler(target: Any, table: str, *, client_type: type, planes=None, device: Any = None,
                    **options: Any):
    """A ShardedSampler of ``table`` for a ShardedClient or an address spec naming several daemons.

    ``client_type``: gear_client.Client (the client of one shard).
    """
    from gear_client.sharding.client import ShardedClient
    from gear_client.sharding.sampler import ShardedSampler

    if isinstance(target, ShardedClient):
        return ShardedSampler(target.shard_set, table, planes=planes, device=device, **options)
    client = ShardedClient(target, client_type=client_type)
    return ShardedSampler(client.shard_set, table, planes=planes, device=device, owns_shards=True, **options)
