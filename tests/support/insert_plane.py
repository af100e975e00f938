"""The insert plane end to end: a daemon with ingest settings, actor processes writing to it, its table read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from gear_contract._proto import replay_pb2 as pb
from gear_server.config import DaemonSettings
from gear_server.daemon import Daemon
from gear_server.ingest.settings import IngestSettings
from tests.support.paths import ROOT
from tests.support.trajectories import item_ok

_instances = iter(range(1 << 30))

ACTOR = """
import json, sys
from tests.support.trajectories import write_trajectories
address, first, count, length, dim = sys.argv[1], *map(int, sys.argv[2:6])
print(json.dumps(write_trajectories(address, first, count, length, dim)))
"""


def start(*tables: pb.TableConfig, port: int = 0, **ingest) -> Daemon:
    config = pb.ServerConfig(port=port, bind_address="localhost",
                             instance_name=f"iptest{os.getpid()}x{next(_instances)}",
                             tables=list(tables))
    settings = DaemonSettings.from_server_config(config)
    settings.ingest = IngestSettings(**ingest)
    daemon = Daemon(settings, seed=0)
    daemon.start()
    return daemon


def run_actor(address: str, first: int, count: int, length: int, dim: int, env: dict | None = None,
              wait: bool = True) -> subprocess.Popen | dict:
    process = subprocess.Popen([sys.executable, "-c", ACTOR, address, str(first), str(count), str(length), str(dim)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    if not wait:
        return process
    return finish(process)


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def items_in_insert_order(table) -> list[dict[str, np.ndarray]]:
    """Every item of a table, oldest first, read back from its segment (snapshot)."""
    snap = table.snapshot()
    lengths = snap.arrays["lengths"]
    out, offsets = [], [0, 0, 0]
    for lens in lengths:
        item = {}
        for c, name in enumerate(("action", "obs", "reward")):
            n = int(lens[c])
            item[name] = snap.arrays[f"column/{c}"][offsets[c]:offsets[c] + n]
            offsets[c] += n
        out.append(item)
    return out


def slots_accounted(table) -> bool:
    """Every slot is free, holds an item, is leased after a delete, or is reserved: none leaked."""
    counts = table.slot_counts()
    return counts.free + counts.items + counts.leased_deleted + counts.reserved == table.capacity


def intact(batch) -> int:
    """Assert every item of a SampledBatch carries a matching checksum (writers pick their own keys);
    returns the item count."""
    action, obs, reward = batch.columns
    for i in range(len(batch)):
        n = int(batch.lengths[i, 0])
        assert item_ok(action[i, :n], obs[i, :n], reward[i, :n]), f"item {i} (key {batch.keys[i]}) is torn"
    return len(batch)
