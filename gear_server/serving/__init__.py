"""The daemon's servicers: Reverb's ReplayService on grpc.aio, and the local lane for same-host clients."""

from gear_server.serving.lane_server import LocalLaneServer
from gear_server.serving.service import ReplayService

__all__ = ["LocalLaneServer", "ReplayService"]
