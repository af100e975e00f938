"""Writers' streams on the process's one aio loop thread: no thread per writer, everything acknowledged,
and a process that exits with writers still open does not hang (a real daemon, real actor processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np

import gear_client as reverb
from tests.support.paths import ROOT

EXIT_BOUND_S = 60.0  # a loaded machine: the actor process's imports and start take most of it

ACTOR = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import gear_client as reverb

    address, actors = sys.argv[1], int(sys.argv[2])
    writers = []
    lock = threading.Lock()

    def actor(a):
        writer = reverb.Client(address).trajectory_writer(1)
        for i in range(3):
            writer.append({"a": np.int64(a), "i": np.int64(i)})
            writer.create_item("q", 1.0, {"a": writer.history["a"][-1], "i": writer.history["i"][-1]})
        writer.flush()
        with lock:
            writers.append(writer)  # left open: the process exits with its streams open

    threads = [threading.Thread(target=actor, args=(a,)) for a in range(actors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(len(writers), threading.active_count(), flush=True)
""")


def _table(size: int) -> reverb.Table:
    return reverb.Table.queue("q", max_size=size)  # each item sampled once


def test_many_open_writers_share_one_loop_thread_and_every_item_is_acknowledged():
    actors = 40
    with reverb.Server([_table(1000)]) as server:
        address = f"localhost:{server.port}"
        before = threading.active_count()
        writers = []
        for a in range(actors):
            writer = reverb.Client(address).trajectory_writer(1)
            for i in range(3):
                writer.append({"a": np.int64(a), "i": np.int64(i)})
                writer.create_item("q", 1.0, {"a": writer.history["a"][-1], "i": writer.history["i"][-1]})
            writer.flush()
            writers.append(writer)
        # 40 open streams: the loop thread (and gRPC's own few), not two or three threads a writer
        assert threading.active_count() - before <= 4, [t.name for t in threading.enumerate()]
        assert reverb.Client(address).server_info()["q"].current_size == actors * 3
        for writer in writers:
            writer.close()
        sampled = reverb.Client(address).sample("q", num_samples=actors * 3, emit_timesteps=False)
        seen = set()
        for sample in sampled:
            a, i = (sample.data["a"], sample.data["i"]) if isinstance(sample.data, dict) else sample.data
            seen.add((int(np.asarray(a).reshape(-1)[0]), int(np.asarray(i).reshape(-1)[0])))
        assert seen == {(a, i) for a in range(actors) for i in range(3)}


def test_a_process_that_exits_with_open_writers_exits_promptly_and_its_items_are_in():
    actors = 30
    with reverb.Server([_table(1000)]) as server:
        address = f"localhost:{server.port}"
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-c", ACTOR, address, str(actors)], cwd=ROOT, capture_output=True,
                             text=True, timeout=EXIT_BOUND_S * 2)
        elapsed = time.monotonic() - started
        assert out.returncode == 0, out.stderr[-3000:]
        assert elapsed < EXIT_BOUND_S
        opened, threads = map(int, out.stdout.split())
        assert opened == actors and threads <= 8, out.stdout
        assert reverb.Client(address).server_info()["q"].current_size == actors * 3
