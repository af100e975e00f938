"""gear on Ray: one daemon per node of a running Ray cluster, each a shard of every table.

    import ray, gear_ray
    ray.init(address="auto")
    replay = gear_ray.start("deploy/sharding/gear-shard.toml")   # every node with GPUs (or node_ids=,
                                                                 # resource=, labels=)
    @ray.remote
    def actor():
        client = gear_ray.client()       # every shard; inserts go to this node's daemon
        ...
    replay.stop()                        # drains: each daemon writes its final checkpoint

Each daemon is a Ray actor pinned to its node (NodeAffinitySchedulingStrategy), running ``gear-server`` as a
child process; the tables are defined once (the gear-server TOML); discovery goes through a named registry
actor (``gear_ray.<name>``), not hand-made lists. Checkpoints live on each node under
``<checkpoint_root>/<name>/<host>/``; a daemon that dies is restarted by Ray (``max_restarts``) at the same
port and restores its node's checkpoint, and the clients' shard lists take it back. docs/DEPLOY.md, "Ray".

Needs the ``ray`` extra (``pip install 'gear-replay[ray]'``); ``gear_ray.config`` works without Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GearCluster", "addresses", "attach", "client", "start"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gear_ray import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'gear_ray' has no attribute {name!r}")
