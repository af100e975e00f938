"""Many actors, each with its own Client and an open writer stream at once (the control-plane load tests)."""

from __future__ import annotations

import threading
import time

import numpy as np

import gear_client as reverb


def run_open_writers(address: str, actors: int, items: int, *, table: str = "t", barrier_s: float = 60.0,
                     deadline_s: float = 90.0) -> list[BaseException]:
    """``actors`` threads, each a Client whose writer gets its first item acknowledged, waits until every
    actor's has (all streams open at once), then writes ``items - 1`` more; item values 0..actors*items-1.

    Returns the actors' errors, one per actor still running at ``deadline_s`` included.
    """
    opened = threading.Barrier(actors, timeout=barrier_s)
    failures: list[BaseException] = []

    def actor(i: int) -> None:
        try:
            client = reverb.Client(address)
            with client.trajectory_writer(num_keep_alive_refs=1) as writer:
                for k in range(items):
                    writer.append({"x": np.full(3, i * items + k, np.float32)})
                    writer.create_item(table, 1.0, {"x": writer.history["x"][-1]})
                    if k == 0:
                        writer.flush()  # the stream is open and served
                        opened.wait()
                writer.flush()
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            failures.append(e)

    threads = [threading.Thread(target=actor, args=(i,), daemon=True) for i in range(actors)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(1.0, deadline_s - (time.monotonic() - started)))
    failures.extend(TimeoutError(f"{t.name} still running after {deadline_s} s") for t in threads if t.is_alive())
    return failures
