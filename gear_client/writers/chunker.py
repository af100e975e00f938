"""Which rows travel in which chunk: an item's columns as slices of chunks, each row sent once.

The steps no earlier item sent are cut, per column, into ``ChunkData`` (a
raw buffer whose leading dimension is the steps, at most ``MAX_CHUNK_BYTES``
and never across an episode boundary); the item names ``ColumnSlice``s of
chunks. A chunk is released once none of its rows can be referenced again
(they left the keep-alive window, or the buffers were cleared).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from gear_client.writers.column_buffer import ColumnBuffer
from gear_client.writers.trajectory_column import TrajectoryColumn
from gear_contract.wire import ItemColumnSlices, encode_chunk_head

__all__ = ["MAX_CHUNK_BYTES", "Chunker", "NewChunk"]

# A chunk is cut at this many bytes (whole rows) so requests stay well under
# gRPC's default 4 MiB message limit.
MAX_CHUNK_BYTES = 2 << 20


class NewChunk(NamedTuple):
    """A chunk to send: its key, its encoded ``InsertStreamRequest.chunks`` field up to the raw rows, the rows.

    ``data`` views the column buffer until the transport copies it into a message.
    """

    key: int
    head: bytes
    data: memoryview


class Chunker:
    """Chunk keys, the slices of items, and the keys to release (per writer)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self.pending_release: list[int] = []

    def new_key(self) -> int:
        """A chunk key not used before by this writer."""
        return next(self._counter)

    def item_columns(self, flat: Sequence[TrajectoryColumn], new_chunks: list[NewChunk]) -> list[ItemColumnSlices]:
        """Per trajectory column, its merged slices and squeeze flag; appends the chunks still to send."""
        out = []
        for column in flat:
            slices: list[tuple[int, int, int]] = []
            for col, rows in column.segments:
                self._slices_for(col, rows, new_chunks, slices)
            out.append((_merge_slices(slices), column.is_squeezed))
        return out

    def _slices_for(self, col: ColumnBuffer, rows: Sequence[int], new_chunks: list[NewChunk],
                    slices: list[tuple[int, int, int]]) -> None:
        """Append the (chunk, offset, length) slices covering ``rows``; cut the unsent rows into chunks."""
        if isinstance(rows, range) and rows.step == 1:
            runs = [(rows.start, rows.stop)]
        else:
            runs = []
            for r in rows:
                if runs and runs[-1][1] == r:
                    runs[-1] = (runs[-1][0], r + 1)
                else:
                    runs.append((r, r + 1))
        for start, stop in runs:
            self._cover(col, start, stop, new_chunks, slices)

    def _cover(self, col: ColumnBuffer, start: int, stop: int, new_chunks: list[NewChunk],
               slices: list[tuple[int, int, int]]) -> None:
        live_chunks, firsts = col.chunks, col.chunk_firsts
        i = max(0, bisect.bisect_right(firsts, start) - 1)
        pos = start
        while pos < stop:
            if i < len(live_chunks) and live_chunks[i][0] <= pos < live_chunks[i][1]:
                first, end, key = live_chunks[i]
                n = min(stop, end) - pos
                slices.append((key, pos - first, n))
                pos += n
                i += 1
                continue
            if i < len(live_chunks) and live_chunks[i][1] <= pos:
                i += 1
                continue
            # Rows [pos, gap_end) are not on the server yet: send them.
            gap_end = stop
            if i < len(live_chunks):
                gap_end = min(gap_end, live_chunks[i][0])
            for first, end, key in self._new_chunks(col, pos, gap_end, new_chunks):
                entry = [first, end, key]
                j = bisect.bisect_left(firsts, first)
                live_chunks.insert(j, entry)
                firsts.insert(j, first)
                slices.append((key, 0, end - first))
                i = j + 1
            pos = gap_end

    def _new_chunks(self, col: ColumnBuffer, start: int, stop: int, out: list[NewChunk]) -> list[tuple[int, int, int]]:
        made = []
        max_rows = max(1, MAX_CHUNK_BYTES // col.row_bytes)
        if col.max_chunk_length:
            max_rows = min(max_rows, col.max_chunk_length)
        pos = start
        while pos < stop:
            episode_id, next_episode = col.episode_of(pos)
            end = min(stop, pos + max_rows, next_episode)
            key = self.new_key()
            rows = col.rows_array(pos, end)
            data = memoryview(rows.reshape(-1).view(np.uint8))  # any dtype, no copy (rows are contiguous)
            head = encode_chunk_head(key, col.dtype_wire, rows.shape, data.nbytes, episode_id,
                                     col.row_step[pos - col.buf_first_row])
            out.append(NewChunk(key, head, data))
            made.append((pos, end, key))
            pos = end
        return made

    # -- releases ----------------------------------------------------------
    def collect_releases(self, columns: Iterable[ColumnBuffer]) -> None:
        """Queue the keys of chunks whose rows can no longer be referenced."""
        for col in columns:
            if not col.chunks:
                continue
            live = col.min_live_row()
            chunks = col.chunks
            n = 0
            while n < len(chunks) and chunks[n][1] <= live:
                self.pending_release.append(chunks[n][2])
                n += 1
            if n:
                del chunks[:n]
                del col.chunk_firsts[:n]
                col.drop_dead_marks()

    def release_all(self, columns: Iterable[ColumnBuffer]) -> None:
        """Queue every live chunk for release (the buffers were cleared)."""
        for col in columns:
            self.pending_release.extend(c[2] for c in col.chunks)
            col.chunks.clear()
            col.chunk_firsts.clear()

    def take_releases(self) -> list[int]:
        keys, self.pending_release = self.pending_release, []
        return keys

    def forget(self, columns: Iterable[ColumnBuffer]) -> None:
        """Forget what the server holds (a new stream starts empty)."""
        for col in columns:
            col.chunks.clear()
            col.chunk_firsts.clear()
        self.pending_release.clear()


def _merge_slices(slices: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Join slices that continue each other within one chunk."""
    merged: list[list[int]] = []
    for key, offset, length in slices:
        if merged and merged[-1][0] == key and merged[-1][1] + merged[-1][2] == offset:
            merged[-1][2] += length
        else:
            merged.append([key, offset, length])
    return [(k, o, n) for k, o, n in merged]
