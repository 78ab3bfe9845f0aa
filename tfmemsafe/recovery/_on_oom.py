"""`SplitBatchOnOOM`: the Keras callback that recovers inside the step."""

from __future__ import annotations

import weakref

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import distribute
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe._model_state import optimizers_of
from tfmemsafe._per_step_variables import without_per_step_variables
from tfmemsafe._step_guard import StepGuard
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.recovery._exact_split import keras_step
from tfmemsafe.recovery._held_step import HeldSteps

# The callback whose held functions a model has now.
_OWNERS = weakref.WeakKeyDictionary()


class SplitBatchOnOOM(keras.callbacks.Callback):
    """Trains a batch that ran out of memory again as micro-batches.

    Add it to the `callbacks` of `model.fit` (or `evaluate`, `predict`);
    nothing else changes. Each step's batch is read from Keras' iterator
    and held. When the step raises an out-of-memory error
    (`tfmemsafe.is_oom_error`), the same batch is trained again as
    micro-batches whose gradients, weighted by their rows, make one
    update: the update the whole batch would have made, to rounding. The
    batch size, the data pipeline and the epoch are untouched: nothing is
    replayed or skipped, and callbacks see each batch once, in order.

    How small the micro-batches are comes from measurement: the step's
    peak memory per row (on a device that keeps memory statistics) and
    what is in use now predict the largest micro-batch that leaves 10% of
    the limit free, so a batch 8 times too large costs one error, not
    three; with nothing measured yet the first micro-batch is a small
    probe that sizes the rest; each phase and each shape of an example
    (length buckets' batches) has its own size. After `grow_back_after`
    clean steps the micro-batches double, unless the measured peak
    predicts that the double does not fit beside what is held now; a
    grow-back to a size that ran out beside as much memory doubles the
    clean steps before the next.

    Exactly split: Keras' own `train_step` (and `AccumulatingModel`'s,
    whose window counts a split batch once), on one device or under a
    `MirroredStrategy` or `MultiWorkerMirroredStrategy`, with every loss
    averaging over the batch's rows (the default reduction
    `"sum_over_batch_size"`, or `"mean"`),
    `sample_weight` and `class_weight` included. Not split, and stopped
    with `tfmemsafe.OutOfMemoryError` saying why: a loss with reduction
    `"sum"`, `None` or `"mean_with_sample_weight"` with sample weights,
    outputs with a mask, an overridden `compute_loss`, `run_eagerly=True`,
    and a `BatchNormalization` that trains (it normalizes each batch by
    the batch's own statistics) unless `split_batch_norm=True`.
    A batch of a model with its own `train_step` (a GAN) that runs out is
    split as calls of that step on the micro-batches, each making its own
    update, as halving the batch would. Evaluation sums its metrics over
    the micro-batches; prediction joins their outputs.

    Under a `MultiWorkerMirroredStrategy` it splits training only (Keras'
    own `train_step` or `AccumulatingModel`'s): each worker's part of a
    step finishes before the update's all-reduce begins, the workers then
    agree whether any ran out, and every worker splits the batch into the
    same micro-batches (the fewest rows any worker's measurement asks
    for). Its evaluation is Keras' own.

    An error inside the optimizer's update itself (after every gradient
    exists) is not retried: the weights may be partly updated, and
    `tfmemsafe.OutOfMemoryError` says so. A micro-batch of one example
    that runs out raises it too.

    Args:
        grow_back_after: int or `None`. Clean steps before the
            micro-batches double; `None` never. Defaults to `100`.
        split_batch_norm: bool. Whether to split a batch of a model whose
            `BatchNormalization` layers train: each micro-batch is then
            normalized by its own statistics and updates the moving ones,
            as under any gradient accumulation, so the update is close to
            the whole batch's but not the same. Defaults to `False`.
        micro_batch_size: int or `None`. The rows of each training
            micro-batch from the first step, of the (global) batch as
            `batch_size` counts it (under a `tf.distribute` strategy,
            each replica trains its share of each micro-batch): a batch
            known not to fit (`tfmemsafe.fit`'s pre-flight estimate and a
            `tfmemsafe.MemoryPlan` set it) is split from the start, and
            grows back as above; where that is not exact (the refusals
            above, or a model's own `train_step`), whole batches are
            trained, with a warning. Defaults to `None`: whole batches until
            one runs out.
        min_micro_batch_size: int. The fewest rows a micro-batch may
            have, counted as `micro_batch_size` counts them, and at most
            it; a micro-batch of that many that runs out raises
            `tfmemsafe.OutOfMemoryError`. Defaults to `1`.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from before raising `tfmemsafe.OutOfMemoryError`.
            Defaults to `None`: no limit.

    Attributes:
        oom_events: list of `tfmemsafe.OOMEvent`, one per error recovered
            from in the last `fit`, `evaluate` or `predict` call.
        grow_back_events: list of `tfmemsafe.GrowBackEvent`, as those.

    Example:
    >>> model.fit(
    ...     x, y, batch_size=512, epochs=3,
    ...     callbacks=[tfmemsafe.SplitBatchOnOOM()],
    ... )
    """

    def __init__(
        self,
        grow_back_after: int | None = 100,
        split_batch_norm: bool = False,
        *,
        micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
        max_retries: int | None = None,
    ):
        super().__init__()
        for name, value in (
            ("grow_back_after", grow_back_after),
            ("micro_batch_size", micro_batch_size),
            ("max_retries", max_retries),
        ):
            if value is not None:
                _checks.integer(name, value, 1 if name != "max_retries" else 0)
        self.grow_back_after = _whole(grow_back_after)
        self.split_batch_norm = _checks.boolean(
            "split_batch_norm", split_batch_norm
        )
        self.micro_batch_size = _whole(micro_batch_size)
        self.min_micro_batch_size = _checks.integer(
            "min_micro_batch_size", min_micro_batch_size, 1
        )
        if (
            self.micro_batch_size is not None
            and self.min_micro_batch_size > self.micro_batch_size
        ):
            raise ValueError(
                "`min_micro_batch_size` must be <= `micro_batch_size`, the "
                "micro-batch size to start at. Received: "
                f"min_micro_batch_size={self.min_micro_batch_size}, "
                f"micro_batch_size={self.micro_batch_size}"
            )
        self.max_retries = _whole(max_retries)
        self.oom_events = []
        self.grow_back_events = []
        self._held = None
        self._guard = None
        self._keras_functions = {}
        self._phases = []  # The open phases, outermost first.
        # Whether Keras began a batch of this callback's loop since the
        # last call of a held function.
        self._batch_began = False

    # Installing and removing.

    def _begin(self, phase: str) -> None:
        """Holds the batches of `phase` (`"train"`, `"test"` or
        `"predict"`), opening the run at its outermost phase."""
        if not self._phases:
            self._open()
        self._phases.append(phase)
        if self._held is None or (
            phase != "train"
            and distribute.is_multi_worker(self.model.distribute_strategy)
        ):
            # A worker's evaluation has no step to agree in.
            return
        name = f"{phase}_function"
        self._keras_functions[name] = getattr(self.model, name)
        setattr(self.model, name, self._closing_on_error(phase))
        self._held.record.in_fit = "train" in self._phases

    def _end(self, phase: str) -> None:
        if not self._phases or self._phases[-1] != phase:
            return
        self._phases.pop()
        name = f"{phase}_function"
        if name in self._keras_functions:
            setattr(self.model, name, self._keras_functions.pop(name))
        if not self._phases:
            self._close()

    def _open(self) -> None:
        model = self.model
        if self._workers_cannot_agree(model):
            logging.warning(
                "SplitBatchOnOOM does nothing here: under a multi-worker "
                "strategy it splits only Keras' own `train_step` (or "
                "`AccumulatingModel`'s), whose update can wait until every "
                "worker's part has finished."
            )
            return
        stale = _OWNERS.get(model)
        if stale is not None:
            stale._reset()  # An error outside its functions ended its run.
        if StepGuard.installed_on(model):
            raise ValueError(
                "SplitBatchOnOOM is already part of `tfmemsafe.fit`; pass "
                "it to `model.fit`, or leave it out of `callbacks`."
            )
        self.oom_events = []
        self.grow_back_events = []
        training = getattr(model, "optimizer", None) is not None
        self._guard = StepGuard(
            model,
            optimizers_of(model) if training else [],
            gradient_accumulators_of(model) if training else [],
        )
        self._held = HeldSteps(
            model,
            self._guard,
            self.grow_back_after,
            self.split_batch_norm,
            micro_batch_size=_per_replica(
                self.micro_batch_size,
                model.distribute_strategy.num_replicas_in_sync,
            ),
            min_micro_batch_size=_per_replica(
                self.min_micro_batch_size,
                model.distribute_strategy.num_replicas_in_sync,
            ),
            max_retries=self.max_retries,
        )
        _OWNERS[model] = self

    def _close(self) -> None:
        if _OWNERS.get(self.model) is self:
            del _OWNERS[self.model]
        if self._held is not None:
            self.oom_events = self._held.record.oom_events
            self.grow_back_events = self._held.record.grow_back_events
            self._held.close()
        if self._guard is not None:
            self._guard.close()
        self._held = self._guard = None
        for name, function in self._keras_functions.items():
            setattr(self.model, name, function)
        self._keras_functions = {}

    def _closing_on_error(self, phase: str):
        """The held `phase` function; an error out of it (past which Keras
        calls no `on_*_end`) puts Keras' functions and the optimizers
        back first. The end of the data is no error: Keras' loop stops
        there. Called by a loop this callback is not in (a run that an
        error outside it ended left it in place), it puts Keras' back and
        hands over to Keras' own."""
        function = getattr(self._held, phase)

        def held(data):
            if not self._batch_began:
                self._reset()
                getattr(self.model, f"make_{phase}_function")(force=True)
                return getattr(self.model, f"{phase}_function")(data)
            self._batch_began = False
            try:
                # A step that runs out must not leave Grappler's temporary
                # variable behind for its retry (`_per_step_variables`).
                with without_per_step_variables():
                    return function(data)
            except (StopIteration, tf.errors.OutOfRangeError):
                raise
            except OutOfMemoryError as err:
                # Keras re-raises it `from None`: the cause stays here.
                err.error = err.error or err.__cause__
                self._reset()
                raise
            except BaseException:
                self._reset()
                raise

        return held

    # Keras' hooks.

    def on_train_begin(self, logs=None):
        # A run that an error ended left its functions in place.
        self._reset()
        self._begin("train")

    def on_train_end(self, logs=None):
        self._end("train")

    def on_test_begin(self, logs=None):
        self._begin("test")

    def on_test_end(self, logs=None):
        self._end("test")

    def on_predict_begin(self, logs=None):
        self._begin("predict")

    def on_predict_end(self, logs=None):
        self._end("predict")

    def on_epoch_begin(self, epoch, logs=None):
        if self._held is not None:
            self._held.record.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_began = True
        if self._held is not None:
            self._held.record.step = batch

    on_test_batch_begin = on_predict_batch_begin = on_train_batch_begin

    @staticmethod
    def _workers_cannot_agree(model) -> bool:
        return distribute.is_multi_worker(
            model.distribute_strategy
        ) and not keras_step(model)

    def _reset(self) -> None:
        """Closes a run an error ended (Keras calls no `on_*_end` then)."""
        if self._phases:
            self._phases = []
            self._close()


def _whole(value):
    return None if value is None else int(value)


def _per_replica(rows: int | None, replicas: int) -> int | None:
    """Each replica's rows of a micro-batch of `rows` global rows (the
    held step sizes micro-batches in a replica's share)."""
    return None if rows is None else -(-rows // replicas)
