"""A Select's answer framed by hand (the local lane's) against the same answer built by protobuf."""

from __future__ import annotations

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_server.data_planes.manager import SELECT_TENSORS, encode_select_response, fill_select_tensors
from gear_server.rpc.table_calls import JoinedSelection
from tests.support.tables import item, make_table


def _head(joined: JoinedSelection, table) -> pb.SelectResponse:
    head = pb.SelectResponse(layout_version=int(joined.layout_version), lease_id=41)
    head.batch_lease_ids.extend([41, 42])
    head.batch_sizes.extend([len(p) for p in joined.parts])
    head.stale_lease_ids.extend([3, 2**40])
    head.layout.CopyFrom(table.layout().to_proto())
    return head


@pytest.mark.parametrize("sizes", [[1], [5], [300], [7, 300]])
def test_hand_framed_select_answer_parses_as_the_protobuf_one(store, sizes):
    """Every field, the per-item arrays (strided ones, lengths of two columns) in wire dtypes included."""
    table = make_table(store, sampler="prioritized", max_size=64, seed=3)
    for key in range(40):
        table.insert(item(key, priority=1.0 + key % 7, length=1 + key % 4))
    parts = [table.sample(n, by_reference=True) for n in sizes]
    joined = JoinedSelection(parts)
    head = _head(joined, table)
    want = pb.SelectResponse()
    want.CopyFrom(head)
    fill_select_tensors(want, joined)
    for _ in range(2):  # the second from the cached tensor prefixes
        got = pb.SelectResponse.FromString(encode_select_response(head, joined))
        assert got == want
    n = sum(sizes)
    assert np.frombuffer(got.keys.data, "<u8").tolist() == joined.keys.tolist()
    assert np.frombuffer(got.times_sampled.data, "<i4").tolist() == joined.times_sampled.tolist()
    assert list(got.lengths.shape) == [n, 2]
    assert np.frombuffer(got.lengths.data, "<i4").reshape(n, 2).tolist() == joined.lengths.tolist()
    for name, dtype in SELECT_TENSORS:
        assert getattr(got, name).dtype == dtype and getattr(got, name).shape[0] == n
    for part in parts:
        table.release(part.lease_id)
    table.close()
