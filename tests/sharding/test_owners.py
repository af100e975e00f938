"""The key -> shard cache a sharded client routes mutations with (gear_client.sharding.owners)."""

import numpy as np

from gear_client.sharding.owners import UNKNOWN, KeyOwners


def test_owners_found_newest_first_and_unknown_keys_marked():
    owners = KeyOwners()
    owners.learn(np.array([5, 1, 9], np.uint64), 0)
    owners.learn(np.array([7, 3], np.uint64), 2)
    owners.learn(np.array([9], np.uint64), 1)  # sampled again from another shard: the latest answer wins
    got = owners.owners(np.array([1, 3, 9, 42, 5, 7], np.uint64))
    assert got.tolist() == [0, 2, 1, UNKNOWN, 0, 2]
    assert owners.owners([]).tolist() == []


def test_learnt_keys_are_copied():
    owners = KeyOwners()
    keys = np.array([10, 11], np.uint64)
    owners.learn(keys, 3)
    keys[:] = 99  # the batch's buffer reused
    assert owners.owners([10, 11, 99]).tolist() == [3, 3, UNKNOWN]


def test_bounded_by_dropping_the_oldest_arrays():
    owners = KeyOwners(max_keys=10)
    for i in range(6):
        owners.learn(np.arange(4 * i, 4 * i + 4, dtype=np.uint64), i)
    assert len(owners) <= 10
    got = owners.owners(np.arange(24, dtype=np.uint64))
    assert (got[:16] == UNKNOWN).all()  # the four oldest arrays are gone
    assert got[16:].tolist() == [4] * 4 + [5] * 4


def test_forget_drops_keys_everywhere():
    owners = KeyOwners()
    owners.learn(np.array([1, 2, 3], np.uint64), 0)
    owners.learn(np.array([3, 4], np.uint64), 1)
    owners.forget([3, 4, 100])
    assert owners.owners([1, 2, 3, 4]).tolist() == [0, 0, UNKNOWN, UNKNOWN]
    assert len(owners) == 2
    owners.learn(np.array([3], np.uint64), 1)
    assert owners.owners([3]).tolist() == [1]
