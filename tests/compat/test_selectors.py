"""Selectors: reported probabilities, order of Fifo/Lifo, heaps and their tie-breaking."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.support.compat import gear_only, isclose, reverb, sample_one


def _value(sample) -> int:
    return int(sample.data[0][0])


def test_uniform_reports_one_over_size(client):
    for i in range(4):
        client.insert(np.int64(i), {"uniform": float(i + 1)})
    values = set()
    for s in client.sample("uniform", 40, emit_timesteps=False):
        assert isclose(s.info.probability, 0.25)
        assert s.info.table_size == 4
        values.add(_value(s))
    assert values == {0, 1, 2, 3}


def test_prioritized_reports_weight_over_total_weight(client):
    priorities = [1.0, 2.0, 3.0, 4.0]
    for i, p in enumerate(priorities):
        client.insert(np.int64(i), {"prioritized": p})
    counts = np.zeros(4)
    for s in client.sample("prioritized", 400, emit_timesteps=False):
        i = _value(s)
        assert s.info.priority == priorities[i]
        assert isclose(s.info.probability, priorities[i] / 10.0)
        counts[i] += 1
    # 400 draws with p = 0.1 .. 0.4: the rarest item is drawn 40 +- 6 times.
    assert counts[3] > counts[0] and counts[0] > 10


def test_prioritized_exponent_zero_gives_priority_zero_no_weight(client):
    for i, p in enumerate([0.0, 1.0, 5.0]):
        client.insert(np.int64(i), {"prioritized_exp0": p})
    values = set()
    for s in client.sample("prioritized_exp0", 60, emit_timesteps=False):
        values.add(_value(s))
        assert isclose(s.info.probability, 0.5)
    assert values == {1, 2}


def test_prioritized_all_zero_priorities_fall_back_to_uniform(client):
    for i in range(3):
        client.insert(np.int64(i), {"prioritized": 0.0})
    values = set()
    for s in client.sample("prioritized", 60, emit_timesteps=False):
        values.add(_value(s))
        assert isclose(s.info.probability, 1 / 3)
    assert values == {0, 1, 2}


def test_prioritized_probabilities_follow_mutated_priorities(client):
    for i in range(2):
        client.insert(np.int64(i), {"prioritized": 1.0})
    key0 = next(s.info.key for s in client.sample("prioritized", 100, emit_timesteps=False) if _value(s) == 0)
    client.mutate_priorities("prioritized", updates={key0: 3.0})
    for s in client.sample("prioritized", 20, emit_timesteps=False):
        assert isclose(s.info.probability, 0.75 if s.info.key == key0 else 0.25)


@gear_only
@pytest.mark.parametrize("priority", [-1.0, math.nan])
def test_prioritized_rejects_negative_or_nan_priorities(client, priority):
    with pytest.raises(ValueError):
        client.insert(np.int64(0), {"prioritized": priority})
    client.insert(np.int64(1), {"prioritized": 1.0})
    with pytest.raises(ValueError):
        client.mutate_priorities("prioritized", updates={sample_one(client, "prioritized").info.key: priority})
    s = sample_one(client, "prioritized")
    assert s.info.priority == 1.0 and s.info.table_size == 1


@pytest.mark.parametrize("table", ["fifo", "lifo", "max_heap", "min_heap"])
def test_deterministic_selectors_report_probability_one(client, table):
    for i in range(3):
        client.insert(np.int64(i), {table: float(i + 1)})
    assert sample_one(client, table).info.probability == 1.0


def test_fifo_order_ignores_priority_updates(client):
    for i, p in enumerate([1.0, 2.0, 3.0]):
        client.insert(np.int64(i), {"fifo": p})
    first = sample_one(client, "fifo")
    assert _value(first) == 0
    client.mutate_priorities("fifo", updates={first.info.key: 100.0})
    again = sample_one(client, "fifo")
    assert _value(again) == 0 and again.info.priority == 100.0
    client.mutate_priorities("fifo", deletes=[first.info.key])
    assert _value(sample_one(client, "fifo")) == 1


def test_lifo_order_ignores_priority_updates(client):
    for i in range(3):
        client.insert(np.int64(i), {"lifo": 1.0})
    newest = sample_one(client, "lifo")
    assert _value(newest) == 2
    client.mutate_priorities("lifo", deletes=[newest.info.key])
    middle = sample_one(client, "lifo")
    assert _value(middle) == 1
    # Update the oldest item: it must not become the "newest".
    keys = {}
    client.mutate_priorities("lifo", deletes=[middle.info.key])
    oldest = sample_one(client, "lifo")
    assert _value(oldest) == 0
    keys[0] = oldest.info.key
    client.insert(np.int64(3), {"lifo": 1.0})
    client.mutate_priorities("lifo", updates={keys[0]: 50.0})
    assert _value(sample_one(client, "lifo")) == 3


def test_max_heap_samples_the_highest_priority(client):
    for i, p in enumerate([2.0, 9.0, 4.0]):
        client.insert(np.int64(i), {"max_heap": p})
    top = sample_one(client, "max_heap")
    assert _value(top) == 1 and top.info.priority == 9.0
    client.mutate_priorities("max_heap", updates={top.info.key: 0.5})
    assert _value(sample_one(client, "max_heap")) == 2


def test_min_heap_samples_the_lowest_priority(client):
    for i, p in enumerate([2.0, 9.0, 1.0]):
        client.insert(np.int64(i), {"min_heap": p})
    low = sample_one(client, "min_heap")
    assert _value(low) == 2
    client.mutate_priorities("min_heap", updates={low.info.key: 10.0})
    assert _value(sample_one(client, "min_heap")) == 0


@pytest.mark.parametrize("table", ["max_heap", "min_heap"])
def test_heaps_break_ties_by_least_recently_inserted_or_updated(client, table):
    for i in range(3):
        client.insert(np.int64(i), {table: 1.0})
    first = sample_one(client, table)
    assert _value(first) == 0
    # Re-setting the same priority makes item 0 the most recently updated.
    client.mutate_priorities(table, updates={first.info.key: 1.0})
    second = sample_one(client, table)
    assert _value(second) == 1
    client.mutate_priorities(table, updates={second.info.key: 1.0})
    assert _value(sample_one(client, table)) == 2


def test_selector_objects_construct_like_reverb():
    sel = reverb.selectors
    for selector in (sel.Uniform(), sel.Fifo(), sel.Lifo(), sel.MaxHeap(), sel.MinHeap(), sel.Prioritized(0.8)):
        table = reverb.Table("t", selector, sel.Fifo(), 3, reverb.rate_limiters.MinSize(1))
        assert table.info.max_size == 3
    assert reverb.Table("t", sel.Prioritized(0.8), sel.Fifo(), 3,
                        reverb.rate_limiters.MinSize(1)).info.sampler_options.prioritized.priority_exponent \
        == pytest.approx(0.8)
