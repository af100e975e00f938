"""InsertStream requests read into table items: the one parser the daemon's servicer and the ingest workers share.

A request carries chunks (a column's steps as a tensor) and items that reference
slices of them. ``receive_chunks`` keeps a stream's chunks as arrays, their bytes
counted against the stream's limits; ``build_item`` turns one ``PrioritizedItem``
into a validated ``ItemToInsert`` (BadRequest naming the item otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.errors import shorten
from gear_server.rpc.limits import StreamBytes
from gear_server.table.items import BadRequest, ItemToInsert, tensor_to_array

SERVICE_NAME = "gear.v1.ReplayService"
INSERT_STREAM_METHOD = f"/{SERVICE_NAME}/InsertStream"


class Chunk:
    """A chunk received on an insert stream: its steps as an array, its episode and its wire bytes."""

    __slots__ = ("array", "episode_id", "nbytes")

    def __init__(self, array: np.ndarray, episode_id: int, nbytes: int):
        self.array = array
        self.episode_id = episode_id
        self.nbytes = nbytes


def serialize(message: Any) -> bytes:
    """A protobuf message's bytes (gRPC's response and request serializer)."""
    return message.SerializeToString()


def receive_chunks(request: pb.InsertStreamRequest, chunks: dict[int, Chunk], held: StreamBytes) -> None:
    """Keep a request's chunks as arrays in ``chunks``, their bytes taken from ``held`` (a limit raises
    LimitExceeded); a resent chunk key replaces the old chunk and gives its bytes back.

    Raises:
        BadRequest: a chunk's tensor is not a valid array of at least one dimension.
    """
    for chunk in request.chunks:
        nbytes = len(chunk.data.data)
        previous = chunks.get(chunk.chunk_key)
        held.take(nbytes)
        chunks[chunk.chunk_key] = Chunk(tensor_to_array(chunk.data, f"chunk {chunk.chunk_key}", min_rank=1),
                                        chunk.episode_id, nbytes)
        if previous is not None:
            held.give(previous.nbytes)


def build_item(item: pb.PrioritizedItem, chunks: Mapping[int, Chunk]) -> ItemToInsert:
    """One PrioritizedItem's ItemToInsert from the stream's chunks, validated (gear_server.table.items).

    Raises:
        BadRequest: a column is empty, references an unknown chunk or steps outside it, a squeezed column
            spans more than one step, or the item fails validation.
    """
    where = f"item {item.key} for table '{shorten(item.table)}'"
    columns = []
    squeeze = []
    episodes = set()
    for c, column in enumerate(item.columns):
        if not column.slices:
            raise BadRequest(f"{where}: column {c} is empty")
        parts = []
        for s in column.slices:
            chunk = chunks.get(s.chunk_key)
            if chunk is None:
                raise BadRequest(f"{where}: column {c} references unknown chunk {s.chunk_key}")
            steps = chunk.array.shape[0]
            if s.offset < 0 or s.length < 1 or s.offset + s.length > steps:
                raise BadRequest(f"{where}: column {c} slice [{s.offset}, {s.offset + s.length}) is outside "
                                 f"chunk {s.chunk_key} of {steps} steps")
            parts.append(chunk.array[s.offset:s.offset + s.length])
            episodes.add(chunk.episode_id)
        if column.squeeze:
            if len(parts) != 1 or parts[0].shape[0] != 1:
                raise BadRequest(f"{where}: column {c} is squeezed but spans "
                                 f"{sum(p.shape[0] for p in parts)} steps")
            columns.append(parts[0][0, ...])  # a 0-d array for scalar steps, not a numpy scalar
        else:
            columns.append(parts[0] if len(parts) == 1 else parts)
        squeeze.append(bool(column.squeeze))
    built = ItemToInsert(key=int(item.key), priority=float(item.priority), structure=item.structure,
                         columns=columns, squeeze=squeeze, episode_ids=frozenset(episodes), resend=item.resend)
    try:
        built.validated()
    except ValueError as e:
        raise BadRequest(f"table '{shorten(item.table)}': {e}") from None
    return built
