"""Byte ranges of a batch: which bytes of a table segment land where in a learner's buffer.

Pure functions shared by the data planes. A sampled batch is a set of
(slot, steps) windows per column; the learner's batch buffer holds, per column,
one ``[batch, steps, *shape]`` C-order block (``BatchLayout``). Planning turns the
selection into ``(remote, local, length)`` byte ranges; the RDMA plane then
coalesces adjacent ranges, splits those over the port's message size, spreads them
over several queue pairs with balanced bytes and cuts each queue pair's list into
chains of work requests of which only the last is signalled.

Ranges are ``int64 [n, 3]`` arrays (columns ``REMOTE, LOCAL, LENGTH``) so a batch
of thousands of items plans in vectorised NumPy.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gear_contract.layout import TableLayout, align_up
from gear_kernels import Window, twins
from gear_kernels.gather import OUT_ALIGNMENT

REMOTE, LOCAL, LENGTH = 0, 1, 2


# ------------------------------------------------------------------ windows --
# Windows are gear_kernels.Window(length, start, pad): the same steps the GPU
# gather kernel takes (see gear_kernels.gather).

WindowSpec = Window | int | Sequence[Window] | None


def resolve_windows(layout: TableLayout, window: WindowSpec) -> list[Window]:
    """One concrete Window per column (length filled in; squeezed columns always one step).

    ``None``: whole items (each column's max_length); an int ``n``: the first
    ``n`` steps; a Window for every column; or one Window per column.
    """
    if window is None or isinstance(window, Window):
        per_column = [window] * len(layout.columns)
    elif isinstance(window, (int, np.integer)) and not isinstance(window, bool):
        per_column = [Window(int(window))] * len(layout.columns)
    elif isinstance(window, Sequence):
        per_column = list(window)
        if len(per_column) != len(layout.columns):
            raise ValueError(f"{len(per_column)} windows for {len(layout.columns)} columns")
    else:
        raise TypeError(f"window must be None, an int, a Window or a list of Windows, got {type(window).__name__}")
    out = []
    for col, w in zip(layout.columns, per_column, strict=True):
        if w is not None and not isinstance(w, Window):
            raise TypeError(f"column {col.name!r}: expected a Window, got {type(w).__name__}")
        if col.squeeze:
            out.append(Window(1, 0, "tail"))
        elif w is None:
            out.append(Window(col.max_length, 0, "tail"))
        else:
            out.append(Window(col.max_length if w.length is None else int(w.length), w.start, w.pad))
    return out


def window_steps(windows: Sequence[Window]) -> list[int]:
    """Steps per item each column of a batch holds."""
    return [int(w.length) for w in windows]


def window_bounds(lengths: np.ndarray, layout: TableLayout, windows: Sequence[Window]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source step, steps copied, first row step) per item and column, ``int64 [n, C]`` each.

    The same arithmetic as the gather kernel (gear_kernels.twins.window_bounds).
    """
    num_columns = len(layout.columns)
    if len(windows) != num_columns:
        raise ValueError(f"{len(windows)} windows for {num_columns} columns")
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, num_columns)
    # every column at once (per batch a few array operations, not a few per column): the twin broadcasts
    if all(np.ndim(w.start) == 0 for w in windows):
        start = np.array([int(w.start) for w in windows], dtype=np.int64)
    else:  # a start per item in some column
        start = np.stack([np.broadcast_to(np.asarray(w.start, dtype=np.int64), lengths.shape[:1]) for w in windows],
                         axis=1)
    steps = np.array([int(w.length) for w in windows], dtype=np.int64)
    max_length = np.array([col.max_length for col in layout.columns], dtype=np.int64)
    if start.ndim == 1 and not start.any():  # every window from the first step (the usual case): one clip
        src = np.zeros_like(lengths)
        count = np.clip(lengths, 0, np.minimum(steps, max_length))
    else:
        src, count, _ = twins.window_bounds(lengths, start, steps, max_length, False)
        src = np.broadcast_to(src, lengths.shape)
    head = np.array([w.pad == "head" for w in windows])
    dst = np.where(head, steps - count, 0) if head.any() else np.zeros_like(count)
    return np.ascontiguousarray(src), count, dst


# ------------------------------------------------------------- batch layout --


@dataclass(frozen=True)
class BatchColumn:
    """Where one column of a batch lives in the learner's buffer."""

    offset: int  # byte offset of item 0
    steps: int  # steps per item (1 for squeezed columns)
    step_bytes: int

    @property
    def item_bytes(self) -> int:
        return self.steps * self.step_bytes


@dataclass(frozen=True)
class BatchLayout:
    """Placement of a whole batch in one buffer: per column ``[batch, steps, *shape]``.

    Column blocks start on OUT_ALIGNMENT boundaries, in column order: the same
    placement as gear_kernels.output_plan, so CPU, RDMA and GPU batches agree.
    """

    batch_size: int
    columns: tuple[BatchColumn, ...]
    nbytes: int

    @classmethod
    def build(cls, layout: TableLayout, batch_size: int, steps: Sequence[int]) -> BatchLayout:
        placed = []
        offset = 0
        for col, n in zip(layout.columns, steps, strict=True):
            placed.append(BatchColumn(offset, int(n), col.step_bytes))
            offset = align_up(offset + batch_size * int(n) * col.step_bytes, OUT_ALIGNMENT)
        return cls(int(batch_size), tuple(placed), max(offset, OUT_ALIGNMENT))


# ------------------------------------------------------------------ ranges --


def plan_ranges(
    layout: TableLayout,
    slots: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    batch: BatchLayout,
    firsts: np.ndarray | None = None,
    columns: Sequence[int] | None = None,
) -> np.ndarray:
    """The byte ranges that move a selection into a batch buffer (empty ranges dropped).

    Item ``i`` of column ``c`` reads ``counts[i, c]`` steps of slot ``slots[i]``
    from step ``starts[i, c]`` into row ``i`` of the column's block, from row step
    ``firsts[i, c]`` (0 when not given). ``columns``: only these columns' ranges
    (default all; the slots are checked either way). Returns ``int64 [n, 3]``
    (remote offset in the segment, local offset in the buffer, length).
    """
    slots = np.asarray(slots, dtype=np.int64)
    n = slots.shape[0]
    if n > batch.batch_size:
        raise ValueError(f"{n} items do not fit a batch of {batch.batch_size}")
    if len(batch.columns) != len(layout.columns):
        raise ValueError(f"a batch of {len(batch.columns)} columns for a layout of {len(layout.columns)}")
    if n and (slots.min() < 0 or slots.max() >= layout.capacity):
        raise ValueError(f"slot out of range [0, {layout.capacity})")
    parts = []
    rows = np.arange(n, dtype=np.int64)
    wanted = range(len(layout.columns)) if columns is None else columns
    for c in wanted:
        col, dst = layout.columns[c], batch.columns[c]
        count = np.asarray(counts[:, c], dtype=np.int64)
        start = np.asarray(starts[:, c], dtype=np.int64)
        first = np.zeros(n, dtype=np.int64) if firsts is None else np.asarray(firsts[:, c], dtype=np.int64)
        if np.any(first + count > dst.steps) or np.any(start + count > col.max_length) or np.any(start < 0):
            raise ValueError(f"column {col.name!r}: window exceeds the slot or the batch row")
        part = np.empty((n, 3), dtype=np.int64)
        part[:, REMOTE] = col.offset + slots * col.slot_stride + start * col.step_bytes
        part[:, LOCAL] = dst.offset + rows * dst.item_bytes + first * col.step_bytes
        part[:, LENGTH] = count * col.step_bytes
        parts.append(part)
    ranges = np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)
    return ranges[ranges[:, LENGTH] > 0]


def coalesce(ranges: np.ndarray) -> np.ndarray:
    """Merge ranges that are adjacent both in the segment and in the buffer.

    Consecutive slots sampled into consecutive batch rows (FIFO samplers, or luck)
    become one read. Overlapping ranges are left as they are.
    """
    if len(ranges) < 2:
        return ranges.copy()
    r = ranges[np.lexsort((ranges[:, LOCAL], ranges[:, REMOTE]))]
    ends_remote = r[:-1, REMOTE] + r[:-1, LENGTH]
    ends_local = r[:-1, LOCAL] + r[:-1, LENGTH]
    joins = (r[1:, REMOTE] == ends_remote) & (r[1:, LOCAL] == ends_local)
    heads = np.concatenate(([True], ~joins))
    group = np.cumsum(heads) - 1
    out = r[heads].copy()
    out[:, LENGTH] = np.bincount(group, weights=r[:, LENGTH], minlength=len(out)).astype(np.int64)
    return out


def split(ranges: np.ndarray, max_bytes: int) -> np.ndarray:
    """Cut every range longer than ``max_bytes`` into pieces of at most that size."""
    max_bytes = int(max_bytes)
    if max_bytes < 1:
        raise ValueError("max_bytes must be positive")
    if len(ranges) == 0 or ranges[:, LENGTH].max() <= max_bytes:
        return ranges.copy()
    pieces = -(-ranges[:, LENGTH] // max_bytes)
    out = np.repeat(ranges, pieces, axis=0)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(len(out), dtype=np.int64) - first
    out[:, REMOTE] += k * max_bytes
    out[:, LOCAL] += k * max_bytes
    out[:, LENGTH] = np.minimum(max_bytes, np.repeat(ranges[:, LENGTH], pieces) - k * max_bytes)
    return out


def spread(ranges: np.ndarray, num_queues: int) -> list[np.ndarray]:
    """Assign ranges to ``num_queues`` queue pairs so each carries about the same bytes.

    Longest first onto the least-loaded queue (LPT); each queue's ranges are then
    put back in segment order. Queues may be empty when there are fewer ranges.
    """
    if num_queues < 1:
        raise ValueError("num_queues must be at least 1")
    if num_queues == 1 or len(ranges) <= 1:
        out = [ranges[np.argsort(ranges[:, REMOTE], kind="stable")]] if len(ranges) else [ranges.copy()]
        return out + [np.empty((0, 3), dtype=np.int64) for _ in range(num_queues - len(out))]
    order = np.argsort(-ranges[:, LENGTH], kind="stable")
    loads = [(0, q) for q in range(num_queues)]
    heapq.heapify(loads)
    owner = np.empty(len(ranges), dtype=np.int64)
    for idx in order:
        load, q = heapq.heappop(loads)
        owner[idx] = q
        heapq.heappush(loads, (load + int(ranges[idx, LENGTH]), q))
    queues = []
    for q in range(num_queues):
        mine = ranges[owner == q]
        queues.append(mine[np.argsort(mine[:, REMOTE], kind="stable")])
    return queues


# ------------------------------------------------------------------- chains --


@dataclass(frozen=True)
class Chain:
    """Work requests posted together on one queue pair; only the last is signalled.

    ``wr_id`` is the signalled request's id: its completion means every request
    of the chain (and every earlier one on the queue pair) has completed.
    """

    queue: int
    wr_id: int
    ranges: np.ndarray  # int64 [k, 3]

    @property
    def nbytes(self) -> int:
        return int(self.ranges[:, LENGTH].sum())


def chain(queues: Sequence[np.ndarray], chain_length: int, first_wr_id: int = 1) -> list[list[Chain]]:
    """Cut each queue pair's ranges into chains of at most ``chain_length`` requests.

    Selective signalling: a queue pair's send queue frees its slots only when a
    signalled request completes, so one signal every ``chain_length`` requests
    keeps the send queue and the completion queue small. wr_ids are unique over
    the whole plan.
    """
    if chain_length < 1:
        raise ValueError("chain_length must be at least 1")
    wr_id = first_wr_id
    out = []
    for q, ranges in enumerate(queues):
        chains = []
        for begin in range(0, len(ranges), chain_length):
            chains.append(Chain(q, wr_id, ranges[begin:begin + chain_length]))
            wr_id += 1
        out.append(chains)
    return out


@dataclass(frozen=True)
class ReadPlan:
    """Everything the RDMA plane posts for one batch."""

    chains: list[list[Chain]]  # per queue pair, in posting order
    nbytes: int
    num_requests: int


def plan_reads(
    ranges: np.ndarray,
    *,
    num_queues: int,
    max_message: int,
    chain_length: int,
    balance_chunk: int | None = None,
    first_wr_id: int = 1,
) -> ReadPlan:
    """Coalesce, split (message size, and ``balance_chunk`` for even queues), spread and chain."""
    merged = coalesce(ranges)
    limit = int(max_message) if balance_chunk is None else min(int(max_message), int(balance_chunk))
    pieces = split(merged, limit)
    queues = spread(pieces, num_queues)
    chains = chain(queues, chain_length, first_wr_id)
    return ReadPlan(chains, int(pieces[:, LENGTH].sum()) if len(pieces) else 0, len(pieces))


def padding_ranges(counts: np.ndarray, batch: BatchLayout, firsts: np.ndarray | None = None) -> np.ndarray:
    """Byte ranges of the buffer that no read fills (heads and tails of short rows), to be zeroed.

    Returns ``int64 [m, 2]``: (offset, length).
    """
    parts = []
    n = counts.shape[0]
    rows = np.arange(n, dtype=np.int64)
    for c, dst in enumerate(batch.columns):
        row = dst.offset + rows * dst.item_bytes
        head = (np.zeros(n, dtype=np.int64) if firsts is None else np.asarray(firsts[:, c], dtype=np.int64))
        head = head * dst.step_bytes
        filled = np.asarray(counts[:, c], dtype=np.int64) * dst.step_bytes
        part = np.empty((2 * n, 2), dtype=np.int64)
        part[:n, 0] = row
        part[:n, 1] = head
        part[n:, 0] = row + head + filled
        part[n:, 1] = dst.item_bytes - head - filled
        parts.append(part)
    out = np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.int64)
    return out[out[:, 1] > 0]
