"""What fits, decided before a run: the memory planner and the batch
size search.

Owns `plan` and `MemoryPlan`: for the model as it is and with its blocks
recomputed (`Checkpointed`), the memory model predicts the step's peak
whole and split into micro-batches; the candidates predicted to fit are
trained for a few steps and the fastest (the simplest of those within
5%) is chosen. Owns `find_max_batch_size` (trials of a few steps, each
put back exactly) and `SizePlanner`, the one rule for what fits that
`tfmemsafe.fit`'s pre-flight check, the search and the planner ask
(measurements first, then the static bound, then the memory estimate).
Inside: the model that shares the user's layers with its blocks
checkpointed, the measurement of one candidate, the plan's table, and
the search's retry loop.
"""

from tfmemsafe.planning._batch_search import find_max_batch_size
from tfmemsafe.planning._memory_plan import Candidate
from tfmemsafe.planning._memory_plan import MemoryPlan
from tfmemsafe.planning._plan import plan
from tfmemsafe.planning._plan import to_follow
from tfmemsafe.planning._size_planner import SizePlanner

__all__ = [
    "Candidate",
    "MemoryPlan",
    "SizePlanner",
    "find_max_batch_size",
    "plan",
    "to_follow",
]
