"""Protobuf wire-format pieces written and read by hand around raw buffers: the only such module.

The insert and sample paths frame multi-MiB column buffers themselves so the
bytes are copied once (protobuf would copy them into and out of messages).
Each piece is kept only where ``bench/bench_wire.py`` shows it beats protobuf
(figures in docs/BENCHMARKS.md); release keys and sample responses under
``HAND_DECODE_MIN_BYTES`` are left to protobuf, which is faster there. Field numbers come
from protos/gear/v1/replay.proto; tests/contract/test_wire.py round-trips every
piece through protobuf's own parser.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from gear_contract._proto import replay_pb2 as pb

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


@functools.lru_cache(maxsize=256)
def _tensor_field_prefix(message: type, field: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    """Tensor field ``field`` of ``message``: its key and length, then the Tensor's fields before its data's
    bytes (all fixed by dtype and shape, which a learner's batches repeat: cached)."""
    head = pb.Tensor(dtype=dtype, shape=shape).SerializeToString()
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    data_prefix = length_prefix(pb.Tensor.DESCRIPTOR.fields_by_name["data"].number << 3 | 2, nbytes)
    tag = message.DESCRIPTOR.fields_by_name[field].number << 3 | 2  # every such field number is below 16
    return length_prefix(tag, len(head) + len(data_prefix) + nbytes) + head + data_prefix


def encode_tensor_fields(message: type, arrays: Iterable[tuple[str, np.ndarray]], head: bytes = b"") -> bytes:
    """``head`` (the rest of a ``message``, serialized), then its Tensor fields (field name, array) framed by
    hand around the arrays' bytes, each copied once (a strided one packed on the way): it parses as the
    message with those Tensors set (the Select answer's per-item arrays: one copy, not into a message and
    out again)."""
    pieces: list[Any] = [head]
    for field, a in arrays:
        pieces += (_tensor_field_prefix(message, field, a.dtype.str, tuple(a.shape)), np.ascontiguousarray(a))
    return b"".join(pieces)


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


# ------------------------------------------------------------ insert requests ----
# InsertStreamRequest pieces: the writer joins chunk heads, the chunks' raw rows
# and encoded items into one message (concatenated fields of a message merge).

_DOUBLE = struct.Struct("<d")


def encode_chunk_head(key: int, dtype: bytes, shape: Sequence[int], nbytes: int, episode_id: int,
                      episode_step: int) -> bytes:
    """``InsertStreamRequest.chunks`` (field 1) holding one ChunkData, up to its raw data (``nbytes`` follow)."""
    packed = b"".join([encode_varint(d) for d in shape])
    tensor_head = b"".join((
        b"\x0a", encode_varint(len(dtype)), dtype,            # Tensor.dtype = 1
        b"\x12", encode_varint(len(packed)), packed,          # Tensor.shape = 2 (packed)
        b"\x1a", encode_varint(nbytes),                       # Tensor.data = 3 (the raw bytes follow)
    ))
    chunk_head = b"".join((
        b"\x08", encode_varint(key),                          # ChunkData.chunk_key = 1
        b"\x18", encode_varint(episode_id),                   # ChunkData.episode_id = 3
        b"\x20", encode_varint(episode_step),                 # ChunkData.episode_step = 4
        b"\x12", encode_varint(len(tensor_head) + nbytes), tensor_head,  # ChunkData.data = 2
    ))
    return b"\x0a" + encode_varint(len(chunk_head) + nbytes) + chunk_head


# One item column: its (chunk key, offset, length) slices and whether it is squeezed.
ItemColumnSlices = tuple[Sequence[tuple[int, int, int]], bool]


def encode_insert_item(key: int, table: bytes, priority: float, structure: bytes,
                       columns: Sequence[ItemColumnSlices]) -> bytes:
    """``InsertStreamRequest.items`` (field 2) holding one PrioritizedItem (``structure``: an encoded Structure)."""
    parts = [b"\x08", encode_varint(key),                      # PrioritizedItem.key = 1
             b"\x12", encode_varint(len(table)), table,        # .table = 2
             b"\x19", _DOUBLE.pack(priority),                  # .priority = 3 (fixed64)
             b"\x22", encode_varint(len(structure)), structure]  # .structure = 4
    for slices, squeeze in columns:
        body = []
        for chunk_key, offset, length in slices:
            s = b"".join((b"\x08", encode_varint(chunk_key), b"\x10", encode_varint(offset),
                          b"\x18", encode_varint(length)))
            body += (b"\x0a", encode_varint(len(s)), s)         # ItemColumn.slices = 1
        if squeeze:
            body.append(b"\x10\x01")                            # ItemColumn.squeeze = 2
        encoded = b"".join(body)
        parts += (b"\x2a", encode_varint(len(encoded)), encoded)  # .columns = 5
    item = b"".join(parts)
    return b"\x12" + encode_varint(len(item)) + item


_RESEND = b"\xf0\x0b\x01"  # PrioritizedItem.resend = 190 (varint key 190 << 3), true


def mark_resend(item: bytes) -> bytes:
    """An ``encode_insert_item`` field with ``PrioritizedItem.resend`` set (the item is sent again)."""
    length, start = read_varint(memoryview(item), 1)
    if item[:1] != b"\x12" or start + length != len(item):
        raise ValueError("not an encoded InsertStreamRequest.items field")
    return b"\x12" + encode_varint(length + len(_RESEND)) + item[start:] + _RESEND


def encode_release_keys(keys: Sequence[int]) -> bytes:
    """``InsertStreamRequest.release_chunk_keys`` (field 3); empty for no keys.

    Encoded by protobuf: its packed varints beat a Python loop from a handful of keys on.
    """
    if not keys:
        return b""
    return pb.InsertStreamRequest(release_chunk_keys=keys).SerializeToString()


# ------------------------------------------------------------ priority updates ----
# MutatePrioritiesRequest framed from numpy arrays in one go: built message by
# message, a KeyWithPriority cost about 0.6 us, and reading them back one by one
# on the daemon as much again. Every varint is written 10 bytes wide (a longer
# form than needed is valid protobuf: parsers read up to 10 bytes), so each
# update is one fixed 22-byte record and a batch is one structured array both
# ways. The daemon reads that layout as arrays and leaves any other valid
# encoding (other clients, protobuf's own) to protobuf.

_UPDATE = np.dtype([("head", "u1", (3,)), ("key", "u1", (10,)), ("tag", "u1"), ("priority", "<f8")])
_UPDATE_HEAD = np.array([0x12, 20, 0x08], np.uint8)  # updates = 2 (20 bytes): KeyWithPriority.key = 1
_PRIORITY_TAG = 0x11                                  # KeyWithPriority.priority = 2 (fixed64)
_TABLE_TAG = 0x0A                                     # MutatePrioritiesRequest.table = 1
_DELETES_TAG = 0x1A                                   # .delete_keys = 3 (packed)
_WIDE = 10
_SHIFTS = np.arange(0, 7 * _WIDE, 7, dtype=np.uint64)
_MORE = np.array([0x80] * (_WIDE - 1) + [0], np.uint64)
_LOW7 = np.uint64(0x7F)


@dataclass(frozen=True)
class PriorityUpdates:
    """A decoded MutatePrioritiesRequest: ``keys[i]`` gets ``priorities[i]``; ``deletes`` are removed.
    ``priorities``: a list, or a float64 array (requests read as arrays)."""

    table: str
    keys: list[int]
    priorities: list[float] | np.ndarray
    deletes: list[int]


def _wide_varints(values: np.ndarray) -> np.ndarray:
    """uint8 [n, 10]: each uint64 of ``values`` as a 10-byte varint."""
    return ((values.reshape(-1, 1) >> _SHIFTS) & _LOW7 | _MORE).astype(np.uint8)


def _read_wide_varints(raw: np.ndarray) -> np.ndarray | None:
    """uint64 [n] from uint8 [n, 10]; None when a row is not a 10-byte varint of a uint64."""
    wide = raw.astype(np.uint64)
    if not ((wide[:, :_WIDE - 1] >= 0x80).all() and (wide[:, _WIDE - 1] <= 1).all()):
        return None
    return ((wide & _LOW7) << _SHIFTS).sum(axis=1, dtype=np.uint64)  # disjoint bits: the sum is their or


def encode_mutate_priorities(table: str, keys: np.ndarray, priorities: np.ndarray, deletes: np.ndarray) -> bytes:
    """A serialized MutatePrioritiesRequest: ``keys`` uint64 with ``priorities`` float64, then ``deletes`` uint64.

    Field order: table, delete_keys, updates (any order is valid protobuf; this one lets the
    daemon read the updates as one array).
    """
    if len(keys) != len(priorities):
        raise ValueError(f"{len(keys)} keys but {len(priorities)} priorities")
    name = table.encode()
    parts: list[Any] = []
    if name:
        parts += (bytes((_TABLE_TAG,)), encode_varint(len(name)), name)
    if len(deletes):
        packed = _wide_varints(np.asarray(deletes, np.uint64))
        parts += (bytes((_DELETES_TAG,)), encode_varint(packed.nbytes), packed)
    if len(keys):
        rows = np.empty(len(keys), _UPDATE)
        rows["head"] = _UPDATE_HEAD
        rows["key"] = _wide_varints(np.asarray(keys, np.uint64))
        rows["tag"] = _PRIORITY_TAG
        rows["priority"] = priorities
        parts.append(rows)
    return b"".join(parts)


# Fewer updates and deletes than this are encoded by protobuf (faster there: bench_wire.py).
HAND_ENCODE_MIN_UPDATES = 8


def encode_priority_updates(table: str, updates: Mapping[Any, Any] | None, deletes: Iterable[Any] | None) -> bytes:
    """A serialized MutatePrioritiesRequest of Reverb's arguments: ``updates`` key -> priority, ``deletes`` keys.

    ValueError naming the first key that is not an integer in [0, 2**64) or priority that is not a number.
    """
    updates = updates if updates is not None else {}
    dropped = list(deletes) if deletes is not None else []
    if len(updates) + len(dropped) < HAND_ENCODE_MIN_UPDATES:
        try:
            return pb.MutatePrioritiesRequest(
                table=table, updates=[pb.KeyWithPriority(key=_as_key(k), priority=float(p))
                                      for k, p in updates.items()],
                delete_keys=[_as_key(k) for k in dropped]).SerializeToString()
        except (TypeError, ValueError, OverflowError):
            _explain_bad_update(updates, dropped)
            raise
    return encode_mutate_priorities(table, *priority_arrays(updates, dropped))


def _as_key(key: Any) -> int:
    """An item key as int: an integer, or a float of integral value (5.0); TypeError / ValueError for
    anything else (1.5 is not taken as 1, nor "5" as 5)."""
    try:
        return operator.index(key)
    except TypeError:
        if isinstance(key, (str, bytes)):
            raise
        value = float(key)
        if not value.is_integer():
            raise ValueError(f"{key!r} is not integral") from None
        return int(value)


def priority_arrays(updates: Mapping[Any, Any] | None, deletes: Iterable[Any] | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys uint64, priorities float64, deletes uint64) of Reverb's ``mutate_priorities`` arguments.

    ValueError naming the first key that is not an integer in [0, 2**64) or priority that is not a number.
    """
    updates = updates if updates is not None else {}
    dropped = list(deletes) if deletes is not None else []
    n = len(updates)
    try:
        return (np.fromiter(map(_as_key, updates.keys()), np.uint64, n),
                np.fromiter(map(float, updates.values()), np.float64, n),
                np.fromiter(map(_as_key, dropped), np.uint64, len(dropped)))
    except (TypeError, ValueError, OverflowError):
        _explain_bad_update(updates, dropped)
        raise


def _explain_bad_update(updates: Mapping[Any, Any], deletes: Iterable[Any] | None) -> None:
    """Raise ValueError naming the entry ``priority_arrays`` could not convert (returns if none)."""
    for what, key in [*(("key", k) for k in updates), *(("delete key", k) for k in (deletes or ()))]:
        try:
            if not 0 <= _as_key(key) < 1 << 64:
                raise OverflowError
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{what} {key!r} is not an integer in [0, 2**64)") from None
    for key, priority in updates.items():
        try:
            float(priority)
        except (TypeError, ValueError):
            raise ValueError(f"priority {priority!r} of key {key} is not a number") from None


# Requests of fewer bytes (about 64 updates) are read by protobuf: its parser is faster there (bench_wire.py).
HAND_DECODE_MIN_UPDATE_BYTES = 64 * _UPDATE.itemsize


def decode_mutate_priorities(data: bytes | memoryview) -> PriorityUpdates:
    """Parse a serialized MutatePrioritiesRequest (ValueError when it is not one).

    From ``HAND_DECODE_MIN_UPDATE_BYTES`` up, the layout ``encode_mutate_priorities``
    writes is read as arrays; anything else goes through protobuf.
    """
    if len(data) >= HAND_DECODE_MIN_UPDATE_BYTES:
        fast = decode_mutate_priorities_by_hand(data)
        if fast is not None:
            return fast
    return decode_mutate_priorities_by_protobuf(data)


def decode_mutate_priorities_by_protobuf(data: bytes | memoryview) -> PriorityUpdates:
    """Parse a serialized MutatePrioritiesRequest with protobuf (ValueError when it is not one)."""
    request = pb.MutatePrioritiesRequest()
    try:
        request.MergeFromString(data)
    except DecodeError as e:
        raise ValueError(f"not a valid request message ({e})") from None
    updates = request.updates
    return PriorityUpdates(request.table, [u.key for u in updates], [u.priority for u in updates],
                           list(request.delete_keys))


def decode_mutate_priorities_by_hand(data: bytes | memoryview) -> PriorityUpdates | None:
    """The fields of ``encode_mutate_priorities``'s layout read as arrays, or None for any other encoding."""
    buf = memoryview(data).cast("B")
    end = len(buf)
    pos = 0
    table = ""
    deletes: list[int] = []
    try:
        if pos < end and buf[pos] == _TABLE_TAG:
            length, pos = read_varint(buf, pos + 1)
            if pos + length > end:
                return None
            table = bytes(buf[pos:pos + length]).decode()
            pos += length
        if pos < end and buf[pos] == _DELETES_TAG:
            length, pos = read_varint(buf, pos + 1)
            if length % _WIDE or pos + length > end:
                return None
            dropped = _read_wide_varints(np.frombuffer(buf, np.uint8, length, pos).reshape(-1, _WIDE))
            if dropped is None:
                return None
            deletes = dropped.tolist()
            pos += length
    except ValueError:  # a truncated varint, a name that is not UTF-8: protobuf says what is wrong
        return None
    if (end - pos) % _UPDATE.itemsize:
        return None
    rows = np.frombuffer(buf, _UPDATE, (end - pos) // _UPDATE.itemsize, pos)
    if len(rows) and not ((rows["head"] == _UPDATE_HEAD).all() and (rows["tag"] == _PRIORITY_TAG).all()):
        return None
    keys = _read_wide_varints(rows["key"])
    if keys is None:
        return None
    return PriorityUpdates(table, keys.tolist(), rows["priority"].astype(np.float64), deletes)


# ------------------------------------------------------------ sample responses ----

_TAG_BATCH = 0x0A      # SampleResponse.batch = 1
_TAG_COLUMNS = 0x12    # SampleBatch.columns = 2
_TAG_DATA = 0x1A       # Tensor.data = 3


def encode_sample_response(infos: list[pb.SampleInfo], lengths: np.ndarray, structure: pb.Structure,
                           squeeze: list[bool], columns: list[tuple[np.dtype, tuple[int, ...], list]]) -> bytes:
    """A serialized SampleResponse whose column data are joined from buffers without intermediate copies.

    ``columns``: per column (dtype, per-step shape, list of bytes-like parts whose
    concatenation is the items' steps). ``lengths``: int32 [items, columns].
    The columns are framed by hand and come first; the small fields follow,
    serialized by protobuf (fields of a message may come in any order), so the
    decoder hands everything after the last column to protobuf in one piece.
    """
    head = pb.SampleBatch(info=infos, lengths=lengths.reshape(-1).tolist(), structure=structure,
                          squeeze=squeeze).SerializeToString()
    pieces: list[Any] = [None]
    batch_len = len(head)
    totals = lengths.sum(axis=0) if lengths.size else np.zeros(len(columns), np.int64)
    for c, (dtype, shape, parts) in enumerate(columns):
        nbytes = sum(memoryview(p).nbytes for p in parts)
        tensor_head = pb.Tensor(dtype=dtype.str, shape=[int(totals[c]), *shape]).SerializeToString()
        data_prefix = length_prefix(_TAG_DATA, nbytes)
        tensor_len = len(tensor_head) + len(data_prefix) + nbytes
        column_prefix = length_prefix(_TAG_COLUMNS, tensor_len) + tensor_head + data_prefix
        pieces.append(column_prefix)
        pieces.extend(parts)
        batch_len += len(column_prefix) + nbytes
    pieces.append(head)
    pieces[0] = length_prefix(_TAG_BATCH, batch_len)
    return b"".join(pieces)


class SampleBatchView:
    """A decoded SampleResponse: infos, per-item lengths and column arrays viewing the message bytes."""

    __slots__ = ("infos", "lengths", "structure", "squeeze", "columns", "starts", "num_items")

    def __init__(self, batch: pb.SampleBatch, columns: list[np.ndarray]):
        self.infos = batch.info
        self.num_items = len(batch.info)
        n_cols = len(columns)
        self.lengths = np.asarray(batch.lengths, np.int64).reshape(self.num_items, n_cols) if n_cols else \
            np.zeros((self.num_items, 0), np.int64)
        self.structure = batch.structure
        self.squeeze = list(batch.squeeze) + [False] * (n_cols - len(batch.squeeze))
        self.columns = columns
        self.starts = np.zeros_like(self.lengths)
        if self.num_items:
            np.cumsum(self.lengths[:-1], axis=0, out=self.starts[1:])
            for c, col in enumerate(columns):
                if col.shape[0] != int(self.lengths[:, c].sum()):
                    raise ValueError(f"sample batch column {c} holds {col.shape[0]} steps, lengths say "
                                     f"{int(self.lengths[:, c].sum())}")

    def item_columns(self, i: int) -> list[np.ndarray]:
        """Item i's leaves: [T, *shape] (squeezed columns: [*shape])."""
        out = []
        for c, col in enumerate(self.columns):
            start = int(self.starts[i, c])
            if self.squeeze[c]:
                out.append(col[start, ...])  # an array (0-d for scalars), not a numpy scalar
            else:
                out.append(col[start:start + int(self.lengths[i, c])])
        return out


def _parse_tensor(raw: bytes, buf: memoryview, start: int, end: int) -> np.ndarray:
    """A Tensor message in raw[start:end] -> an array viewing its data bytes (no copy)."""
    dtype_text = ""
    shape: list[int] = []
    data_at, data_len = start, 0
    pos = start
    while pos < end:
        key, pos = read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 1 and wire_type == 2:
            length, pos = read_varint(buf, pos)
            dtype_text = bytes(buf[pos:pos + length]).decode()
            pos += length
        elif field == 2 and wire_type == 2:  # packed shape
            length, pos = read_varint(buf, pos)
            stop = pos + length
            while pos < stop:
                d, pos = read_varint(buf, pos)
                shape.append(d)
        elif field == 2 and wire_type == 0:
            d, pos = read_varint(buf, pos)
            shape.append(d)
        elif field == 3 and wire_type == 2:
            data_len, pos = read_varint(buf, pos)
            data_at = pos
            pos += data_len
        else:
            pos = skip_field(buf, pos, wire_type)
    if pos != end:
        raise ValueError("malformed tensor in sample response")
    dtype = np.dtype(dtype_text)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != data_len:
        raise ValueError(f"sample tensor of shape {shape} and dtype {dtype_text} holds {data_len} bytes")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=data_at).reshape(shape)


# Below this size protobuf's parser alone is faster (a few us: its copy of the columns costs less than the
# Python loop over the fields); bench/bench_wire.py measured the crossover between 64 and 128 KiB.
HAND_DECODE_MIN_BYTES = 96 << 10


def decode_sample_response(raw: bytes, writable: bool = False) -> SampleBatchView:
    """Parse a serialized SampleResponse: by hand from ``HAND_DECODE_MIN_BYTES`` up, else by protobuf."""
    if len(raw) < HAND_DECODE_MIN_BYTES:
        return decode_sample_response_by_protobuf(raw, writable)
    return decode_sample_response_by_hand(raw, writable)


def decode_sample_response_by_hand(raw: bytes, writable: bool = False) -> SampleBatchView:
    """Parse a serialized SampleResponse; columns framed by hand, the small fields by protobuf.

    Column arrays view ``raw`` (read-only, no copy), or with ``writable`` are one
    copy per column (numpy arrays users may modify in place, as Reverb's are).
    The columns are read by hand up to the first other field; the rest of the
    batch goes to protobuf in one piece (``encode_sample_response`` puts the
    columns first; from another encoder, columns after that piece are decoded
    by protobuf, one more copy).
    """
    buf = memoryview(raw)
    columns: list[np.ndarray] = []
    batch = pb.SampleBatch()
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = read_varint(buf, pos)
        if key != 0x0A:  # SampleResponse.batch, length-delimited
            pos = skip_field(buf, pos, key & 7)
            continue
        length, pos = read_varint(buf, pos)
        batch_end = pos + length
        if batch_end > end:
            raise ValueError("truncated sample response")
        while pos < batch_end:
            field_start = pos
            key, pos = read_varint(buf, pos)
            if key != 0x12:  # not SampleBatch.columns: the rest goes to protobuf
                _merge(batch, buf[field_start:batch_end])
                pos = batch_end
                break
            length, pos = read_varint(buf, pos)
            if pos + length > batch_end:
                raise ValueError("truncated sample column")
            column = _parse_tensor(raw, buf, pos, pos + length)
            columns.append(column.copy() if writable else column)
            pos += length
        if pos != batch_end:
            raise ValueError("malformed sample batch")
    columns += _tensor_arrays(batch.columns, writable)
    del batch.columns[:]
    return SampleBatchView(batch, columns)


def _tensor_arrays(tensors: Sequence[pb.Tensor], writable: bool) -> list[np.ndarray]:
    """Arrays of Tensor messages parsed by protobuf (viewing their bytes, or copies with ``writable``)."""
    out = []
    for c, tensor in enumerate(tensors):
        dtype = np.dtype(tensor.dtype)
        shape = tuple(tensor.shape)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count * dtype.itemsize != len(tensor.data):
            raise ValueError(f"sample tensor {c} of shape {list(shape)} and dtype {tensor.dtype} holds "
                             f"{len(tensor.data)} bytes")
        column = np.frombuffer(tensor.data, dtype=dtype, count=count).reshape(shape)
        out.append(column.copy() if writable else column)
    return out


def decode_sample_response_by_protobuf(raw: bytes, writable: bool = False) -> SampleBatchView:
    """Parse a serialized SampleResponse with protobuf's parser alone (it copies each column's bytes once)."""
    response = pb.SampleResponse()
    _merge(response, raw)
    return SampleBatchView(response.batch, _tensor_arrays(response.batch.columns, writable))


def _merge(message: Any, data: bytes | memoryview) -> None:
    """Parse ``data`` into ``message``; ValueError (as for every malformed response) when it is not valid."""
    try:
        message.MergeFromString(data)
    except DecodeError as e:
        raise ValueError(f"malformed sample response: {e}") from None
