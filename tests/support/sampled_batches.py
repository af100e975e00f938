"""SampledBatches built by hand whose every field tells its item, for the sharded assembly tests."""

from __future__ import annotations

import numpy as np

from gear_client.data_planes.batch import SampledBatch
from gear_contract import nest


def batch_part(keys, steps, plane):
    """A shard's part: keys as given, a flag column holding the key and [steps, 2] obs filled with it."""
    n = len(keys)
    obs = np.stack([np.full((steps, 2), k, np.float32) for k in keys])
    flag = np.array(keys, np.int64)
    return SampledBatch(np.array(keys, np.uint64), np.full(n, 0.5), np.full(n, 9), np.ones(n), np.ones(n, np.int32),
                        [flag, obs], np.array([[1, steps]] * n, np.int32), nest.structure_of((0, 0)),
                        (True, False), plane=plane)


def batch_chunk(first_key, n, steps):
    """A read-ahead chunk whose every field tells its item (key k: probability k/1000, priority k, ...)."""
    keys = np.arange(first_key, first_key + n)
    obs = np.stack([np.full((steps, 2), k, np.float32) for k in keys])
    return SampledBatch(keys.astype(np.uint64), keys / 1000.0, keys.astype(np.int64) * 10, keys * 1.0,
                        keys.astype(np.int32), [keys.astype(np.int64), obs],
                        np.stack([np.ones(n), np.full(n, steps)], axis=1).astype(np.int32),
                        nest.structure_of((0, 0)), (True, False), plane="shm")


class HostView:
    """A SampledBatch gathered on a GPU, its columns copied to the host (for ``trajectories.check_batch``)."""

    def __init__(self, batch):
        self.columns = [c.get() for c in batch.columns]
        self.lengths, self.keys = batch.lengths, batch.keys

    def __len__(self) -> int:
        return len(self.keys)
