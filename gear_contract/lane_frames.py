"""The local lane: small control calls between a client and the daemon on its host, off gRPC.

A Python gRPC unary call costs a fixed few hundred microseconds whatever it
carries (CPU in both the client and the daemon), more than DeepMind Reverb's
whole ``mutate_priorities`` (C++ on both sides). On the daemon's host the same
call goes over a Unix stream socket instead, answered by a daemon thread that
applies it at once: a round trip of a fraction of that.
The semantics are those of the RPC: the call returns once the daemon applied
it, and its errors come back as the status the RPC would end with.

Finding it: a client asks ``ServerInfo`` with the metadata key ``LANE_KEY``; the
daemon answers, in the trailing metadata, ``advertise(name, secret)``: the
lane's socket (Linux abstract namespace: no file, gone with the daemon) and a
random secret. The answer goes only to calls the daemon's token check let
through, so holding the secret is the lane's authentication. The client uses
the lane only when ``ServerInfo.host_id`` is its own host's.

Frames, both ways: ``u32`` length of the rest (little endian), ``u8`` kind,
then the payload. Client to daemon: kind ``HELLO`` (payload: ``VERSION`` as one
byte, then the secret), once, first; then a method (``METHODS``) with its
request, one call at a time per connection. Daemon to client: kind is the gRPC
status code (0: OK, with the method's answer; else the payload is the UTF-8
error message). A hello is answered OK, UNAUTHENTICATED or FAILED_PRECONDITION
(wrong secret, another version: then the connection closes) or
RESOURCE_EXHAUSTED (the daemon's lane connections are all taken).

Both ends are on one host, so requests are raw arrays in the host's byte order
rather than protobuf (``encode_priorities``: framing and reading them costs a
few microseconds, where the protobuf message costs 10-50): MUTATE_PRIORITIES is
``u16`` table name bytes, ``u32`` updates, ``u32`` deletes (these three little
endian), the name (UTF-8), the keys (``u64``), their priorities (``f64``) and the
keys to delete (``u64``); its answer is empty. SELECT and RELEASE (a learner's
data-plane session) carry the RPC's messages: the learner's own lease calls,
without gRPC's cost per call.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gear_contract.wire import PriorityUpdates, priority_arrays

__all__ = ["LANE_KEY", "VERSION", "HELLO", "MUTATE_PRIORITIES", "SELECT", "RELEASE", "METHODS", "MAX_FRAME_BYTES",
           "MAX_REQUEST_BYTES", "MAX_HELLO_BYTES",
           "SECRET_BYTES", "HEAD", "frame", "hello", "advertise", "parse_advertisement", "encode_priorities",
           "decode_priorities", "LANE_ENV", "lane_enabled"]

LANE_KEY = "gear-local-lane"
LANE_ENV = "GEAR_LOCAL_LANE"  # "0" in a daemon's environment: no lane; in a client's: never use one
VERSION = 1
HELLO = 0
MUTATE_PRIORITIES = 1
SELECT = 2   # a SelectRequest's bytes; answered with the SelectResponse's
RELEASE = 3  # a ReleaseRequest's bytes; answered with the ReleaseResponse's
# Method kinds and the RPC each stands for (its metrics label, its statuses).
METHODS = {MUTATE_PRIORITIES: "/gear.v1.ReplayService/MutatePriorities",
           SELECT: "/gear.v1.ReplayService/Select", RELEASE: "/gear.v1.ReplayService/Release"}
# Larger requests take the RPC (a mutate of ~3 million keys); the daemon refuses larger frames.
MAX_FRAME_BYTES = 64 << 20  # an answer (a Select of 2^20 items is ~50 MB)
# A request (a mutate of ~250k keys); larger ones take the RPC. 64 connections x this bounds what
# clients can make the daemon buffer at once.
MAX_REQUEST_BYTES = 4 << 20
MAX_HELLO_BYTES = 1024
SECRET_BYTES = 32
HEAD = struct.Struct("<IB")  # length of what follows the u32 (kind byte included), kind


def lane_enabled() -> bool:
    """Whether this process may serve or use the local lane (``GEAR_LOCAL_LANE=0``: every call on gRPC)."""
    return os.environ.get(LANE_ENV, "1").strip() != "0"


def frame(kind: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame: the head and ``payload``."""
    return HEAD.pack(len(payload) + 1, kind) + payload


def hello(secret: bytes) -> bytes:
    """The hello frame: this protocol's version and the lane's secret."""
    return frame(HELLO, bytes((VERSION,)) + secret)


def advertise(name: str, secret: bytes) -> str:
    """The metadata value naming the lane's socket and its secret."""
    return f"{name} {secret.hex()}"


def parse_advertisement(value: str | bytes) -> tuple[str, bytes] | None:
    """(socket name, secret) from ``advertise``'s value; None when it is not one."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    name, _, secret = value.partition(" ")
    try:
        key = bytes.fromhex(secret)
    except ValueError:
        return None
    if not name or "\0" in name or len(key) != SECRET_BYTES:
        return None
    return name, key


_PRIORITIES_HEAD = struct.Struct("<HII")  # table name bytes, updates, deletes


def encode_priorities(table: str, updates: Mapping[Any, Any] | None, deletes: Iterable[Any] | None) -> bytes:
    """A MUTATE_PRIORITIES request of Reverb's arguments: ``updates`` key -> priority, ``deletes`` keys.

    ValueError naming the first key that is not an integer in [0, 2**64) or priority that is not a number.
    """
    updates = updates if updates is not None else {}
    if deletes is not None and not isinstance(deletes, Sequence):
        deletes = list(deletes)  # read twice when the first conversion gives way
    name = table.encode()
    if len(name) > 0xFFFF:
        raise ValueError(f"table name of {len(name)} bytes")
    try:  # ints and floats (the usual case) straight into arrays
        keys: Any = array("Q", list(updates.keys()))  # from a list: about twice as fast as from the view
        priorities: Any = array("d", list(updates.values()))
        dropped: Any = array("Q", deletes if deletes is not None else ())
    except (TypeError, ValueError, OverflowError):  # other numbers: converted as the gRPC path does
        keys, priorities, dropped = priority_arrays(updates, deletes)
    return b"".join((_PRIORITIES_HEAD.pack(len(name), len(keys), len(dropped)), name, keys, priorities, dropped))


def decode_priorities(payload: memoryview) -> PriorityUpdates:
    """The updates of an ``encode_priorities`` request (priorities copied out of ``payload``); ValueError
    when its sizes do not add up."""
    if len(payload) < _PRIORITIES_HEAD.size:
        raise ValueError(f"not a valid request message ({len(payload)} bytes)")
    name_bytes, n, m = _PRIORITIES_HEAD.unpack_from(payload)
    start = _PRIORITIES_HEAD.size + name_bytes
    if len(payload) != start + 16 * n + 8 * m:
        raise ValueError(f"not a valid request message ({len(payload)} bytes for {n} updates and {m} deletes)")
    try:
        table = bytes(payload[_PRIORITIES_HEAD.size:start]).decode()
    except UnicodeDecodeError:
        raise ValueError("not a valid request message (the table name is not UTF-8)") from None
    body = payload[start:]
    return PriorityUpdates(table, body[:8 * n].cast("Q").tolist(), np.array(body[8 * n:16 * n].cast("d")),
                           body[16 * n:].cast("Q").tolist())
