"""The retry loop of `find_max_batch_size`'s trials.

`retry_on_oom`: the attempt fails, `memory.is_oom_error` tells a failed
allocation from anything else, the caller decides (or gives up with
`OutOfMemoryError`), the model lets go of what the attempt held, and the
caller recovers. `refuse_xla_on_cpu` stops where nothing may be retried.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import keras

from tfmemsafe import _compat
from tfmemsafe import memory
from tfmemsafe._per_step_variables import without_per_step_variables
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe._unrecoverable import refuse_xla_on_cpu

_Result = TypeVar("_Result")
_Failure = TypeVar("_Failure")


def retry_on_oom(
    model: keras.Model,
    attempt: Callable[[], _Result],
    on_oom: Callable[[Exception], _Failure],
    recover: Callable[[_Failure], _Result | None],
) -> _Result:
    """Runs `attempt()` until it returns, recovering from each OOM.

    Any error that `memory.is_oom_error` does not recognise, and
    `KeyboardInterrupt`, propagates at once, unchanged. An out-of-memory
    error of a model compiled with XLA on the CPU is not retried
    (`ModelUnusableError`, see `refuse_xla_on_cpu`). Attempts and
    recoveries run without Grappler's `AddN` rewrite, whose leftovers
    would make every attempt after a failed one fail
    (`without_per_step_variables`), and without the batch Keras reads
    and drops at each call of a built model under a strategy
    (`without_sample_batch`).

    Args:
        model: keras.Model. The model trained: what a failed attempt
            leaves in it is released after each failure (`release`).
        attempt: Callable. One try of the job; its result is returned.
        on_oom: Callable. Called with the out-of-memory error, inside the
            `except` block: halves the batch of the phase that failed
            or raises to give up (chained from the
            error). What it returns goes to `recover`.
        recover: Callable. Called out of the `except` block, once the
            failed attempt's frames and the tensors they held can be
            freed, and after `release(model)`: makes ready for the next
            attempt and logs. Returns `None` to try again, or a result to
            return instead.

    Returns:
        The result of the first attempt that finished, or of `recover`.
    """
    # A failed attempt must not break the next (`_per_step_variables`),
    # nor may a new call drop a sample batch's iterator (`_sample_batch`).
    with without_per_step_variables(), without_sample_batch(model):
        while True:
            try:
                return attempt()
            except Exception as err:
                if not memory.is_oom_error(err):
                    raise
                refuse_xla_on_cpu(model, err)
                failure = on_oom(err)
            release(model)
            result = recover(failure)
            if result is not None:
                return result


def release(model: keras.Model) -> None:
    """Drops what a failed attempt may hold, so its memory can be reused.

    The traced train, test and predict functions stay: a failed call
    leaves nothing in them (every call that tfmemsafe retries runs
    `without_per_step_variables`), they trace the new shapes as they
    come, and a size that grows back finds its trace.
    """
    _compat.drop_cached_validation_iterator(model)
    gc.collect()
