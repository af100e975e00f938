"""The rdma plane on a real RDMA device (marker ``rdma``; skipped where none exists).

The daemon registers its segment with the real NIC (``rdma="auto"``) and a
learner that pretends to be on another host (so shared memory is not offered)
reads batches with real RDMA READs through pyverbs. Run with ``pytest -m rdma``
on a host with an active InfiniBand or RoCE port (``GEAR_RDMA_DEVICE`` /
``GEAR_RDMA_PORT`` / ``GEAR_RDMA_GID_INDEX`` pin it). No machine available to
the project so far has had one: see docs/DATA_PLANES.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from gear_client.data_planes.sampler import PlaneSampler
from gear_contract import rdma_verbs as verbs
from tests.support.plane_daemon import start_daemon, table_config
from tests.support.trajectories import check_batch, fill

pytestmark = pytest.mark.rdma


def _port_or_skip():
    if verbs.unavailable_reason() is not None:
        pytest.skip(f"pyverbs is not importable: {verbs.unavailable_reason()}")
    port = verbs.probe()
    if port is None:
        pytest.skip("no active RDMA port on this host")
    return port


@pytest.fixture
def hardware_daemon():
    _port_or_skip()
    d = start_daemon(table_config("t", 64), rdma="auto")
    fill(d.tables["t"], 64, length=64, dim=1024)
    yield d
    d.stop()


def test_a_remote_learner_reads_intact_batches_with_real_rdma_reads(hardware_daemon):
    d = hardware_daemon
    with PlaneSampler(d.address(), "t", planes=["rdma"], host_id="learner-on-another-host") as s:
        assert s.open() == "rdma"
        batches = [s.sample(32) for _ in range(4)]
        assert all(b.plane == "rdma" for b in batches)
        assert sum(check_batch(b) for b in batches) == 128
        ref = d.tables["t"]
        obs = batches[0].columns[1]
        for i, key in enumerate(batches[0].keys.tolist()):
            slot = int(np.flatnonzero(ref.meta.key == key)[0])
            stored = ref.layout().column_view(ref.segment.buffer, 1)[slot, :64]
            assert np.array_equal(obs[i, :64], stored)  # the bytes the NIC read are the table's


def test_pipelined_rdma_batches_under_inserts_are_never_torn(hardware_daemon):
    d = hardware_daemon
    with PlaneSampler(d.address(), "t", planes=["rdma"], host_id="learner-on-another-host") as s:
        seen = 0
        for n, batch in enumerate(s.batches(16)):
            seen += check_batch(batch)
            fill(d.tables["t"], 4, start=1000 + 4 * n, length=64, dim=1024)  # evictions while reading
            if n == 20:
                break
        assert seen == 16 * 21
