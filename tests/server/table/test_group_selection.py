"""A table's seeded picks and split leases: what a selection group's steps rest on."""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract.selectors import step_rng
from tests.support.tables import item, make_table


@pytest.fixture
def table(store):
    t = make_table(store, sampler="prioritized", max_size=16)
    for key in range(1, 9):
        t.insert(item(key, priority=float(key)))
    yield t
    t.close()


def test_a_seeded_generator_repeats_the_picks_of_one_table_state(table):
    a = table.sample(12, rng=step_rng(5, 3))
    b = table.sample(12, rng=step_rng(5, 3))
    c = table.sample(12, rng=step_rng(5, 4))
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.probabilities, b.probabilities)
    assert not np.array_equal(a.keys, c.keys)
    for s in (a, b, c):
        table.release(s.lease_id)


def test_split_leases_hold_the_slots_until_the_last_part_ends(table):
    selection = table.sample(10, rng=step_rng(1, 0))  # with repeats of some slots among 8 items
    held = table.meta.leases.copy()
    first = table.split_lease(selection.lease_id, 0, 4)
    second = table.split_lease(selection.lease_id, 2, 6)  # picks 6..9 of the original (2 left: 4, 5)
    assert np.array_equal(table.meta.leases, held)  # moving picks between leases changes no count
    table.release(first)
    table.release(second)
    assert table.active_leases() == 1
    table.release(selection.lease_id)  # the picks 4, 5 still in it
    assert table.active_leases() == 0 and not table.meta.leases.any()
    with pytest.raises(KeyError, match="not held"):
        table.split_lease(selection.lease_id, 0, 1)
