"""Learner data planes: how sampled items' bytes reach a learner.

The learner negotiates over gRPC (``negotiation``) the best plane it shares with
the daemon: ``shm`` (same host: the table segment mapped read-only, gathered by
NumPy or the GPU kernel), ``rdma`` (another host: one-sided RDMA READs through
pyverbs, ``verbs`` being the only module that imports it), ``nixl`` (another
host: the learner's NIXL agent READs the leased windows over UCX, one transfer a
batch), ``stream`` (another host: leased windows sent with sendfile on TCP
connections, received straight into the batch) or ``inline`` (bytes in gRPC
messages). ``PlaneSampler`` does all of it for one table; the datasets and
``Client.sample`` use it.
"""

from gear_client.data_planes.batch import SampledBatch
from gear_client.data_planes.sampler import PlaneSampler, StaleBatchError
from gear_contract.negotiation import INLINE, NIXL, PLANES, RDMA, SHM, STREAM, local_host_id

__all__ = ["INLINE", "NIXL", "PLANES", "RDMA", "SHM", "STREAM", "PlaneSampler", "SampledBatch", "StaleBatchError",
           "local_host_id"]
