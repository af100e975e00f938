"""What every RPC of the daemon shares: table work off the loop, statuses, limits, interceptors, ports.

The replay service, the data-plane manager, the insert plane and the ingest
workers all serve through these, so a table error, a limit and an unparsable
request mean the same thing whichever RPC met them.
"""

from gear_server.rpc.event_loop import LoopThread, new_event_loop
from gear_server.rpc.interceptors import CallGuard, RpcObserver
from gear_server.rpc.limits import ByteBudget, LimitSettings
from gear_server.rpc.ports import GRPC_OPTIONS, bind
from gear_server.rpc.statuses import LimitExceeded, RefusalLog, abort_for, status_of
from gear_server.rpc.table_calls import TableCalls

__all__ = ["GRPC_OPTIONS", "ByteBudget", "CallGuard", "LimitExceeded", "LimitSettings", "LoopThread", "RefusalLog",
           "RpcObserver", "TableCalls", "abort_for", "bind", "new_event_loop", "status_of"]
