"""Reverb's legacy ``Writer``: fixed-structure steps, items over the last N steps.

Built on :class:`~gear_client.writers.trajectory_writer.TrajectoryWriter` (same wire
format): every leaf of the appended structure is one column, and
``create_item(table, num_timesteps, priority)`` references the last
``num_timesteps`` steps of every column, keeping their time dimension (never
squeezed: ``Client.insert`` data gains a leading dimension of 1). A writer is
one episode; ``close`` ends it.
"""

from __future__ import annotations

import logging
from typing import Any

from gear_client.writers.trajectory_writer import TrajectoryWriter
from gear_contract import nest

__all__ = ["Writer"]

_log = logging.getLogger(__name__)


class Writer:
    """Streams steps of a fixed structure; items reference the most recent steps.

    Construct it with ``client.writer(max_sequence_length, ...)`` (arguments described there).
    """

    def __init__(self, client: Any, max_sequence_length: int, delta_encoded: bool = False,
                 chunk_length: int | None = None, max_in_flight_items: int | None = 25):
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length ({max_sequence_length}) must be a positive integer")
        if chunk_length is None:
            chunk_length = min(10, max_sequence_length)
        if chunk_length < 1 or chunk_length > max_sequence_length:
            raise ValueError(f"chunk_length ({chunk_length}) must be a positive integer le to max_sequence_length "
                             f"({max_sequence_length})")
        if max_in_flight_items is None:
            max_in_flight_items = 1_000_000
        if max_in_flight_items < 1:
            raise ValueError(f"max_in_flight_items ({max_in_flight_items}) must be a positive integer")
        self._max_sequence_length = int(max_sequence_length)
        # delta_encoded and chunk_length tune Reverb's compression; bytes travel raw here.
        self._delta_encoded = bool(delta_encoded)
        self._chunk_length = int(chunk_length)
        self._writer = TrajectoryWriter(client, self._max_sequence_length,
                                        max_in_flight_items=int(max_in_flight_items))
        self._writer.step_signatures = True  # Reverb's Writer takes a table signature of one step
        self._skeleton: Any = None  # the step structure, leaves replaced by their index
        self._num_leaves = 0
        self._steps = 0
        self._closed = False

    def __enter__(self) -> Writer:
        if self._closed:
            raise ValueError("Cannot reuse already closed Writer")
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            _log.warning("Writer-object deleted without calling .close explicitly.")
            try:
                self._closed = True
                self._writer.close(_wait=False)
            except Exception:  # noqa: BLE001 - never raise from a finalizer
                pass

    def __repr__(self) -> str:
        return (f"Writer(max_sequence_length={self._max_sequence_length}, steps={self._steps}), "
                f"closed: {self._closed}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the Writer is closed")

    def append(self, data: Any) -> None:
        """Append one step; every step must have the structure of the first.

        Args:
          data: a nest of arrays or scalars, of the first step's structure, dtypes and shapes.

        Raises:
          ValueError: ``data`` holds no array, or its structure, a dtype or a shape differs from the first
            step's.
          RuntimeError: the writer is closed.
        """
        self._check_open()
        leaves = nest.flatten(data)
        if self._skeleton is None:
            if not leaves:
                raise ValueError("append needs at least one array")
            self._skeleton = nest.pack_as(data, list(range(len(leaves))))
            self._num_leaves = len(leaves)
        elif len(leaves) != self._num_leaves:
            raise ValueError(f"every step must have the structure of the first ({self._num_leaves} leaves), got "
                             f"{len(leaves)} leaves")
        self._writer.append(tuple(leaves))
        self._steps += 1

    def append_sequence(self, sequence: Any) -> None:
        """Append ``T`` steps at once: every leaf has a leading dimension ``T``.

        Args:
          sequence: a nest whose leaves all have the same leading dimension ``T``.

        Raises:
          ValueError: ``sequence`` holds no array, or its leaves' leading dimensions differ.
          RuntimeError: the writer is closed.
        """
        self._check_open()
        leaves = nest.flatten(sequence)
        if not leaves:
            raise ValueError("append_sequence needs at least one array")
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) != 1:
            raise ValueError(f"every leaf of the sequence must have the same leading dimension, got {sorted(lengths)}")
        for t in range(lengths.pop()):
            self.append(nest.pack_as(sequence, [leaf[t] for leaf in leaves]))

    def create_item(self, table: str, num_timesteps: int, priority: float) -> None:
        """Insert an item into ``table`` referencing the last ``num_timesteps`` steps.

        Args:
          table: the table to insert into.
          num_timesteps: how many of the latest steps the item spans (1 to ``max_sequence_length``).
          priority: the item's priority (finite, >= 0).

        Raises:
          ValueError: ``num_timesteps`` is out of range or more than the steps appended, the priority is
            invalid, the table does not exist or the item does not fit its signature.
          RuntimeError: the writer is closed.
        """
        self._check_open()
        if num_timesteps < 1:
            raise ValueError(f"num_timesteps ({num_timesteps}) must be a positive integer")
        if num_timesteps > self._max_sequence_length:
            raise ValueError(f"num_timesteps ({num_timesteps}) must be <= max_sequence_length "
                             f"({self._max_sequence_length})")
        if num_timesteps > self._steps:
            raise ValueError(f"num_timesteps ({num_timesteps}) is larger than the number of steps appended "
                             f"({self._steps})")
        history = self._writer.history
        columns = [history[i][-num_timesteps:] for i in range(self._num_leaves)]
        self._writer.create_item(table, priority, nest.pack_as(self._skeleton, columns))

    def flush(self) -> None:
        """Block until every item created so far is in its table.

        Raises:
          ItemsNotInsertedError: items were given up (the daemon stayed away past the reconnect timeout).
          RuntimeError: the writer is closed.
        """
        self._check_open()
        self._writer.flush()

    def close(self, retry_on_unavailable: bool = True) -> None:
        """Flush and end the stream (and the episode). The writer cannot be used afterwards.

        Args:
          retry_on_unavailable: accepted for Reverb's API; the writer always resends after a daemon
            restart, within its reconnect timeout.

        Raises:
          ValueError: the writer was already closed.
        """
        if self._closed:
            raise ValueError("close() has already been called on Writer.")
        self._closed = True
        try:
            self._writer.end_episode()
        finally:
            self._writer.close()
