"""Three real daemon processes on loopback, one table spread over them (docs/SHARDING.md).

Shard 0 runs with this test process's host identity (a learner here reaches it
over shm, and it is the "own host" daemon for inserts); shards 1 and 2 claim
other host identities (``GEAR_HOST_ID``), so this process is a remote learner
for them and reads their parts over TCP streams (``client.sample``: inline). Each daemon has a fixed port (a
restarted one comes back at the same address) and its own checkpoint folder.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from gear_contract.negotiation import local_host_id
from tests.support.daemon_process import DaemonProcess
from tests.support.ports import free_port

NUM_SHARDS = 3
EXPONENT = 0.8
ITEM_STEPS = 16
ITEM_DIM = 64

# name -> (sampler, max_size); every table: fifo remover, sampling from the first item on
_TABLES = {
    "prio": (f"{{ prioritized = {{ priority_exponent = {EXPONENT} }} }}", 1000),
    "uni": ('"uniform"', 1000),
    "heap": ('"max_heap"', 1000),
    "events": ('"uniform"', 1000),
    "items": ('"uniform"', 24),  # checksummed trajectories, rewritten while a learner reads
    "gate": ('"uniform"', 1000),  # samples only as inserts allow (GATE_LIMITER): a part can wait there
}
GATE_LIMITER = "{ explicit = { samples_per_insert = 1.0, min_size_to_sample = 1, min_diff = -2.0, max_diff = 1e9 } }"
TABLES = "".join(f"""
[[tables]]
name = "{name}"
sampler = {sampler}
remover = "fifo"
max_size = {max_size}
rate_limiter = {GATE_LIMITER if name == "gate" else "{ min_size = 1 }"}
""" for name, (sampler, max_size) in _TABLES.items()) + """
[[tables]]
name = "queue"
preset = "queue"
max_size = 100
"""


def shard_config(port: int, instance: str, checkpoints: Path) -> str:
    return f'''
bind_address = "127.0.0.1"
port = {port}
instance_name = "{instance}"
{TABLES}
[checkpoint]
dir = "{checkpoints}"
on_stop = true
restore = true
'''


class Cluster:
    """NUM_SHARDS daemons (see module docstring); ``restart(i)`` brings shard i back on its port."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ports = [free_port() for _ in range(NUM_SHARDS)]
        self.host_ids = [local_host_id()] + [f"other-host-{i}" for i in range(1, NUM_SHARDS)]
        self.daemons: list[DaemonProcess | None] = [None] * NUM_SHARDS
        for i in range(NUM_SHARDS):
            self.daemons[i] = self._spawn(i)
        for d in self.daemons:
            d.wait_ready()

    def _spawn(self, i: int) -> DaemonProcess:
        checkpoints = self.folder / f"ckpt{i}"
        checkpoints.mkdir(exist_ok=True)
        config = shard_config(self.ports[i], f"shardtest{os.getpid()}s{i}", checkpoints)
        return DaemonProcess(self.folder, config, name=f"shard{i}", env={"GEAR_HOST_ID": self.host_ids[i]})

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def kill(self, i: int) -> None:
        self.daemons[i].kill()

    def pause(self, i: int, paused: bool) -> None:
        """SIGSTOP / SIGCONT: a daemon that holds its connections open and answers nothing (a hung node)."""
        self.daemons[i].process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def alive(self, i: int) -> bool:
        return self.daemons[i].process.poll() is None

    def restart(self, i: int) -> None:
        self.daemons[i] = self._spawn(i)
        self.daemons[i].wait_ready()

    def stop(self) -> None:
        for d in self.daemons:
            if d is not None:
                d.stop()
