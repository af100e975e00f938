"""The daemon's side of the learner data planes: negotiation, sessions and leases, RDMA resources."""
