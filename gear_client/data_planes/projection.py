"""A learner's ``columns=``: the fields it wants, resolved against the table's layout.

Only the wanted columns' bytes move, on every plane: shm and rdma read a layout
narrowed to those columns (the other columns' bytes are never touched), inline
asks the daemon to send only them (``SampleRequest.columns``). Paths and the
pruned structure are gear_contract.projection's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from gear_contract.layout import TableLayout
from gear_contract.projection import column_indices, prune_structure, wanted_paths


class ColumnChoice:
    """``columns=`` of one sampler; ``narrow`` gives a layout's projected form (cached per layout)."""

    def __init__(self, columns: Any):
        wanted_paths(columns)  # TypeError now for a spec of the wrong kind
        self.columns = columns
        self._narrowed: tuple[TableLayout, TableLayout, list[int]] | None = None

    def indices(self, layout: TableLayout) -> list[int]:
        """The wanted columns of ``layout`` (ValueError naming an unknown path)."""
        return self._narrow(layout)[2]

    def narrow(self, layout: TableLayout, lengths: np.ndarray) -> tuple[TableLayout, np.ndarray]:
        """(``layout`` with the wanted columns only, ``lengths`` [n, C] of those columns)."""
        narrowed, _, indices = self._narrow(layout)
        return narrowed, lengths[:, indices]

    def _narrow(self, layout: TableLayout) -> tuple[TableLayout, TableLayout, list[int]]:
        cached = self._narrowed
        if cached is not None and cached[1] is layout:
            return cached
        indices = column_indices(layout.structure, self.columns)
        narrowed = dataclasses.replace(layout, columns=tuple(layout.columns[i] for i in indices),
                                       structure=prune_structure(layout.structure, indices))
        self._narrowed = (narrowed, layout, indices)
        return self._narrowed


def narrowed(choice: ColumnChoice | None, layout: TableLayout, lengths: np.ndarray
             ) -> tuple[TableLayout, np.ndarray]:
    """What a reading plane reads of a selection: every column without a choice, else the chosen ones."""
    return (layout, lengths) if choice is None else choice.narrow(layout, lengths)
