"""Rate limiters (`reverb.rate_limiters`): how samples and inserts are kept in ratio.

The option objects validate their arguments exactly as Reverb does (same
ValueErrors) and become a ``gear.v1.RateLimiterOptions`` with ``to_proto()``;
the daemon enforces them (gear_server/table/rate_limiter.py).
"""

from __future__ import annotations

import logging
import math
import sys

from gear_contract._proto import replay_pb2 as pb

__all__ = ["RateLimiter", "MinSize", "SampleToInsertRatio", "Queue", "Stack", "from_proto"]

_log = logging.getLogger(__name__)


class RateLimiter:
    """Blocks inserts and samples to keep ``inserts * samples_per_insert - samples`` in [min_diff, max_diff].

    Sampling is also blocked while the table holds fewer than ``min_size_to_sample`` items.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float):
        for name, value in (("samples_per_insert", samples_per_insert), ("min_diff", min_diff),
                            ("max_diff", max_diff)):
            if math.isnan(float(value)):
                raise ValueError(f"{name} must be a number, got NaN")
        if int(min_size_to_sample) < 1:
            # Reverb's C++ RateLimiter aborts the process here; we refuse it instead.
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be a positive integer")
        self._samples_per_insert = float(samples_per_insert)
        self._min_size_to_sample = int(min_size_to_sample)
        self._min_diff = float(min_diff)
        self._max_diff = float(max_diff)

    @property
    def samples_per_insert(self) -> float:
        return self._samples_per_insert

    @property
    def min_size_to_sample(self) -> int:
        return self._min_size_to_sample

    @property
    def min_diff(self) -> float:
        return self._min_diff

    @property
    def max_diff(self) -> float:
        return self._max_diff

    def to_proto(self) -> pb.RateLimiterOptions:
        return pb.RateLimiterOptions(samples_per_insert=self._samples_per_insert,
                                     min_size_to_sample=self._min_size_to_sample,
                                     min_diff=self._min_diff, max_diff=self._max_diff)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RateLimiter) and other.to_proto() == self.to_proto()

    def __hash__(self) -> int:
        return hash((self._samples_per_insert, self._min_size_to_sample, self._min_diff, self._max_diff))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(samples_per_insert={self._samples_per_insert}, "
                f"min_size_to_sample={self._min_size_to_sample}, min_diff={self._min_diff}, "
                f"max_diff={self._max_diff})")


class MinSize(RateLimiter):
    """Blocks sampling until the table holds ``min_size_to_sample`` items; never blocks inserts."""

    def __init__(self, min_size_to_sample: int):
        if min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be a positive integer")
        super().__init__(samples_per_insert=1.0, min_size_to_sample=min_size_to_sample,
                         min_diff=-sys.float_info.max, max_diff=sys.float_info.max)


class SampleToInsertRatio(RateLimiter):
    """Keeps the ratio of samples to inserts near ``samples_per_insert`` once ``min_size_to_sample`` is reached.

    ``error_buffer`` as a number: the allowed diff is ``spi * min_size_to_sample ± error_buffer``;
    as a ``(min_diff, max_diff)`` pair: used as is.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int,
                 error_buffer: float | tuple[float, float]):
        if samples_per_insert <= 0:
            raise ValueError(f"samples_per_insert ({samples_per_insert}) must be a positive number")
        if isinstance(error_buffer, (int, float)):
            offset = samples_per_insert * min_size_to_sample
            min_diff = offset - error_buffer
            max_diff = offset + error_buffer
        else:
            min_diff, max_diff = error_buffer
        if max_diff - min_diff < 2 * max(1.0, samples_per_insert):
            raise ValueError(
                "The size of error_buffer must be >= max(1.0, samples_per_insert) as smaller values could "
                "completely block samples and/or insert calls.")
        if max_diff < samples_per_insert * min_size_to_sample:
            _log.warning(
                "The range covered by error_buffer is below samples_per_insert * min_size_to_sample. If the "
                "sampler cannot sample concurrently, this will result in a deadlock as soon as "
                "min_size_to_sample items have been inserted.")
        if min_diff > samples_per_insert * min_size_to_sample:
            raise ValueError(
                "The range covered by error_buffer is above samples_per_insert * min_size_to_sample. This will "
                "result in a deadlock as soon as min_size_to_sample items have been inserted.")
        if min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample ({min_size_to_sample}) must be a positive integer")
        super().__init__(samples_per_insert=samples_per_insert, min_size_to_sample=min_size_to_sample,
                         min_diff=min_diff, max_diff=max_diff)


class Queue(RateLimiter):
    """Makes a Fifo table behave as a queue of ``size`` items (use ``Table.queue``)."""

    def __init__(self, size: int):
        super().__init__(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=size)


class Stack(RateLimiter):
    """Makes a Lifo table behave as a stack of ``size`` items (use ``Table.stack``)."""

    def __init__(self, size: int):
        super().__init__(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=size)


def from_proto(options: pb.RateLimiterOptions) -> RateLimiter:
    """The rate limiter a ``RateLimiterOptions`` message describes (validated)."""
    return RateLimiter(options.samples_per_insert, options.min_size_to_sample, options.min_diff, options.max_diff)
