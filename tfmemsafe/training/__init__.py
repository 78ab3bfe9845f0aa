"""`tfmemsafe.fit`, `evaluate` and `predict`: Keras' own calls with
`SplitBatchOnOOM`, and what needs a view wider than one batch.

Owns the arguments and data kinds of `model.fit` taken as `model.fit`
takes them, the pre-flight estimate that chooses the micro-batches a run
starts at, `batch_size="auto"` (a size searched for, or length buckets),
following a `MemoryPlan`, and the run's events in one `FitHistory`. The
decisions come from `planning` (what fits) and the recovery inside the
step from `recovery`; this package composes them and records what
happened.
"""

from tfmemsafe.training._evaluate import evaluate
from tfmemsafe.training._evaluate import predict
from tfmemsafe.training._fit import fit

__all__ = [
    "evaluate",
    "fit",
    "predict",
]
