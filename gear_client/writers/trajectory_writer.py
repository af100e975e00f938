"""TrajectoryWriter: Reverb's column-wise writer, streamed over ``InsertStream``.

Data is appended column by column (one ``ColumnBuffer`` per leaf path of the
appended nests, see step_layout.py). An item references steps
(``TrajectoryColumn``s from ``history``); the steps no earlier item sent are
packed into chunks and the item names slices of chunks (chunker.py), so every
step crosses the wire at most once. The encoded item is handed to the
transport (insert_stream.py), which batches requests and counts the
acknowledged keys. At most ``max_in_flight_items`` items are unacknowledged:
``create_item`` and ``flush`` block beyond that (back-pressure from the
table's rate limiter). A failed stream surfaces on the next ``create_item``/
``flush``/``end_episode`` as Reverb's exception type; the writer then opens a
fresh stream and resends whatever data later items need.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
import weakref
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from gear_client.errors import (
    ConnectError,
    DeadlineExceededError,
    ItemsNotInsertedError,
    ReverbError,
    ServiceError,
    from_rpc_error,
)
from gear_client.writers.chunker import Chunker, NewChunk
from gear_client.writers.column_buffer import ColumnBuffer
from gear_client.writers.insert_stream import InsertStream, close_stream, describe_error
from gear_client.writers.routes import SameHostRoute
from gear_client.writers.step_layout import StepLayout
from gear_client.writers.trajectory_column import DataReference, StepCount, TrajectoryColumn
from gear_contract import nest
from gear_contract._proto import replay_pb2 as pb
from gear_contract.daemon_watch import DaemonNotAnswering
from gear_contract.specs import shape_compatible, signature_specs
from gear_contract.wire import encode_chunk_head, encode_insert_item, mark_resend

log = logging.getLogger(__name__)

__all__ = ["TrajectoryWriter", "TrajectoryColumn", "DataReference"]

DEFAULT_MAX_IN_FLIGHT_ITEMS = 128
DEFAULT_MAX_IN_FLIGHT_BYTES = 256 << 20
# How long a writer waits for a daemon that went away before it gives up the unacknowledged items, when
# neither the keyword nor the client says (a Client's connect timeout is the default).
DEFAULT_RECONNECT_TIMEOUT_S = 30.0
_CLOSED = "the TrajectoryWriter is closed"  # after close(), as the legacy Writer words it


class TrajectoryWriter:
    """Reverb's TrajectoryWriter (see the module docstring for the wire protocol).

    Construct it with ``client.trajectory_writer(num_keep_alive_refs)``.
    """

    def __init__(self, client: Any, num_keep_alive_refs: int, *, validate_items: bool = True,
                 max_in_flight_items: int = DEFAULT_MAX_IN_FLIGHT_ITEMS,
                 max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES, reconnect_timeout_s: float | None = None):
        if int(num_keep_alive_refs) < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        if int(max_in_flight_items) < 1:
            raise ValueError(f"max_in_flight_items ({max_in_flight_items}) must be a positive integer")
        self._client = client
        self._keep = int(num_keep_alive_refs)
        self._validate_items = bool(validate_items)
        # the legacy Writer's tables: a signature may describe one step of an item (as Reverb's Writer takes)
        self.step_signatures = False
        self._max_in_flight = int(max_in_flight_items)
        self._max_in_flight_bytes = int(max_in_flight_bytes)
        self._reconnect_timeout_s = _reconnect_timeout(reconnect_timeout_s, client)
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._episode_id = self._new_id()
        self._layout = StepLayout(self._keep)
        self._columns = self._layout.columns  # the same list, grown by the layout
        self._open = False  # last step opened with partial_step=True
        self._hist_len = StepCount()  # steps since the buffers were last cleared
        self._step = -1  # episode step of the last (possibly open) step
        self._episode_steps = 0  # completed steps this episode
        self._stream: InsertStream | None = None
        self._finalizer = weakref.finalize(self, close_stream, None)
        self._chunker = Chunker()
        self._table_infos: dict[str, pb.TableInfo] = {}
        self._validated: dict[Any, bool] = {}
        self._structures: dict[Any, bytes] = {}  # treedef -> encoded gear.v1.Structure
        self._same_host = SameHostRoute(client)  # the insert plane, when the daemon is on this host
        self._closed = False

    # ----------------------------------------------------------- context --
    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, tb: Any) -> None:
        try:
            if not self._closed and (exc_type is None or not issubclass(exc_type, ReverbError)):
                self.flush()
        finally:
            self.close()

    def __del__(self) -> None:
        try:
            self.close(_wait=False)
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # ------------------------------------------------------------ public --
    @property
    def history(self) -> Any:
        """The appended steps per column, structured like the appended data."""
        if not self._columns:
            raise RuntimeError("history cannot be accessed before `append` is called at least once.")
        return self._layout.history(self._hist_len)

    @property
    def episode_steps(self) -> int:
        """Completed ``append`` calls (partial ones not counted) since the last ``end_episode``."""
        return self._episode_steps

    @property
    def max_num_keep_alive_refs(self) -> int:
        return max([self._keep] + [c.keep for c in self._columns])

    def configure(self, path: tuple, *, num_keep_alive_refs: int, max_chunk_length: int | None) -> None:
        """Override the keep-alive window (and the chunk length) of one column.

        Args:
          path: the column's path in the appended structure (a tuple of keys and indices).
          num_keep_alive_refs: how many of that column's latest steps stay referable.
          max_chunk_length: steps per chunk of that column (None: the writer decides), at most
            ``num_keep_alive_refs``.

        Raises:
          TypeError: ``path`` is not a tuple.
          ValueError: ``num_keep_alive_refs`` is not positive or ``max_chunk_length`` is out of range.
        """
        if not isinstance(path, tuple):
            raise TypeError(f"path must be a tuple, got {type(path)}")
        if num_keep_alive_refs < 1:
            raise ValueError(f"num_keep_alive_refs ({num_keep_alive_refs}) must be a positive integer")
        if max_chunk_length is not None and (max_chunk_length < 1 or max_chunk_length > num_keep_alive_refs):
            raise ValueError(f"max_chunk_length ({max_chunk_length}) must be None or a positive integer <= "
                             f"num_keep_alive_refs ({num_keep_alive_refs})")
        self._layout.configure(path, num_keep_alive_refs, max_chunk_length)

    def append(self, data: Any, *, partial_step: bool = False) -> None:
        """Append one step (or part of it, with ``partial_step``) column-wise.

        Args:
          data: a nest of arrays or scalars; each leaf path is one column, and a leaf may be left out of a
            step (None in its history).
          partial_step: leave the step open: the next ``append`` adds columns to the same step.

        Raises:
          ValueError: a leaf has object dtype, or a dtype or shape other than its column's earlier steps.
          RuntimeError: the writer is closed.
        """
        if self._closed:
            raise RuntimeError(_CLOSED)
        # Fast path: a flat dict/sequence of leaves laid out as before, with the
        # same dtypes and shapes, starting a new step. Validated before any change.
        plan = None if self._open else self._layout.plan_for(data)
        if plan is not None:
            getter = plan.getter
            values = data if getter is None else getter(data)
            columns = plan.columns
            for column, x in zip(columns, values):  # noqa: B905 - same length by construction
                if type(x) is np.ndarray:
                    if x.shape != column.shape or x.dtype != column.dtype:
                        break
                elif type(x) not in column.fast_types:
                    break
            else:
                self._new_step(columns, values, plan.missing, partial_step)
                return
        columns, values, missing = self._layout.flatten(data, self._hist_len.n, self._episode_id)
        if self._open:
            self._fill_open_step(columns, values, partial_step)
        else:
            self._new_step(columns, values, missing, partial_step)

    def create_item(self, table: str, priority: float, trajectory: Any) -> None:
        """Send an item of ``table`` made of the trajectory's columns.

        Blocks while ``max_in_flight_items`` items are unacknowledged (only while the table's rate
        limiter holds inserts).

        Args:
          table: the table to insert into.
          priority: the item's priority (finite, >= 0).
          trajectory: a nest of ``TrajectoryColumn``s from ``history`` (each at least one step).

        Raises:
          TypeError: a leaf of ``trajectory`` is not a TrajectoryColumn.
          ValueError: the priority is invalid, a column is empty, refers to expired data or to another
            writer, the table does not exist, or the item does not fit the table's signature
            (``validate_items``).
          ItemsNotInsertedError: earlier items were given up (the daemon stayed away or silent past
            ``reconnect_timeout_s``).
          ConnectError: the daemon stayed silent past that timeout before the writer held any item.
          DeadlineExceededError: waiting for in-flight items timed out.
          RuntimeError: the writer is closed.
        """
        self._check_open()
        flat, treedef = nest.flatten_with_treedef(trajectory)
        for column in flat:
            if not isinstance(column, TrajectoryColumn):
                raise TypeError(f"All leaves of `trajectory` must be `TrajectoryColumn` but got {trajectory}")
        if not flat:
            raise ValueError("trajectory must contain at least one column")
        for i, column in enumerate(flat):
            if len(column) == 0:
                raise ValueError(f"trajectory column {i} is empty: every column needs at least one step")
        try:
            priority = float(priority)
        except (TypeError, ValueError) as e:
            raise ValueError(f"priority must be a number, got {priority!r}") from e
        if math.isnan(priority):
            raise ValueError("priority must not be NaN")
        if priority < 0:
            raise ValueError(f"priority must not be negative, got {priority}")
        if not isinstance(table, str) or not table:
            raise ValueError(f"table must be a non-empty string, got {table!r}")
        for i, column in enumerate(flat):
            if not column.is_alive():
                raise ValueError(f"trajectory column {i} references data that has expired (older than "
                                 f"num_keep_alive_refs steps, or cleared by end_episode)")
            for col, _ in column.segments:
                if self._layout.by_path.get(col.path) is not col:
                    raise ValueError(f"trajectory column {i} references data of another writer")
        specs = self._column_specs(flat)
        if self._validate_items:
            self._validate(table, flat, specs)
        structure = self._structures.get(treedef)
        if structure is None:
            structure = nest.structure_of(trajectory).SerializeToString()
            if len(self._structures) > 256:
                self._structures.clear()
            self._structures[treedef] = structure

        key = self._new_id()
        if self._send_same_host(table, key, priority, structure, flat):
            return
        stream = self._ready_stream("create_item")
        if not stream.wait(self._max_in_flight - 1, self._max_in_flight_bytes, None):
            raise DeadlineExceededError("create_item: timed out waiting for in-flight items")
        self._raise_stream_error("create_item")

        chunks: list[NewChunk] = []
        item_columns = self._chunker.item_columns(flat, chunks)
        self._chunker.collect_releases(self._columns)
        stream.send_item(chunks, key, encode_insert_item(key, table.encode(), priority, structure, item_columns),
                         self._chunker.take_releases())

    def flush(self, block_until_num_items: int = 0, timeout_ms: int | None = None) -> None:
        """Block until at most ``block_until_num_items`` items are unacknowledged by the server.

        Args:
          block_until_num_items: how many items may stay unacknowledged.
          timeout_ms: the most milliseconds to wait (None or negative: no limit).

        Raises:
          ValueError: ``block_until_num_items`` is negative, or an earlier item was refused.
          DeadlineExceededError: the items were not acknowledged within ``timeout_ms``.
          ItemsNotInsertedError: items were given up (the daemon stayed away or silent past
            ``reconnect_timeout_s``).
          ConnectError: the daemon stayed silent past that timeout before the writer held any item.
          RuntimeError: the writer is closed.
        """
        self._check_open()
        if block_until_num_items < 0:
            raise ValueError(f"block_until_num_items must be >= 0, got {block_until_num_items}")
        self._raise_stream_error("flush")
        deadline = None if timeout_ms is None or timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0
        if not self._same_host.wait(block_until_num_items, deadline):
            raise DeadlineExceededError(f"flush did not complete within {timeout_ms} ms "
                                        f"({self._same_host.in_flight} items still in flight)")
        self._raise_same_host_error("flush")
        self._same_host.flushed()
        stream = self._stream
        if stream is None:
            return
        self._chunker.collect_releases(self._columns)
        stream.send_releases(self._chunker.take_releases())
        ok = stream.wait(block_until_num_items, 1 << 62, deadline)
        self._raise_stream_error("flush")
        if not ok:
            raise DeadlineExceededError(
                f"flush did not complete within {timeout_ms} ms ({stream.in_flight} items still in flight)")

    def end_episode(self, clear_buffers: bool = True, timeout_ms: int | None = None) -> None:
        """Flush, then start a new episode (and forget the history with ``clear_buffers``).

        The episode is reset even when the flush times out (DeadlineExceededError).

        Args:
          clear_buffers: forget the appended steps (``history`` starts empty).
          timeout_ms: the most milliseconds the flush waits (None: no limit).

        Raises:
          DeadlineExceededError: the flush did not complete within ``timeout_ms``.
          ItemsNotInsertedError: items were given up (the daemon stayed away past ``reconnect_timeout_s``).
          RuntimeError: the writer is closed.
        """
        try:
            self.flush(0, timeout_ms)
        finally:
            self._episode_id = self._new_id()
            self._open = False
            self._step = -1
            self._episode_steps = 0
            for column in self._columns:
                if clear_buffers:
                    column.clear(self._episode_id)
                else:
                    column.start_episode(self._episode_id)
            if clear_buffers:
                self._hist_len.n = 0
                self._chunker.release_all(self._columns)
                if self._stream is not None and not self._stream.done and self._chunker.pending_release:
                    self._stream.send_releases(self._chunker.take_releases())

    def close(self, _wait: bool = True) -> None:
        """End the stream (items not yet acknowledged may be lost; ``flush`` first to keep them).

        Closing twice is fine; ``append``, ``create_item`` and ``flush`` afterwards raise RuntimeError.
        """
        self._closed = True
        stream, self._stream = self._stream, None
        self._finalizer.detach()
        self._same_host.close(_wait)
        if stream is not None:
            if _wait:
                stream.close()
            else:
                stream.abort()
        self._chunker.forget(self._columns)  # a new stream starts empty

    # ---------------------------------------------------------- appending --
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(_CLOSED)

    def _new_step(self, columns: list[ColumnBuffer], values: Sequence[Any], missing: list[ColumnBuffer],
                  partial_step: bool) -> None:
        """Store a new step's values and record them (and the columns without data) in the history."""
        self._step = step = self._step + 1
        self._hist_len.n += 1
        release_views = self._release_views
        for column, x in zip(columns, values):  # noqa: B905 - same length by construction
            column.hist.append(column.store(x, step, release_views))
        for column in missing:
            column.hist.append(None)
        self._open = partial_step
        if not partial_step:
            self._episode_steps += 1

    def _fill_open_step(self, columns: list[ColumnBuffer], values: Sequence[Any], partial_step: bool) -> None:
        """Store the rest of the step opened with ``partial_step`` (each field at most once)."""
        for column in columns:
            if not column.hist or column.hist[-1] is not None:
                raise ValueError(
                    f"Field {column.name} has already been set in the active step by previous (partial) append "
                    f"call and thus must be omitted or set to None")
        step = self._step
        for column, x in zip(columns, values, strict=True):
            column.hist[-1] = column.store(x, step, self._release_views)
        self._open = partial_step
        if not partial_step:
            self._episode_steps += 1

    # ------------------------------------------------------------- items --
    @staticmethod
    def _column_specs(flat: list[TrajectoryColumn]) -> list[tuple[np.dtype, tuple]]:
        specs = []
        for i, column in enumerate(flat):
            first = column.segments[0][0]
            for col, _ in column.segments[1:]:
                if col.dtype != first.dtype or col.shape != first.shape:
                    raise ValueError(f"trajectory column {i} mixes data of dtype/shape {first.dtype}{first.shape} "
                                     f"and {col.dtype}{col.shape}")
            specs.append((first.dtype, column.shape))
        return specs

    def _table_info(self, table: str, refresh: bool = False) -> pb.TableInfo:
        info = None if refresh else self._table_infos.get(table)
        if info is None:
            info = self._client._table_info(table, refresh=True) if refresh else self._client._table_info(table)
            self._table_infos[table] = info
        return info

    def _validate(self, table: str, flat: list[TrajectoryColumn], specs: list[tuple[np.dtype, tuple]]) -> None:
        """Check the table exists and the item fits its signature (ValueError naming the table)."""
        cache_key = (table, tuple((dt.str, shape) for dt, shape in specs))
        if cache_key in self._validated:
            return
        problem = _signature_problem(table, self._table_info(table), specs, self.step_signatures)
        if problem is not None:
            # The cached info may be stale (e.g. the server at this address was
            # restarted with other tables): look again before refusing.
            problem = _signature_problem(table, self._table_info(table, refresh=True), specs, self.step_signatures)
            if problem is not None:
                raise ValueError(problem)
        if len(self._validated) > 1024:
            self._validated.clear()
        self._validated[cache_key] = True

    # ------------------------------------------------------------ routes --
    def _send_same_host(self, table: str, key: int, priority: float, structure: bytes,
                        flat: list[TrajectoryColumn]) -> bool:
        """Write the item into the table's shared memory when this host's daemon lets the writer
        (gear_client/writers/routes.py); False: it goes over InsertStream. Items reach the table in order:
        a route waits until the other one's items are in before it takes one."""
        try:
            rows = self._same_host.prepare(table, structure, flat)
            if rows is None:
                if self._same_host.in_flight:
                    self._same_host.wait(0)
                self._raise_same_host_error("create_item")
                return False
            stream = self._stream
            if stream is not None and stream.in_flight:
                stream.wait(0, 1 << 62, None)
                self._raise_stream_error("create_item")
            self._same_host.write(table, key, priority, rows, self._max_in_flight, self._max_in_flight_bytes)
        except ReverbError:
            raise
        except (grpc.RpcError, RuntimeError) as e:
            self._plane_failed(e, "create_item")
            return False
        return True

    def _raise_same_host_error(self, operation: str) -> None:
        error = self._same_host.error
        if error is not None:
            self._plane_failed(error, operation)

    def _plane_failed(self, error: BaseException, operation: str) -> None:
        """The insert plane's stream failed. Transient (the daemon went away or is stopping): its
        uncommitted items go over InsertStream, marked as resent (a key already in the table stays as
        it is), which reconnects and resends them. Otherwise the error is raised (items lost, as a
        failed InsertStream loses them)."""
        items = self._same_host.take_uncommitted(error)
        if isinstance(error, grpc.RpcError) and error.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                                      grpc.StatusCode.CANCELLED):
            raise from_rpc_error(error, operation) from error
        if isinstance(error, DaemonNotAnswering):  # silent for the whole connect timeout: give the items up
            keys = [item.key for item in items]
            log.warning("%s: %s; %d items given up", operation, error, len(keys))
            if not keys:
                raise ConnectError(f"{operation}: {error}", address=error.address, cause="unreachable") from error
            raise ItemsNotInsertedError(f"{operation}: {len(keys)} items were not acknowledged: {error}"
                                        f"{_keys_text(keys)}", keys) from error
        if not items:
            return
        log.warning("insert plane to %s lost (%s): %d items it had not committed go over InsertStream",
                    self._client.server_address, describe_error(error), len(items))
        stream = self._ready_stream(operation)
        for item in items:
            chunks: list[NewChunk] = []
            columns = []
            episode = item.episode_ids[0] if item.episode_ids else 0
            for rows, squeeze in zip(item.columns, item.squeeze, strict=True):
                chunk_key = self._chunker.new_key()
                data = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8))
                head = encode_chunk_head(chunk_key, rows.dtype.str.encode(), rows.shape, data.nbytes, episode, 0)
                chunks.append(NewChunk(chunk_key, head, data))
                columns.append(([(chunk_key, 0, rows.shape[0])], squeeze))
            encoded = mark_resend(encode_insert_item(item.key, item.table.encode(), item.priority, item.structure,
                                                     columns))
            stream.send_item(chunks, item.key, encoded, [c.key for c in chunks])

    # ------------------------------------------------------------ stream --
    def _ready_stream(self, operation: str) -> InsertStream:
        self._raise_stream_error(operation)
        stream = self._stream
        if stream is None or stream.done:
            try:
                stream = self._stream = InsertStream(self._client, self._reconnect_timeout_s)
            except grpc.RpcError as e:
                raise from_rpc_error(e, operation) from e
            except (ValueError, RuntimeError) as e:  # e.g. the client's channel was closed
                raise ServiceError(f"{operation}: cannot open the insert stream: {e}") from e
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, close_stream, stream)
        return stream

    def _release_views(self, column: ColumnBuffer, target: np.ndarray) -> None:
        """Send the pending batch if it holds views of ``target``, a buffer about to be overwritten.

        Chunks are views of column buffers until their batch is joined into a
        message (see ``ColumnBuffer.compact``).
        """
        if self._stream is not None:
            self._stream.release_views(target.ctypes.data, target.ctypes.data + target.nbytes)

    def _raise_stream_error(self, operation: str) -> None:
        """Raise what the transport failed since the last call (Reverb's exception types)."""
        stream = self._stream
        if stream is None:
            return
        error, lost, failed = stream.take_failure()
        if failed:
            raise ItemsNotInsertedError(
                f"{operation}: {len(failed)} items were not inserted: the daemon at "
                f"{stream.address} was unreachable for {self._reconnect_timeout_s:g} s "
                f"(reconnect_timeout_s, by default the client's connect_timeout){_keys_text(failed)}", failed)
        if error is None:
            return
        if isinstance(error, grpc.RpcError):
            raise from_rpc_error(error, operation) from error
        if isinstance(error, Exception) and lost and not isinstance(error, ServiceError):
            raise ServiceError(f"{operation}: the insert stream failed: {error}") from error
        raise error

    def _new_id(self) -> int:
        return self._rng.getrandbits(64) or 1


def _signature_problem(table: str, info: pb.TableInfo, specs: list[tuple[np.dtype, tuple]],
                       per_step: bool = False) -> str | None:
    """Why an item of these column specs does not fit the table's signature (None: it fits). ``per_step``
    (the legacy Writer's items, whose columns are steps): a column also fits when each of its steps does."""
    if not info.HasField("signature") or not len(info.signature.leaves):
        return None
    expected = signature_specs(info.signature)
    if len(expected) != len(specs):
        return (f"Unable to create item in table '{table}': the trajectory has {len(specs)} columns but the table "
                f"signature has {len(expected)}")
    for i, ((dtype, shape), spec) in enumerate(zip(specs, expected, strict=True)):
        fits = shape_compatible(spec.shape, shape) or (per_step and shape_compatible(spec.shape, shape[1:]))
        if dtype != spec.dtype or not fits:
            label = spec.name or f"column {i}"
            return (f"Unable to create item in table '{table}': {label} has dtype {dtype} and shape {list(shape)} "
                    f"but the table signature expects dtype {spec.dtype} and shape {list(spec.shape)}")
    return None


def _keys_text(keys: Sequence[int]) -> str:
    """'; keys: k1, k2, ...' (the first eight) for an error message; empty for none."""
    if not keys:
        return ""
    return "; keys: " + ", ".join(str(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")


def _reconnect_timeout(value: float | None, client: Any) -> float:
    """The keyword, else the client's connect timeout (``connect_timeout``/``GEAR_CONNECT_TIMEOUT``; None: forever)."""
    if value is None:
        value = getattr(client, "_connect_timeout", DEFAULT_RECONNECT_TIMEOUT_S)
        if value is None:
            return math.inf
    if not value > 0:
        raise ValueError(f"reconnect_timeout_s must be a positive number of seconds, got {value}")
    return float(value)
