"""Whether a learner may select batches before it is asked for them: the table's sampling semantics decide.

Selecting ahead (Selects sent before the learner wants their batches, batches
held in a prefetch queue) hides the round trip, but every item selected ahead is
taken from the table then, not when the learner gets it. That is harmless only
where taking an item changes nothing another sample would see:

* ``max_times_sampled`` > 0 (a ``Table.queue``, IMPALA/PPO learners): a pick
  can remove the item; items selected ahead and never delivered (the learner
  stops, or closes its dataset) are lost.
* a rate limiter that holds samples back (``SampleToInsertRatio``,
  ``Queue``: a finite ``min_diff``, DQN/R2D2 learners): each pick spends the
  samples the inserts allowed; picks made ahead spend them before the learner
  trains on anything, and a pipeline waiting for several batches' worth would
  stall with every allowed sample spent and nothing delivered.

Uniform, prioritized, FIFO... tables without ``max_times_sampled`` and with a
``MinSize`` limiter (``min_diff`` unbounded below) may be read ahead: a pick
there takes nothing away.
"""

from __future__ import annotations

import sys

from gear_contract._proto import replay_pb2 as pb

# min_diff at or below this is no limit on sampling (MinSize uses -sys.float_info.max).
UNBOUNDED_DIFF = -sys.float_info.max / 2


def sampling_takes(info: pb.TableInfo) -> str | None:
    """Why sampling ``info``'s table takes something from it (a sentence), or None when it takes nothing."""
    if info.max_times_sampled > 0:
        return f"items leave table '{info.name}' after {info.max_times_sampled} sample(s)"
    limiter = info.rate_limiter_info
    if info.HasField("rate_limiter_info") and limiter.min_diff > UNBOUNDED_DIFF:
        return (f"the rate limiter of table '{info.name}' allows samples only as inserts come "
                f"(samples_per_insert={limiter.samples_per_insert:g}, min_diff={limiter.min_diff:g})")
    return None


def may_read_ahead(info: pb.TableInfo) -> bool:
    """Whether batches of ``info``'s table may be selected before the learner asks for them."""
    return sampling_takes(info) is None
