"""What Reverb code meets without TensorFlow: the structured writer's errors in Reverb's words, and gear's
Python datasets refusing Reverb's tf.data arguments with a message that says where those classes are."""

from __future__ import annotations

import numpy as np
import pytest

import gear_client as reverb
from gear_client import structured_writer as sw


@pytest.fixture(scope="module")
def client():
    server = reverb.Server([reverb.Table.queue("q", 100)])
    yield reverb.Client(f"localhost:{server.port}")
    server.stop()


STEP = {"a": np.zeros([], np.float32), "b": {"c": np.zeros([2, 2], np.int32), "d": [np.zeros(3), np.zeros(6)]}}
REF = sw.create_reference_step(STEP)


def test_flattened_length_error_is_reverbs(client):
    writer = client.structured_writer([sw.create_config(REF["b"]["c"][-1], "q")])
    writer.append({"a": 1, "b": {"c": 1}})
    with pytest.raises(ValueError) as e:
        writer.append({"a": 2, "b": {"c": 2, "d": [2, 2]}})
    assert str(e.value) == "Flattened data has an unexpected length, got 4 but wanted 2."
    writer.close()


def test_wrong_dtype_error_names_the_column_and_its_path(client):
    writer = client.structured_writer([sw.create_config(REF["b"]["c"][-1], "q")])
    writer.append({"a": 1, "b": {"c": 1.0}})
    with pytest.raises(ValueError) as e:
        writer.append({"a": 2, "b": {"c": 2}})
    assert str(e.value) == ("Tensor of wrong dtype provided for column 1 (path=('b', 'c')). Got int64 but expected "
                            "double.")
    writer.append({"a": 3, "b": {"c": 3.0}})  # the refused step changed nothing
    writer.close()


def test_incompatible_shape_error_names_the_column_and_its_path(client):
    writer = client.structured_writer([sw.create_config(REF["b"]["d"][1][-1], "q")])
    writer.append({"a": 1, "b": {"c": 1.0, "d": [1, 1]}})
    with pytest.raises(ValueError) as e:
        writer.append({"a": 2, "b": {"c": 2.0, "d": [2, np.array([[2, 2], [2, 2]])]}})
    assert str(e.value) == ("Tensor of incompatible shape provided for column 3 (path=('b', 'd', 1)). Got [2,2] which "
                            "is incompatible with [].")
    writer.close()


@pytest.mark.parametrize("cls", [reverb.TrajectoryDataset, reverb.TimestepDataset])
def test_reverb_keywords_say_where_reverbs_datasets_are(cls, client):
    name = cls.__name__
    with pytest.raises(TypeError) as e:
        cls(client.server_address, "q", max_in_flight_samples_per_worker=10)
    message = str(e.value)
    assert "'max_in_flight_samples_per_worker'" in message and f"gear_client.tf.datasets.{name}" in message
    assert "alias/reverb" in message and "batch_size" in message
    with pytest.raises(TypeError, match=f"gear_client.tf.datasets.{name}"):
        cls(client.server_address, "q", {"x": np.float32}, {"x": []}, 10)  # Reverb's positional form
    with pytest.raises(AttributeError) as e:
        cls.from_table_signature(client.server_address, "q", 10)
    assert f"gear_client.tf.datasets.{name}" in str(e.value) and "from_table_signature" in str(e.value)
    assert not hasattr(cls, "from_table_signature")


def test_an_unknown_keyword_is_still_a_plain_type_error(client):
    with pytest.raises(TypeError) as e:
        reverb.TrajectoryDataset(client.server_address, "q", 4, bogus=1)
    assert "'bogus'" in str(e.value) and "gear_client.tf.datasets" not in str(e.value)
