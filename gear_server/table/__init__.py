"""A replay table: items in a shared-memory segment, selectors, rate limiter, leases and snapshots.

``Table`` is the facade with Reverb's semantics; the modules beside it are its
parts (``slots``, ``columns``, ``side_store``, ``rate_limiter``, ``selectors``)
and its paths (``insert``, ``reserve``, ``sample``, ``picks``, ``read_groups``,
``fitting``, ``snapshot``), each over the ``TableCore`` its facade owns.
"""

from gear_server.table.items import BadRequest, ItemToInsert
from gear_server.table.rate_limiter import RateLimiter
from gear_server.table.sample import Selection
from gear_server.table.snapshot import TableSnapshot
from gear_server.table.table import Table

__all__ = ["BadRequest", "ItemToInsert", "RateLimiter", "Selection", "Table", "TableSnapshot"]
