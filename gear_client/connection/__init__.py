"""How a client reaches a daemon: its channel (bounded waits, clear errors), credentials, the local lane."""

from gear_client.connection.auth import ChannelSecurity
from gear_client.connection.channel import DaemonChannel, check_address
from gear_client.connection.lane_client import LaneBroken, LocalLane, open_local_lane

__all__ = ["ChannelSecurity", "DaemonChannel", "LaneBroken", "LocalLane", "check_address", "open_local_lane"]
