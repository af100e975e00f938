"""Protobuf wire-format pieces written and read by hand around raw buffers.

The insert and sample paths frame multi-MiB column buffers themselves so the
bytes are copied once (protobuf would copy them into and out of messages);
everything small is still encoded by protobuf. Field numbers come from
protos/gear/v1/replay.proto.
"""

from __future__ import annotations

import functools

_VARINT1 = [bytes((i,)) for i in range(128)]


@functools.lru_cache(maxsize=4096)
def _encode_varint_long(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int (small values from a table: this is on hot paths)."""
    if n < 0x80:
        return _VARINT1[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    return _encode_varint_long(n)


def length_prefix(tag_byte: int, length: int) -> bytes:
    """A length-delimited field's key (field numbers < 16) and its length."""
    return bytes((tag_byte,)) + encode_varint(length)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError on a truncated or over-long varint."""
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint in sample response")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long in sample response")


def skip_field(buf: memoryview, pos: int, wire_type: int) -> int:
    """Position after a field's value of the given wire type."""
    if wire_type == 0:
        return read_varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        length, pos = read_varint(buf, pos)
        return pos + length
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire_type} in sample response")
