"""The layout descriptor: alignment, 64-bit offsets, proto round trip, safe views."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from gear_contract.layout import ALIGNMENT, TableLayout


def _layout(capacity: int = 5) -> TableLayout:
    return TableLayout.build("t", "/dev/shm/x", capacity, [
        ("obs", np.float32, (3, 5), 7, False),
        ("action", np.int64, (), 7, False),
        ("flag", np.bool_, (), 1, True),
    ])


def test_every_column_and_slot_is_aligned():
    layout = _layout()
    for col in layout.columns:
        assert col.offset % ALIGNMENT == 0
        assert col.slot_stride % ALIGNMENT == 0
        assert col.slot_stride >= col.step_bytes * col.max_length
    assert layout.segment_size % ALIGNMENT == 0
    last = layout.columns[-1]
    assert layout.segment_size >= last.offset + last.slot_stride * layout.capacity


def test_offsets_are_64_bit_for_tables_over_4_gib():
    big = TableLayout.build("t", "/dev/shm/x", 20_000, [("obs", np.float32, (1024,), 64, False),
                                                        ("r", np.float32, (), 64, False)])
    assert big.segment_size > 4 << 30
    assert big.columns[1].offset > 4 << 30
    assert big.columns[1].slot_offset(19_999) > 4 << 30


def test_proto_round_trip_keeps_everything():
    layout = _layout()
    again = TableLayout.from_proto(layout.to_proto())
    assert again == layout
    assert again.to_proto().segment_size == layout.segment_size


def test_column_view_addresses_the_slots_bytes():
    layout = _layout()
    buf = bytearray(layout.segment_size)
    view = layout.column_view(buf, 0)
    view[2, 4] = np.arange(15, dtype=np.float32).reshape(3, 5)
    col = layout.columns[0]
    start = col.slot_offset(2) + 4 * col.step_bytes
    assert bytes(buf[start:start + col.step_bytes]) == np.arange(15, dtype=np.float32).tobytes()


def test_a_live_column_view_keeps_the_mapping_from_being_closed():
    layout = _layout()
    mapping = mmap.mmap(-1, layout.segment_size)
    view = layout.column_view(mapping, 1)
    with pytest.raises(BufferError):
        mapping.close()  # would leave `view` dangling (a segfault on the next read)
    view[0, 0] = 7
    del view
    mapping.close()
