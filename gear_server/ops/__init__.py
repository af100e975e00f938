"""What operators see and control: metrics, authentication, health, logs and systemd notifications."""

from gear_server.ops.auth import AuthSettings, TokenCheck
from gear_server.ops.health import Health
from gear_server.ops.logs import LoggingSettings, configure_logging
from gear_server.ops.metrics import MetricsServer, MetricsSettings, ServerMetrics

__all__ = ["AuthSettings", "Health", "LoggingSettings", "MetricsServer", "MetricsSettings", "ServerMetrics",
           "TokenCheck", "configure_logging"]
