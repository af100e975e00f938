"""Signatures compare flattened leaves, as Reverb.

Reverb checks an item against its table's signature leaf by leaf after flattening
both: the nest's containers do not matter (an item ``[x]`` fits a signature
``TensorSpec``), and a leaf may match its spec as the whole trajectory or as one step.
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.table import ItemToInsert
from tests.support.tables import LEAF, make_table

ONE_LIST = pb.Structure(kind=pb.Structure.LIST, children=[pb.Structure()])
PAIR_DICT = pb.Structure(kind=pb.Structure.DICT, keys=["a", "b"], children=[pb.Structure(), pb.Structure()])
PAIR_TUPLE = pb.Structure(kind=pb.Structure.TUPLE, children=[pb.Structure(), pb.Structure()])


def signature(structure: pb.Structure, *leaves: tuple[str, list[int]]) -> pb.Signature:
    return pb.Signature(structure=structure, leaves=[pb.TensorSpec(dtype=d, shape=s) for d, s in leaves])


def column_item(key: int, structure: pb.Structure, *columns: np.ndarray, squeeze: bool = False) -> ItemToInsert:
    return ItemToInsert(key=key, priority=1.0, structure=structure, columns=list(columns),
                        squeeze=[squeeze] * len(columns))


def stored(table, key: int) -> list[np.ndarray]:
    sel = table.sample(1)
    try:
        assert int(sel.keys[0]) == key
        return table.read(sel)
    finally:
        table.release(sel.lease_id)


def test_a_scalar_spec_takes_one_step_items(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1,
                       signature=signature(LEAF, ("<i8", [])))
    table.insert(column_item(1, LEAF, np.array([7], np.int64)))  # one step of a scalar: Reverb's client.insert(7)
    (col,) = stored(table, 1)
    assert col.tolist() == [7]
    table.insert(column_item(2, LEAF, np.array([1, 2, 3], np.int64)))  # three steps, each a scalar
    (col,) = stored(table, 2)
    assert col.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"shape \[1, 2\] \(steps of \[2\]\).*says \[\]"):
        table.insert(column_item(3, LEAF, np.zeros((1, 2), np.int64)))
    with pytest.raises(ValueError, match="dtype int32 but the signature says int64"):
        table.insert(column_item(4, LEAF, np.zeros(1, np.int32)))
    assert len(table) == 0
    table.close()


def test_an_item_nested_differently_fits_a_signature_with_the_same_leaves(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1,
                       signature=signature(LEAF, ("<i8", [1])))
    table.insert(column_item(1, ONE_LIST, np.array([0], np.int64)))  # client.insert([np.int64(0)])
    (col,) = stored(table, 1)
    assert col.tolist() == [0]
    table.close()
    pair = make_table(store, name="pair", sampler="fifo", remover="fifo", max_times_sampled=1,
                      signature=signature(PAIR_TUPLE, ("<f4", [-1, 2]), ("<i8", [])))
    pair.insert(column_item(5, PAIR_DICT, np.ones((3, 2), np.float32), np.arange(3, dtype=np.int64)))
    a, b = stored(pair, 5)
    assert a.shape == (3, 2) and b.tolist() == [0, 1, 2]
    assert pair.layout().structure == PAIR_TUPLE  # items are kept in the signature's structure
    with pytest.raises(ValueError, match=r"1 flattened leaves \(\['0'\]\) but the signature has 2"):
        pair.insert(column_item(6, ONE_LIST, np.ones((3, 2), np.float32)))
    pair.close()


def test_a_squeezed_column_matches_its_spec_with_or_without_a_unit_time_dimension(store):
    table = make_table(store, sampler="fifo", remover="fifo", max_times_sampled=1,
                       signature=signature(LEAF, ("<f4", [3])))
    table.insert(column_item(1, LEAF, np.ones(3, np.float32), squeeze=True))
    assert stored(table, 1)[0].shape == (1, 3)
    table.close()
    unit = make_table(store, name="unit", sampler="fifo", remover="fifo", max_times_sampled=1,
                      signature=signature(LEAF, ("<f4", [1, 3])))
    unit.insert(column_item(2, LEAF, np.ones(3, np.float32), squeeze=True))
    assert stored(unit, 2)[0].shape == (1, 3)
    unit.close()


def test_reverb_clients_insert_into_signed_queues_as_in_the_issue():
    import gear_client as reverb
    from gear_contract.specs import TensorSpec

    server = reverb.Server([reverb.Table.queue("q", 10, signature=TensorSpec([], np.int64)),
                            reverb.Table.queue("q1", 10, signature=TensorSpec([1], np.int64))])
    try:
        client = reverb.Client(f"localhost:{server.port}")
        client.insert(1, {"q": 1.0})
        client.insert([np.int64(0)], {"q1": 1.0})
        (step,) = next(iter(client.sample("q", 1)))
        assert int(np.asarray(step.data[0])) == 1
        (step,) = next(iter(client.sample("q1", 1)))
        assert int(np.asarray(step.data[0]).reshape(-1)[0]) == 0
    finally:
        server.stop()
