"""Writers: Reverb's TrajectoryWriter, legacy Writer and StructuredWriter, and the parts under them.

``step_layout``, ``column_buffer`` and ``trajectory_column`` keep appended steps;
``chunker`` cuts them into chunks; ``insert_stream`` (over gRPC) and ``routes``
(the same-host insert plane) carry chunks and items to the daemon.
"""

from gear_client.writers.legacy_writer import Writer
from gear_client.writers.structured_writer import StructuredWriter
from gear_client.writers.trajectory_column import TrajectoryColumn
from gear_client.writers.trajectory_writer import TrajectoryWriter

__all__ = ["StructuredWriter", "TrajectoryColumn", "TrajectoryWriter", "Writer"]
