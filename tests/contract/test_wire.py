"""Hand-framed wire pieces (gear_contract/wire.py) round-trip through protobuf's own encoder and parser."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_contract.wire import (
    HAND_DECODE_MIN_BYTES,
    decode_sample_response,
    decode_sample_response_by_hand,
    decode_sample_response_by_protobuf,
    encode_chunk_head,
    encode_insert_item,
    encode_release_keys,
    encode_sample_response,
    encode_varint,
    length_prefix,
    mark_resend,
    read_varint,
    skip_field,
)

VALUES = [1, 127, 128, 300, 16383, 16384, 2**21, 2**35 + 7, 2**63 - 1, 2**64 - 1]


@pytest.mark.parametrize("n", VALUES)
def test_varints_match_protobuf_and_read_back(n):
    encoded = pb.SampleInfo(key=n).SerializeToString()  # field 1, wire type 0: b"\x08" + varint
    assert encoded == b"\x08" + encode_varint(n)
    assert read_varint(memoryview(encoded), 1) == (n, len(encoded))


def test_zero_is_one_byte():
    assert encode_varint(0) == b"\x00"
    assert read_varint(memoryview(b"\x00"), 0) == (0, 1)


def test_length_prefix_frames_a_bytes_field_like_protobuf():
    data = b"x" * 200
    assert pb.Tensor(data=data).SerializeToString() == length_prefix(0x1A, len(data)) + data


def test_truncated_and_over_long_varints_are_refused():
    with pytest.raises(ValueError, match="truncated"):
        read_varint(memoryview(b"\x80\x80"), 0)
    with pytest.raises(ValueError, match="too long"):
        read_varint(memoryview(b"\xff" * 11), 0)


def test_skip_field_passes_every_wire_type():
    buf = memoryview(b"\x96\x01" + b"\x00" * 8 + b"\x03abc" + b"\x00" * 4)
    assert skip_field(buf, 0, 0) == 2
    assert skip_field(buf, 2, 1) == 10
    assert skip_field(buf, 10, 2) == 14
    assert skip_field(buf, 14, 5) == 18
    with pytest.raises(ValueError, match="wire type 3"):
        skip_field(buf, 0, 3)


# ------------------------------------------------- every framed message vs protobuf's own parser ----

def test_insert_request_pieces_parse_as_protobuf():
    data = np.arange(12, dtype=np.int16).reshape(3, 4)
    view = memoryview(data).cast("B")
    structure = pb.Structure(kind=pb.Structure.DICT, keys=["a"], children=[pb.Structure()])
    raw = b"".join([
        encode_chunk_head(300, b"<i2", data.shape, view.nbytes, 2**64 - 1, 70000), view,
        encode_insert_item(2**63 + 5, "tåble".encode(), 0.25, structure.SerializeToString(),
                           [([(300, 0, 2), (7, 1, 1)], False), ([(300, 2, 1)], True)]),
        encode_release_keys([1, 300, 2**40]),
    ])
    expected = pb.InsertStreamRequest(
        chunks=[pb.ChunkData(chunk_key=300, episode_id=2**64 - 1, episode_step=70000,
                             data=pb.Tensor(dtype="<i2", shape=[3, 4], data=data.tobytes()))],
        items=[pb.PrioritizedItem(key=2**63 + 5, table="tåble", priority=0.25, structure=structure, columns=[
            pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=300, offset=0, length=2),
                                  pb.ColumnSlice(chunk_key=7, offset=1, length=1)]),
            pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=300, offset=2, length=1)], squeeze=True)])],
        release_chunk_keys=[1, 300, 2**40])
    assert pb.InsertStreamRequest.FromString(raw) == expected
    assert encode_release_keys([]) == b""
    # a resent item: the same, with PrioritizedItem.resend set
    item = encode_insert_item(7, b"t", 1.0, b"", [([(1, 0, 1)], True)])
    resent = pb.InsertStreamRequest.FromString(mark_resend(item)).items[0]
    assert resent.resend and resent.key == 7 and resent.columns[0].squeeze
    assert resent == pb.PrioritizedItem(key=7, table="t", priority=1.0, structure=pb.Structure(), resend=True,
                                        columns=[pb.ItemColumn(slices=[pb.ColumnSlice(chunk_key=1, length=1)],
                                                               squeeze=True)])
    with pytest.raises(ValueError):
        mark_resend(encode_release_keys([1]))


@pytest.mark.parametrize("rows", [1, 7, 600])
def test_chunk_heads_frame_any_size_like_protobuf(rows):
    data = np.random.default_rng(rows).random((rows, 1024), dtype=np.float32)  # up to 2.3 MiB
    view = memoryview(data.reshape(-1).view(np.uint8))
    raw = encode_chunk_head(5, b"<f4", data.shape, view.nbytes, 9, 3) + bytes(view)
    chunk = pb.ChunkData(chunk_key=5, episode_id=9, episode_step=3,
                         data=pb.Tensor(dtype="<f4", shape=data.shape, data=data.tobytes()))
    assert pb.InsertStreamRequest.FromString(raw) == pb.InsertStreamRequest(chunks=[chunk])
    # the raw rows come last (framed around the column buffer), the rest as protobuf writes it
    assert raw.endswith(data.tobytes())


def _sample_parts(items: int, steps: int, obs: int = 16):
    rng = np.random.default_rng(items * 1000 + steps)
    obs_col = rng.random((items * steps, obs), dtype=np.float32)
    act_col = np.arange(items, dtype=np.int64)  # squeezed: one step per item
    infos = [pb.SampleInfo(key=2**40 + i, probability=0.5, table_size=items, priority=1.0 + i, times_sampled=i)
             for i in range(items)]
    lengths = np.tile(np.array([[1, steps]], np.int32), (items, 1))
    structure = pb.Structure(kind=pb.Structure.DICT, keys=["act", "obs"], children=[pb.Structure(), pb.Structure()])
    columns = [(act_col.dtype, (), [act_col[i:i + 1] for i in range(items)]),
               (obs_col.dtype, (obs,), [obs_col[i * steps:(i + 1) * steps] for i in range(items)])]
    expected = pb.SampleResponse(batch=pb.SampleBatch(
        info=infos, lengths=lengths.reshape(-1).tolist(), structure=structure, squeeze=[True, False],
        columns=[pb.Tensor(dtype="<i8", shape=[items], data=act_col.tobytes()),
                 pb.Tensor(dtype="<f4", shape=[items * steps, obs], data=obs_col.tobytes())]))
    return infos, lengths, structure, columns, expected, (act_col, obs_col)


@pytest.mark.parametrize("items,steps,obs", [(1, 1, 1), (32, 4, 16), (256, 2, 512)])
def test_sample_responses_round_trip_through_protobuf(items, steps, obs):
    infos, lengths, structure, columns, expected, arrays = _sample_parts(items, steps, obs)
    raw = encode_sample_response(infos, lengths, structure, [True, False], columns)
    # hand-encoded -> protobuf's parser
    assert pb.SampleResponse.FromString(raw) == expected
    # protobuf-encoded (small fields first, the order protobuf writes) -> hand decoder, and the hand-encoded one
    decoders = (decode_sample_response, decode_sample_response_by_hand, decode_sample_response_by_protobuf)
    for message, decode, writable in itertools.product((expected.SerializeToString(), raw), decoders, (False, True)):
        view = decode(message, writable=writable)
        assert list(view.infos) == infos and view.num_items == items
        assert view.squeeze == [True, False] and view.structure == structure
        np.testing.assert_array_equal(view.lengths, lengths)
        for got, want in zip(view.columns, arrays, strict=True):
            np.testing.assert_array_equal(got, want)
            assert got.flags.writeable == writable
        np.testing.assert_array_equal(view.item_columns(items - 1)[1], arrays[1][(items - 1) * steps:])


def test_hand_decoded_columns_view_the_message():
    infos, lengths, structure, columns, _, arrays = _sample_parts(8, 2)
    raw = encode_sample_response(infos, lengths, structure, [True, False], columns)
    view = decode_sample_response_by_hand(raw)
    assert all(np.shares_memory(np.frombuffer(raw, np.uint8), c) for c in view.columns)  # no copy


def _encoded(items: int, steps: int, obs: int) -> bytes:
    infos, lengths, structure, columns, _, _ = _sample_parts(items, steps, obs)
    return encode_sample_response(infos, lengths, structure, [True, False], columns)


def test_small_responses_go_to_protobuf_large_ones_are_framed_by_hand():
    small, large = _encoded(2, 1, 16), _encoded(64, 2, 256)
    assert len(small) < HAND_DECODE_MIN_BYTES <= len(large)
    view = decode_sample_response(large)
    assert all(np.shares_memory(np.frombuffer(large, np.uint8), c) for c in view.columns)  # framed by hand
    view = decode_sample_response(small)
    assert not any(np.shares_memory(np.frombuffer(small, np.uint8), c) for c in view.columns)  # protobuf's copy


def test_malformed_sample_responses_are_refused():
    infos, lengths, structure, columns, _, _ = _sample_parts(4, 2)
    raw = encode_sample_response(infos, lengths, structure, [True, False], columns)
    with pytest.raises(ValueError, match="truncated"):
        decode_sample_response_by_hand(raw[:-200])
    bad = pb.SampleResponse(batch=pb.SampleBatch(columns=[pb.Tensor(dtype="<f4", shape=[3], data=b"\0" * 8)]))
    with pytest.raises(ValueError, match="holds 8 bytes"):
        decode_sample_response(bad.SerializeToString())
