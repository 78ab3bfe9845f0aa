"""The retry loop of `find_max_batch_size`'s trials, and what every
out-of-memory error is checked for first.

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
from tfmemsafe.errors import OutOfMemoryError

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


class ModelUnusableError(OutOfMemoryError):
    """The `OutOfMemoryError` after which the model must not be touched.

    Callers that put a model back after a failure (`find_max_batch_size`'s
    trials) skip that for this error.
    """


def refuse_xla_on_cpu(model: keras.Model, err: Exception) -> None:
    """Raises `ModelUnusableError` if `err` came from XLA on the CPU.

    An allocation that fails inside a step compiled by XLA for the CPU
    leaves TensorFlow's CPU allocator inconsistent (TensorFlow 2.21:
    "Check failed: h != kInvalidChunkHandle" in bfc_allocator.cc when a
    buffer is freed later): the next use of the model's variables, or the
    process's exit, aborts it. Nothing can be put back or retried in this
    process, so nothing is tried: the error says why and what to do. On a
    GPU, XLA reports a failed allocation as an ordinary error and the run
    recovers as any other.
    """
    if getattr(model, "jit_compile", False) is not True:
        return
    with model.distribute_strategy.scope():
        devices = memory.default_devices()
    if any(not device.startswith("CPU") for device in devices):
        return
    raise ModelUnusableError(
        "Out of memory in a step compiled with XLA (`jit_compile=True`) "
        "on the CPU. TensorFlow cannot go on in this process after that: "
        "its CPU allocator is left inconsistent, and the next use of the "
        "model or the end of the process aborts it, so tfmemsafe does not "
        "retry and the model is not put back. Instead, restart the process "
        "and compile with `jit_compile=False` (then an out-of-memory error "
        "is recovered in the process), or train at a smaller batch size "
        "(`tfmemsafe.find_max_batch_size` on the model compiled without "
        "XLA finds one)."
    ) from err


def release(model: keras.Model) -> None:
    """Drops what a failed attempt may hold, so its memory can be reused.

    The traced train, test and predict functions stay: a failed call
    leaves nothing in them (every call that tfmemsafe retries runs
    `without_per_step_variables`), they trace the new shapes as they
    come, and a size that grows back finds its trace.
    """
    _compat.drop_cached_validation_iterator(model)
    gc.collect()
