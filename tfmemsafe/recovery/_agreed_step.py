"""A training step whose out-of-memory error every worker learns of.

Under a `MultiWorkerMirroredStrategy` Keras' step computes a worker's
gradients and all-reduces them in one function. A worker that runs out of
memory in its forward or backward pass leaves the others waiting in that
all-reduce; the error aborts the job's collectives, which TensorFlow
cannot run again in that process, so every worker has to stop.

`AgreedStep` runs the same step as two functions instead:

1. the worker's own part: forward, backward, metrics, with the update
   held back (`StepGuard.deferring`), so no collective at all: an
   out-of-memory error here is this worker's alone, and is caught;
2. `agree`: every worker says whether its part finished, in one
   all-reduce of two numbers per replica. If any did not, every worker
   raises at the same step with nothing changed (the one that ran out its
   own error, the others "Worker k of n ran out of memory"), and
   `tfmemsafe.fit` splits that batch the same way on every worker
   (`SplitBatch`, which agrees the same way before its one update);
3. the update: the gradients' all-reduce and the optimizer's step, as in
   Keras' own step, and the logs averaged over the replicas as Keras
   averages them.

The gradients pass from the first function to the last as they are (no
copy), and `StepGuard` already makes an update wait for the whole
backward pass. What it adds to a step, whatever the model's size: the
batch read outside the compiled step, the two-number all-reduce on the
host between the two functions (the device idles meanwhile), and a
second function call.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from tfmemsafe import _agreement
from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe.accumulation import accumulation_steps_of
from tfmemsafe.accumulation import window_closes_by_size


class AgreedStep:
    """A model's training step as a worker's part, an agreement and the
    update; installed as the model's `train_function` for one run.

    Args:
        model: The `keras.Model`, under a `MultiWorkerMirroredStrategy`,
            whose step is Keras' or `AccumulatingModel`'s.
        guard: The run's `StepGuard` (it holds the update back).
    """

    def __init__(self, model, guard):
        self.model = model
        self.guard = guard
        self.strategy = model.distribute_strategy
        # While the worker's part is traced, per replica: the update it
        # asked for.
        self._traced = threading.local()
        # From the last trace: `(owner, name, variables, present,
        # has_count, has_size)`, where `present` indexes the variables
        # with a gradient; `None` if the step made no update.
        self._plan = None
        self._own_part = tf.function(
            self._run_own_part,
            autograph=False,  # As Keras compiles its step.
            reduce_retracing=True,
            jit_compile=model.jit_compile is True,
        )
        self._update = tf.function(
            self._run_update, autograph=False, reduce_retracing=True
        )

    def __call__(self, iterator):
        """One step on the next batch of `iterator` (Keras' fit loop calls
        it as it calls its own `train_function`)."""
        failure = None
        try:
            # The end of the data comes on every worker at the same step
            # (the strategy's iterator agrees on it), and is agreed on here
            # as any other error.
            data = next(iterator)
            with self.guard.deferring(update_name(self.model), self._capture):
                logs, update = self._own_part(data)
        except Exception as err:  # Told to every worker, then raised.
            failure = err
        agree(self.strategy, failure)
        return self._update(logs, update)

    def _run_own_part(self, data):
        return self.strategy.run(self._own_part_on_replica, args=(data,))

    def _own_part_on_replica(self, data):
        self._traced.update = None
        logs = self.model.train_step(data)
        if self._traced.update is None:  # No trainable weights.
            self._plan = None
            return logs, ()
        owner, name, variables, gradients, count, size = self._traced.update
        present = [i for i, g in enumerate(gradients) if g is not None]
        self._plan = (
            owner,
            name,
            variables,
            present,
            count is not None,
            size is not None,
        )
        zero = tf.constant(0.0)
        return logs, (
            [gradients[i] for i in present],
            zero if count is None else count,
            zero if size is None else size,
        )

    def _capture(
        self,
        owner,
        name,
        gradients,
        trainable_variables=None,
        sample_count=None,
        size=None,
    ):
        """The update the step asked for, kept for `_run_update`."""
        self._traced.update = (
            owner,
            name,
            updated_variables(self.model, trainable_variables),
            list(gradients),
            sample_count,
            size,
        )

    def _run_update(self, logs, update):
        if self._plan is not None:
            self.strategy.run(self._update_on_replica, args=(update,))
        # Every value, as Keras' `reduce_per_replica` does: with one device
        # a worker, a worker's logs are plain tensors, averaged over the
        # workers all the same.
        return {
            name: self.strategy.reduce(
                tf.distribute.ReduceOp.MEAN, value, axis=None
            )
            for name, value in logs.items()
        }

    def _update_on_replica(self, update):
        owner, name, variables, present, has_count, has_size = self._plan
        gradients, count, size = update
        full = [None] * len(variables)
        for index, gradient in zip(present, gradients, strict=True):
            full[index] = gradient
        if name == "apply":
            owner.apply(full, variables)
            return
        owner.accumulate(
            full,
            variables,
            count if has_count else None,
            size=size if has_size else None,
        )
        owner.apply_if_ready(self.model.optimizer)


def updated_variables(model, trainable_variables) -> list:
    """The variables an `apply` or `accumulate` call updates: those it
    was given, or else the model's trainable ones."""
    if trainable_variables is None:
        return list(model.trainable_variables)
    return list(trainable_variables)


def update_name(model) -> str:
    """The step's update: `"accumulate"` into a window of several
    micro-batches, or `"apply"`."""
    steps = accumulation_steps_of(model) or 1
    if steps > 1 or window_closes_by_size(model):
        return "accumulate"
    return "apply"


def agree(strategy, failure: BaseException | None) -> None:
    """Raises on every worker if any worker's part of a step failed.

    Every worker calls it at the same point, with its own error or `None`.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        failure: This worker's error, or `None` if its part finished.

    Raises:
        If any worker failed otherwise than by running out of memory: this
        worker's own error, or else `RuntimeError`, on every worker (so
        that none goes on to split). Else, if any ran out: this worker's
        own error, as it is, or else
        `tf.errors.ResourceExhaustedError` "Worker k of n ran out of
        memory".
    """
    ran_out = failure is not None and memory.is_oom_error(failure)
    table = _agreement.gathered(
        strategy, [float(ran_out), float(failure is not None and not ran_out)]
    )
    if not table.any():
        return
    # A worker's replicas hold its row, one after another.
    by_worker = table[:: len(strategy.extended.worker_devices)]
    workers = len(by_worker)
    failed = [int(w) for w in by_worker[:, 1].nonzero()[0]]
    if failed:
        if failure is not None and not ran_out:
            raise failure
        raise RuntimeError(
            f"Worker {failed[0]} of {workers} failed in this training step "
            "(its error is in its own log), so every worker stops."
        ) from None  # Not an out-of-memory error: nothing is retried.
    if failure is not None:
        raise failure
    worker = int(by_worker[:, 0].nonzero()[0][0])
    error = tf.errors.ResourceExhaustedError(
        None,
        None,
        f"Worker {worker} of {workers} ran out of memory in this training "
        "step (its error is in its own log)",
    )
    raise error


def agreed_rows(strategy, rows: int | None) -> int | None:
    """The fewest micro-batch rows any worker asked for (`None`, the whole
    batch or none at all, if any asked for `None`), on every worker: each
    measures its own memory, and all must split alike. On one worker,
    `rows`."""
    if not distribute.is_multi_worker(strategy):
        return rows
    fewest = int(
        _agreement.gathered(strategy, [0 if rows is None else rows])[:, 0].min()
    )
    return None if fewest == 0 else fewest


def agreed_sizes(strategy, rows: int, grown: int | None, piece: int):
    """`(rows, grown, piece)` as every worker takes them: the most rows of
    any worker's share (so that all take the whole-batch step or all
    split), the fewest rows to grow back to (`None` if any stays), and
    the fewest rows of a micro-batch."""
    table = _agreement.gathered(strategy, [rows, grown or 0, piece])
    fewest_grown = int(table[:, 1].min())
    return (
        int(table[:, 0].max()),
        fewest_grown or None,
        int(table[:, 2].min()),
    )
