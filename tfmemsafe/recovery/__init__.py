"""Training, evaluation and prediction that survive running out of memory.

Owns `fit`, `evaluate`, `predict` and `find_max_batch_size`. Inside, one
room per decision: the size policy (the batch sizes of each phase, the
retry budget, the accumulation that keeps the effective batch), the
planner (the one rule for what fits, from measurements and the memory
estimate), where a run resumes, the step guard (what a failed step can
have changed), when a shrunk batch grows back, the split of one
bucketed batch that ran out into micro-batches of one update, the one
retry loop, and the runner that applies the decisions, logs them and
records each `OOMEvent`. docs/architecture.md draws them.
"""

from tfmemsafe.recovery._batch_search import find_max_batch_size
from tfmemsafe.recovery._evaluate import evaluate
from tfmemsafe.recovery._evaluate import predict
from tfmemsafe.recovery._fit import fit
from tfmemsafe.recovery._on_oom import SplitBatchOnOOM

__all__ = [
    "SplitBatchOnOOM",
    "evaluate",
    "find_max_batch_size",
    "fit",
    "predict",
]
