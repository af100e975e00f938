"""The layout of a table's storage: where every item's bytes live.

A table is one shared-memory segment laid out by column. Column ``c`` holds
``capacity`` slots of ``slot_stride`` bytes starting at ``offset``; a slot
holds up to ``max_length`` steps of ``step_bytes`` each. Offsets and strides
are multiples of ``ALIGNMENT`` (128 bytes) so 16-byte vector loads are always
legal and PCIe reads are whole. All offsets are 64-bit: tables over 4 GiB work.

The daemon builds the layout; learners on the same host (shm plane), the
GPU gather kernel and the RDMA range planner read it to address any item
without asking again. It travels as ``gear.v1.TableLayout``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from gear_contract._proto import replay_pb2 as pb

ALIGNMENT = 128


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round n up to a multiple of alignment."""
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class ColumnLayout:
    """Placement of one column (one flattened leaf of the item structure)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # per step
    offset: int  # byte offset of slot 0 within the segment
    slot_stride: int  # bytes between consecutive slots
    max_length: int  # steps a slot holds
    squeeze: bool = False  # items hold one step without its time dimension

    @functools.cached_property
    def step_bytes(self) -> int:
        """Bytes of one step (cached: the daemon reads it for every commit and Select)."""
        return int(np.dtype(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64)))

    def slot_offset(self, slot: int) -> int:
        """Byte offset of a slot's first step within the segment."""
        return self.offset + int(slot) * self.slot_stride

    def to_proto(self) -> pb.ColumnLayout:
        return pb.ColumnLayout(
            name=self.name, dtype=np.dtype(self.dtype).str, shape=list(self.shape), offset=self.offset,
            slot_stride=self.slot_stride, step_bytes=self.step_bytes, max_length=self.max_length,
            squeeze=self.squeeze,
        )

    @classmethod
    def from_proto(cls, msg: pb.ColumnLayout) -> ColumnLayout:
        return cls(
            name=msg.name, dtype=np.dtype(msg.dtype), shape=tuple(msg.shape), offset=msg.offset,
            slot_stride=msg.slot_stride, max_length=msg.max_length, squeeze=msg.squeeze,
        )


@dataclass(frozen=True)
class TableLayout:
    """Placement of every column of a table within its segment."""

    table: str
    segment: str  # filesystem path of the segment (e.g. /dev/shm/gear....)
    capacity: int  # number of slots
    columns: tuple[ColumnLayout, ...]
    version: int = 0
    structure: pb.Structure = field(default_factory=pb.Structure)

    @property
    def segment_size(self) -> int:
        if not self.columns:
            return 0
        last = self.columns[-1]
        return align_up(last.offset + last.slot_stride * self.capacity)

    @classmethod
    def build(
        cls,
        table: str,
        segment: str,
        capacity: int,
        columns: list[tuple[str, np.dtype, tuple[int, ...], int, bool]],
        version: int = 0,
        structure: pb.Structure | None = None,
    ) -> TableLayout:
        """Lay out columns (name, dtype, step shape, max_length, squeeze) back to back, aligned."""
        placed = []
        offset = 0
        for name, dtype, shape, max_length, squeeze in columns:
            dtype = np.dtype(dtype)
            step = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            stride = align_up(max(step * max_length, 1))
            placed.append(ColumnLayout(name, dtype, tuple(int(d) for d in shape), offset, stride, int(max_length),
                                       squeeze))
            offset = align_up(offset + stride * capacity)
        return cls(table, segment, int(capacity), tuple(placed), version, structure or pb.Structure())

    def to_proto(self) -> pb.TableLayout:
        return pb.TableLayout(
            table=self.table, segment=self.segment, segment_size=self.segment_size, capacity=self.capacity,
            version=self.version, columns=[c.to_proto() for c in self.columns], structure=self.structure,
        )

    @classmethod
    def from_proto(cls, msg: pb.TableLayout) -> TableLayout:
        return cls(
            table=msg.table, segment=msg.segment, capacity=msg.capacity,
            columns=tuple(ColumnLayout.from_proto(c) for c in msg.columns), version=msg.version,
            structure=msg.structure,
        )

    def column_view(self, buffer, column: int) -> np.ndarray:
        """A [capacity, max_length, *shape] array view of one column over a segment buffer.

        Slot strides may exceed max_length * step_bytes (alignment padding), so the
        view is built with explicit strides. The view holds a buffer export on the
        mapping (through ``np.frombuffer``), so an ``mmap.close()`` while it lives raises
        BufferError instead of leaving it dangling (``np.ndarray(buffer=mmap)`` alone
        would not keep the export).
        """
        col = self.columns[column]
        if not isinstance(buffer, np.ndarray):
            buffer = np.frombuffer(buffer, dtype=np.uint8)
        arr = np.ndarray(
            shape=(self.capacity, col.max_length, *col.shape),
            dtype=col.dtype,
            buffer=buffer,
            offset=col.offset,
            strides=(col.slot_stride, col.step_bytes, *_c_strides(col.shape, col.dtype.itemsize)),
        )
        return arr


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))
