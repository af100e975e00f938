"""gear daemon: sharded host-memory replay tables served over gRPC."""

__version__ = "0.1.0"
