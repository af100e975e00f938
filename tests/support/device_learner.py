"""A device-plane learner process: ``python -m tests.support.device_learner ADDRESS TABLE BATCHES [GPU]``.

Selects batches of 16 through ``DeviceTierReader`` (on GPU ``GPU`` when given, else the reader's
default), checks every item of each batch whose lease was still good against its checksum and key,
and prints one JSON line: items, bad, mirrored (items read from the mirror), stale (batches), bytes_differ.
Each gathered row is also compared byte for byte with the segment's row (on the GPU there).
"""

from __future__ import annotations

import json
import sys

import grpc
import numpy as np

from gear_client.data_planes.device import DeviceTierReader, columns
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.trajectories import item_ok


def run(address: str, table: str, batches: int, device: int | None) -> dict[str, int]:
    stub = pb_grpc.ReplayServiceStub(grpc.insecure_channel(address))
    counts = {"items": 0, "bad": 0, "mirrored": 0, "stale": 0, "bytes_differ": 0}
    with DeviceTierReader(stub, table, device=device) as reader:
        for _ in range(batches):
            selection = reader.select(16)
            batch = reader.gather(selection)
            differ = segment_differences(reader, selection, batch)
            host = batch.get() if reader.on_gpu else batch
            if not reader.release(selection):
                counts["stale"] += 1
                continue
            counts["bytes_differ"] += differ
            action, obs, reward = columns(host, reader.layout)
            for i in range(len(selection)):
                n = int(selection.lengths[i, 0])
                ok = item_ok(action[i, :n], obs[i, :n], reward[i, :n]) and int(action[i, 0]) == int(
                    selection.infos[0][i])
                counts["bad"] += not ok
            counts["items"] += len(selection)
            counts["mirrored"] += int((selection.mirror_rows >= 0).sum())
    return counts


def segment_differences(reader: DeviceTierReader, selection, batch) -> int:
    """Rows of ``batch`` that differ from the selected slots' rows in the segment (lease held; on the GPU there)."""
    if not reader.on_gpu:
        return int(np.count_nonzero((reader.segment_rows(selection.slots) != batch).any(axis=1)))
    import cupy as cp

    with cp.cuda.Device(reader.device):
        expected = reader.segment_rows(selection.slots)
        return int(cp.count_nonzero(cp.any(expected != batch, axis=1)))


if __name__ == "__main__":
    gpu = int(sys.argv[4]) if len(sys.argv) > 4 else None
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]), gpu)))
