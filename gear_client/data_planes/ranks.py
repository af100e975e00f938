"""Data-parallel ranks: which rank of which world a sampler is, and the selection group it joins.

Rank r of world w with batch B gets rows [rB, (r+1)B) of the one selection of
wB items the daemon makes for the group's step (gear_server/data_planes/groups.py):
the ranks need no channel of their own, only a common group id, world size and
seed. Without ``rank``/``world_size`` they are taken from ``torch.distributed``
when it is initialised, else the sampler is no rank (world 1, no group).
"""

from __future__ import annotations

import os
import secrets
import sys
import zlib

from gear_contract._proto import replay_pb2 as pb

_MASK64 = (1 << 64) - 1


def torch_ranks() -> tuple[int, int] | None:
    """(rank, world size) of an initialised ``torch.distributed``; None when there is none."""
    torch = sys.modules.get("torch")  # never imported here: only a learner that uses torch has it
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a torch build without distributed support
        return None


def selection_group(table: str, *, rank: int | None = None, world_size: int | None = None,
                    seed: int | None = None, group_id: str | None = None,
                    from_torch: bool = True) -> pb.SelectionGroup | None:
    """The SelectionGroup a sampler opens its session with; None for a sampler on its own (no seed, world 1).

    ``seed`` None: ranks of a world > 1 take one derived from the group id. ``group_id`` None: a world 1 sampler
    gets a group of its own; ranks of a world > 1 share ``torch:<MASTER_ADDR>:<MASTER_PORT>`` under
    torch.distributed, else a name made of the table, world size and seed. ``from_torch`` False: never
    from torch.distributed (Client.sample, Reverb's API, samples on its own as Reverb's does).
    """
    if rank is None and world_size is None and from_torch:
        found = torch_ranks()
        if found is not None:
            rank, world_size = found
    if world_size is None and rank is not None:
        raise ValueError("rank given without world_size")
    world = 1 if world_size is None else int(world_size)
    rank = 0 if rank is None else int(rank)
    if world < 1:
        raise ValueError(f"world_size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world_size {world})")
    if world == 1 and seed is None and group_id is None:
        return None
    if group_id is None:
        if world == 1:
            group_id = f"{table}:solo:{secrets.token_hex(8)}"
        elif "MASTER_PORT" in os.environ and torch_ranks() is not None:
            group_id = f"torch:{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
        else:
            group_id = f"{table}:w{world}:s{seed}"
    if seed is None:
        seed = zlib.crc32(group_id.encode()) if world > 1 else secrets.randbits(63)
    return pb.SelectionGroup(group_id=group_id, world_size=world, rank=rank, seed=int(seed) & _MASK64)
