"""The inline plane: item bytes travel in gRPC messages, as raw buffers.

For learners that can reach the daemon's memory neither through shared memory
nor through RDMA. It uses the Sample RPC, whose ``SampleBatch`` messages carry
per column the items' steps concatenated (``Tensor.data``, raw bytes); this
module turns them into a padded ``SampledBatch`` like the other planes give.
"""

from __future__ import annotations

import numpy as np

from gear_client.data_planes.batch import BufferPool, SampledBatch, column_arrays, info_arrays
from gear_client.data_planes.projection import ColumnChoice
from gear_client.data_planes.range_planning import BatchLayout, WindowSpec, resolve_windows, window_bounds, window_steps
from gear_client.data_planes.session import wait_ms
from gear_contract._proto import replay_pb2 as pb
from gear_contract.layout import TableLayout


def layout_from_batch(table: str, view, max_lengths: list[int]) -> TableLayout:
    """A TableLayout describing a batch's columns (no segment): what shapes the padded batch has."""
    columns = []
    for c, arr in enumerate(view.columns):
        squeeze = bool(view.squeeze[c])
        shape = tuple(int(d) for d in arr.shape[1:])
        columns.append((f"column_{c}", arr.dtype, shape, 1 if squeeze else max(1, max_lengths[c]), squeeze))
    return TableLayout.build(table, "", 1, columns, structure=view.structure)


def view_of(batch: pb.SampleBatch):
    """A SampleBatchView of a parsed SampleBatch (when the raw stream is not at hand)."""
    from gear_contract.wire import SampleBatchView

    columns = [np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(tuple(t.shape)) for t in batch.columns]
    return SampleBatchView(batch, columns)


def decode_batches(views) -> tuple[list, list[list[np.ndarray]], np.ndarray, object]:
    """Infos, per-column lists of concatenated step arrays, lengths [n, C] and the first view."""
    infos: list = []
    parts: list[list[np.ndarray]] = []
    lengths = []
    first = None
    for view in views:
        if first is None:
            first = view
            parts = [[] for _ in view.columns]
        if len(view.columns) != len(parts) or view.structure != first.structure or any(
                a.dtype != b.dtype or a.shape[1:] != b.shape[1:] for a, b in zip(view.columns, first.columns,
                                                                                 strict=True)):
            # a table without a signature holding items of several layouts: one batch cannot stack them
            raise ValueError("the items of one batch have different structures, dtypes or step shapes (a table "
                             "without a signature holding several kinds of items): sample them with "
                             "Client.sample, which returns each item as it is")
        infos.extend(view.infos)
        lengths.append(np.asarray(view.lengths, dtype=np.int64).reshape(view.num_items, len(parts)))
        for c, arr in enumerate(view.columns):
            parts[c].append(arr)
    if first is None:
        raise ValueError("the Sample call returned no batch")
    return infos, parts, np.concatenate(lengths), first


def assemble(layout: TableLayout, parts: list[list[np.ndarray]], lengths: np.ndarray, window: WindowSpec,
             out: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, BatchLayout]:
    """Scatter concatenated steps into padded ``[n, T, *shape]`` columns of ``out``.

    Returns (columns, counts, batch).
    """
    n = lengths.shape[0]
    windows = resolve_windows(layout, window)
    steps = window_steps(windows)
    batch = BatchLayout.build(layout, n, steps)
    starts, counts, firsts = window_bounds(lengths, layout, windows)
    cols = column_arrays(out, layout, batch, n)
    for c, col in enumerate(layout.columns):
        target = cols[c]
        lens = lengths[:, c].astype(np.int64)
        T = steps[c]
        if col.squeeze or (n and np.all(starts[:, c] == 0) and np.all(counts[:, c] == T) and np.all(lens == T)):
            row = 0  # whole rows: each message's part goes straight into its rows, no intermediate copy
            for part in parts[c]:
                k = part.shape[0] if col.squeeze else part.shape[0] // T
                target[row:row + k] = part.reshape((k, *target.shape[1:]))
                row += k
            continue
        data = np.concatenate(parts[c]) if len(parts[c]) > 1 else parts[c][0]
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1]))
        for i in range(n):
            k = int(counts[i, c])
            s = int(offsets[i] + starts[i, c])
            f = int(firsts[i, c])
            target[i, :f] = 0
            target[i, f:f + k] = data[s:s + k]
            target[i, f + k:] = 0
    return cols, counts, batch


class InlinePlane:
    """Samples over the Sample RPC and pads batches like the other planes."""

    kind = "inline"

    def __init__(self, stub, table: str, layout: TableLayout | None = None, *, sample_call=None, metadata=None,
                 columns: ColumnChoice | None = None):
        self._stub = stub
        self.columns = columns  # the daemon sends only these columns (None: all)
        self.bytes_moved = 0  # bytes of the Sample answers (raw stream; parsed messages: their size)
        self._sample_call = sample_call  # unary_stream returning raw bytes (parsed without copies)
        self.table = table
        self.layout = layout
        self._metadata = metadata
        self._pool = BufferPool()
        self._call = None

    def _views(self, request: pb.SampleRequest):
        if self._sample_call is not None:
            from gear_contract.wire import decode_sample_response

            self._call = call = self._sample_call(request, metadata=self._metadata, wait_for_ready=True)
            return (decode_sample_response(self._counted(raw)) for raw in call)
        self._call = call = self._stub.Sample(request, metadata=self._metadata, wait_for_ready=True)
        return (view_of(self._counted(resp).batch) for resp in call)

    def _counted(self, answer):
        self.bytes_moved += len(answer) if isinstance(answer, (bytes, bytearray, memoryview)) else answer.ByteSize()
        return answer

    def cancel(self) -> None:
        """End a Sample call waiting in another thread."""
        call = self._call
        if call is not None:
            call.cancel()

    def sample(self, num_samples: int, *, window: WindowSpec = None, timeout: float | None = None) -> SampledBatch:
        request = pb.SampleRequest(table=self.table, num_samples=int(num_samples),
                                   timeout_ms=wait_ms(timeout))
        wanted = None
        if self.columns is not None:
            if self.layout is None:
                raise ValueError(f"columns= needs table '{self.table}' to have a layout (a first item, or a signature)")
            wanted = self.columns.indices(self.layout)
            request.columns.extend(wanted)
        try:
            infos, parts, lengths, first = decode_batches(self._views(request))
        finally:
            self._call = None
        layout = self.layout
        if wanted is not None:  # the batch's columns are the wanted ones
            layout = self.columns.narrow(layout, np.zeros((0, len(layout.columns)), np.int64))[0]
        longest = lengths.max(axis=0).tolist()
        if layout is not None and len(layout.columns) == len(parts) and any(
                n > col.max_length for n, col in zip(longest, layout.columns, strict=True)):
            # the table grew since the session opened: widen the batches for good, never cut an item short
            longest = [max(n, col.max_length) for n, col in zip(longest, layout.columns, strict=True)]
            layout = layout_from_batch(self.table, first, longest)
            if wanted is None:
                self.layout = layout
        if layout is None or len(layout.columns) != len(parts):
            layout = layout_from_batch(self.table, first, longest)
        n = lengths.shape[0]
        nbytes = BatchLayout.build(layout, n, window_steps(resolve_windows(layout, window))).nbytes
        out = self._pool.get(nbytes)
        cols, counts, _ = assemble(layout, parts, lengths, window, out)
        keys, probs, sizes, prios, times = info_arrays(infos)
        return SampledBatch(keys, probs, sizes, prios, times, cols, counts.astype(np.int32), first.structure,
                            tuple(bool(s) for s in first.squeeze), plane=self.kind)

    def close(self) -> None:
        self._pool.clear()
