"""Errors: the exception types and what each failing call raises."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.compat import gear_only, info_of, reverb, sample_one


def test_error_types():
    assert issubclass(reverb.ReverbError, Exception)
    assert issubclass(reverb.DeadlineExceededError, reverb.ReverbError)
    assert reverb.errors.DeadlineExceededError is reverb.DeadlineExceededError
    assert reverb.errors.ReverbError is reverb.ReverbError


def test_unknown_table_in_sample_is_a_runtime_error_naming_it(client):
    with pytest.raises(RuntimeError, match="missing_table"):
        list(client.sample("missing_table", 1))


def test_unknown_table_in_mutate_priorities_is_a_runtime_error_naming_it(client):
    with pytest.raises(RuntimeError, match="missing_table"):
        client.mutate_priorities("missing_table", updates={1: 1.0})


def test_unknown_table_in_reset_is_a_runtime_error_naming_it(client):
    with pytest.raises(RuntimeError, match="missing_table"):
        client.reset("missing_table")


def test_unknown_table_in_insert_is_a_value_error_naming_it(client):
    with pytest.raises(ValueError, match="missing_table"):
        client.insert(np.zeros(2), {"missing_table": 1.0})
    # The client and the server go on working.
    client.insert(np.zeros(2), {"uniform": 1.0})
    assert info_of(client, "uniform").current_size == 1


def test_unknown_table_in_create_item_is_a_value_error_naming_it(client):
    with client.trajectory_writer(1) as writer:
        writer.append({"a": np.int32(1)})
        with pytest.raises(ValueError, match="missing_table"):
            writer.create_item("missing_table", 1.0, {"a": writer.history["a"][-1]})
        writer.create_item("fifo", 1.0, {"a": writer.history["a"][-1]})
    assert info_of(client, "fifo").current_size == 1


@gear_only
def test_negative_priority_is_a_value_error_and_the_server_keeps_serving(client):
    client.insert(np.int64(1), {"prioritized": 1.0})
    with pytest.raises(ValueError):
        client.insert(np.int64(2), {"prioritized": -1.0})
    with pytest.raises(ValueError):
        with client.trajectory_writer(1) as writer:
            writer.append({"a": np.int64(3)})
            writer.create_item("prioritized", -0.5, {"a": writer.history["a"][-1]})
    key = sample_one(client, "prioritized").info.key
    with pytest.raises(ValueError):
        client.mutate_priorities("prioritized", updates={key: -2.0})
    s = sample_one(client, "prioritized")
    assert s.info.key == key and s.info.priority == 1.0 and s.info.table_size == 1
    client.insert(np.int64(4), {"prioritized": 3.0})
    assert info_of(client, "prioritized").current_size == 2


def test_deadline_exceeded_is_catchable_as_reverb_error(client):
    writer = client.trajectory_writer(1)
    try:
        for value in (0, 1):
            writer.append({"x": np.int64(value)})
            writer.create_item("tiny_queue", 1.0, {"x": writer.history["x"][-1]})
        with pytest.raises(reverb.ReverbError):
            writer.flush(timeout_ms=200)
        sample_one(client, "tiny_queue")
        writer.flush(timeout_ms=10_000)
    finally:
        writer.close()
