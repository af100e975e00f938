"""Hand-written wire-format pieces agree with protobuf's own encoding."""

from __future__ import annotations

import pytest

from gear_contract._proto import replay_pb2 as pb
from gear_contract.wire import encode_varint, length_prefix, read_varint, skip_field

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
