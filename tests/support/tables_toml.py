"""A daemon config with a queue and a prioritized table, and client helpers that fill and drain them."""

from __future__ import annotations

import numpy as np


def tables_toml(instance: str) -> str:
    """A queue (insertion order) and a prioritized table, served on loopback."""
    return f'''
bind_address = "127.0.0.1"
port = 0
instance_name = "{instance}"

[[tables]]
name = "queue"
preset = "queue"
max_size = 100

[[tables]]
name = "prio"
sampler = {{ prioritized = {{ priority_exponent = 1.0 }} }}
remover = "fifo"
max_size = 100
rate_limiter = {{ min_size = 1 }}
'''


def insert_items(client, values) -> None:
    """One item per value into both tables: obs = [v]*4, priority v + 1 in 'prio'."""
    for v in values:
        client.insert({"obs": np.full(4, v, np.float32)}, priorities={"queue": 1.0, "prio": float(v) + 1.0})


def drain_queue(client, n: int) -> list[int]:
    """The values of the next n items of 'queue' (FIFO: insertion order)."""
    samples = list(client.sample("queue", num_samples=n, emit_timesteps=False))
    return [int(np.asarray(s.data[0]).reshape(-1)[0]) for s in samples]
