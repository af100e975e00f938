"""The shm plane's GPU gathers and the learner's stream: no blocking streams, ordering by events.

Skipped without CuPy and a CUDA GPU (never faked).
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.data_planes.sampler import PlaneSampler
from gear_kernels import gpu_available
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")]

SPIN_CU = r"""
extern "C" __global__ void spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)ns);
}
"""


def spin(stream, seconds: float):
    """Keep ``stream`` busy for about ``seconds`` (one thread watching the GPU's clock); an event after it."""
    import cupy as cp

    with stream:
        cp.RawKernel(SPIN_CU, "spin")((1,), (1,), (np.int64(seconds * 1e9),))
    event = cp.cuda.Event()
    event.record(stream)
    return event


class HostView:
    """A batch's columns as host copies, for check_batch."""

    def __init__(self, columns, lengths, keys):
        self.columns, self.lengths, self.keys = columns, lengths, keys

    def __len__(self) -> int:
        return len(self.keys)


@pytest.fixture(scope="module")
def daemon():
    d = start_daemon(table_config("t", 64))
    fill(d.tables["t"], 40, length=64, dim=1024)
    yield d
    d.stop()


def test_gathers_in_flight_do_not_hold_the_default_stream(daemon):
    """Work on the legacy default stream (the learner's) never waits for the plane's gather streams."""
    import cupy as cp

    with PlaneSampler(daemon.address(), "t", device="cuda") as s:
        s.sample(8)
        streams = s._reader._streams
        assert streams
        x = cp.arange(10)
        int((x * 2).sum())  # the learner's kernels compiled before the clock starts
        busy = [spin(stream, 2.0) for stream in streams]  # as gathers read ahead would keep them
        with cp.cuda.Stream.null:
            y = x * 2
        cp.cuda.Stream.null.synchronize()
        assert not any(e.done for e in busy), "the default stream waited for a gather stream"
        assert int(y.sum()) == 90
        for e in busy:
            e.synchronize()


def test_gathers_wait_for_the_learners_reads_before_reusing_their_memory(daemon):
    """The learner queues a slow read of a batch and drops it; later gathers (which may reuse that memory
    from the pool) write only after the read."""
    import cupy as cp

    with PlaneSampler(daemon.address(), "t", device="cuda") as s:
        batch = s.sample(16)
        spin(cp.cuda.Stream.null, 0.3)  # the learner's step, still running when the next batches are gathered
        copies = [c.copy() for c in batch.columns]  # queued after it
        lengths, keys = batch.lengths.copy(), batch.keys.copy()
        del batch
        for _ in range(12):  # every gather stream's pool sees the freed memory
            s.sample(16)
        assert check_batch(HostView([cp.asnumpy(c) for c in copies], lengths, keys)) == 16
