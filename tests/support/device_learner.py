"""A device-plane learner process.

Usage: ``python -m tests.support.device_learner reader|sampler ADDRESS TABLE BATCHES [GPU]``.

``sampler``: batches of 16 from ``PlaneSampler(device="cuda:GPU")``, each item checked against its checksum
and key (``check_batch``); prints the plane's kind and the items checked.

Selects batches of 16 through ``DeviceTierReader`` (on GPU ``GPU`` when given, else the reader's
default), checks every item of each batch whose lease was still good against its checksum and key,
and prints one JSON line: items, bad, mirrored (items read from the mirror), stale (batches), bytes_differ.
Each gathered row is also compared byte for byte with the segment's row (on the GPU there).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import grpc
import numpy as np

from gear_client.data_planes.device import DeviceTierReader, columns
from gear_contract._proto import replay_pb2_grpc as pb_grpc
from tests.support.trajectories import check_batch, item_ok


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


def run_sampler(address: str, table: str, batches: int, device: int) -> dict[str, Any]:
    from gear_client.data_planes.sampler import PlaneSampler

    sampler = PlaneSampler(address, table, device=f"cuda:{device}")
    items = 0
    try:
        for batch in sampler.batches(16, depth=2):
            host = HostBatch(batch)
            items += check_batch(host)
            if items >= batches * 16:
                break
        return {"kind": sampler.kind, "items": items}
    finally:
        sampler.close()


class HostBatch:
    """A SampledBatch's columns copied to the host, for ``check_batch``."""

    def __init__(self, batch: Any):
        self.columns = [c.get() for c in batch.columns]
        self.lengths, self.keys = batch.lengths, batch.keys

    def __len__(self) -> int:
        return len(self.keys)


if __name__ == "__main__":
    mode, address, table, batches = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    gpu = int(sys.argv[5]) if len(sys.argv) > 5 else None
    if mode == "sampler":
        print(json.dumps(run_sampler(address, table, batches, gpu or 0)))
    else:
        print(json.dumps(run(address, table, batches, gpu)))
