"""A leased selection read out for sending: runs of items that share one layout.

A sample message (SampleResponse) carries items of one structure and one set of
column dtypes and step shapes. A table's items usually all have its column
layout: then a selection is one group of no-copy views into the segment. A
table without a signature may also hold items of other layouts (the side
store); their runs become groups of their own, in selection order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.table.columns import slot_views
from gear_server.table.items import ColumnSpec
from gear_server.table.side_store import SideItem


@dataclass
class ItemGroup:
    """Items ``[start, stop)`` of a selection that share one layout, ready to send.

    ``columns``: per column (dtype, step shape, squeezed); ``parts``: per column, one
    contiguous array per item of its steps (a squeezed column: the step itself).
    """

    start: int
    stop: int
    structure: pb.Structure
    columns: list[tuple[np.dtype, tuple[int, ...], bool]]
    lengths: np.ndarray  # int32 [items, columns]
    parts: list[list[np.ndarray]]


def group_items(slots: np.ndarray, lengths: np.ndarray, views: list[np.ndarray], specs: list[ColumnSpec],
                structure: pb.Structure, side: dict[int, SideItem]) -> list[ItemGroup]:
    """The selected ``slots`` in runs of one layout: the column layout's (``views``/``specs``), or a side item's."""
    n = len(slots)
    columns = [s.key for s in specs] if specs is not None else []
    if not side:
        return [ItemGroup(0, n, structure, columns, lengths, slot_views(views, specs, slots, lengths))]
    keys = [side[s].layout_key if s in side else None for s in slots.tolist()]
    groups = []
    start = 0
    for i in range(1, n + 1):
        if i < n and keys[i] == keys[start]:
            continue
        if keys[start] is None:
            part, part_lengths = slots[start:i], lengths[start:i]
            groups.append(ItemGroup(start, i, structure, columns, part_lengths,
                                    slot_views(views, specs, part, part_lengths)))
        else:
            items = [side[s] for s in slots[start:i].tolist()]
            first = items[0]
            parts = [[it.columns[c][0] if spec.squeeze else it.columns[c] for it in items]
                     for c, spec in enumerate(first.specs)]
            groups.append(ItemGroup(start, i, first.structure, [sp.key for sp in first.specs],
                                    np.array([it.lengths for it in items], np.int32), parts))
        start = i
    return groups
