"""Generated control-plane modules (see tools/gen_protos.py); do not edit the *_pb2 files."""

from . import replay_pb2, replay_pb2_grpc

__all__ = ["replay_pb2", "replay_pb2_grpc"]
