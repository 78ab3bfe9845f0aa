"""The memory planner: how to train a batch in the memory there is.

Owns `plan` and `MemoryPlan`: for the model as it is and with its blocks
recomputed (`Checkpointed`), the memory model predicts the step's peak
whole and split into micro-batches; the candidates predicted to fit are
trained for a few steps and the fastest (the simplest of those within
5%) is chosen. Inside: the model that shares the user's layers with its
blocks checkpointed, the measurement of one candidate, and the plan's
table.
"""

from tfmemsafe.planning._memory_plan import Candidate
from tfmemsafe.planning._memory_plan import MemoryPlan
from tfmemsafe.planning._plan import plan
from tfmemsafe.planning._plan import to_follow  # noqa: F401 (`fit`'s)

__all__ = ["Candidate", "MemoryPlan", "plan"]
