"""The one retry loop, and the one opening of a single-phase call.

`retry_on_oom` is the path every out-of-memory error takes, in `fit`,
`evaluate`, `predict` and the trials of `find_max_batch_size`: the attempt
fails, `memory.is_oom_error` tells a failed allocation from anything else,
the caller's size policy halves the failed phase's batch (or gives up with
`OutOfMemoryError`), the model lets go of what the attempt held, and the
caller recovers. `SinglePhase` is what `evaluate` and `predict` share
around it: their checks, sizes, planner and measurements.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import keras

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._per_step_variables import without_per_step_variables
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe._sources import source_for
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.recovery._planner import SizePlanner
from tfmemsafe.recovery._policy import SizeDecision
from tfmemsafe.recovery._policy import SizePolicy

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
    (`ModelUnusableError`, see `_refuse_xla_on_cpu`). Attempts and
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
            (`SizePolicy.halve`), or raises to give up (chained from the
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
                _refuse_xla_on_cpu(model, err)
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


def _refuse_xla_on_cpu(model: keras.Model, err: Exception) -> None:
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
    # Keras' cached validation iterator; Keras has no public way to drop it.
    model._eval_epoch_iterator = None
    gc.collect()


class SinglePhase:
    """One `evaluate` or `predict` call: its data, sizes and planner.

    Args:
        phase: str. `"evaluation"` or `"prediction"`.
        caller: str. The public function, for messages.
        model: The `keras.Model`.
        data: The user's data.
        batch_size: int or `None`. The batch size to start at.
        min_batch_size, max_retries, memory_estimate: As the caller takes
            them; checked here.
        labelled: bool. Whether arrays come as `(x, y[, sample_weight])`.
    """

    def __init__(
        self,
        phase: str,
        caller: str,
        model: keras.Model,
        data,
        *,
        batch_size,
        min_batch_size,
        max_retries,
        memory_estimate,
        labelled: bool,
    ):
        _checks.retry_limits(min_batch_size, max_retries)
        self.phase = phase
        self.caller = caller
        self.model = model
        self.source = source_for(
            data,
            "data",
            labelled=labelled,
            strategy=model.distribute_strategy,
        )
        self.source.sample_signature()  # Now, not while memory is full.
        size = self.source.resolve_batch_size(batch_size)
        _checks.start_sizes(min_batch_size, batch_size=size)
        self.policy = SizePolicy(
            model,
            {phase: size},
            min_batch_size=min_batch_size,
            max_retries=max_retries,
        )
        self.planner = SizePlanner(
            model,
            caller,
            memory_estimate=_checks.boolean("memory_estimate", memory_estimate),
        )

    @property
    def batch_size(self) -> int:
        return self.policy.batch_size(self.phase)

    def run(
        self,
        attempt: Callable[[], _Result],
        recover: Callable[[SizeDecision], _Result | None],
    ) -> _Result:
        """`retry_on_oom` with this call's sizes; `recover` gets each
        decision (`jump` takes it further) and logs it."""

        def on_oom(err):
            self.planner.record_ran_out(
                self.phase, self.source, self.batch_size
            )
            return self.policy.halve(self.phase, err)

        result = retry_on_oom(self.model, attempt, on_oom, recover)
        self.planner.record_trained(self.phase, self.source, self.batch_size)
        return result

    def jump(self, decision: SizeDecision) -> SizeDecision:
        """`decision` taken on to the largest halving predicted to fit."""
        return self.policy.jump(decision, self.planner, self.source)
