"""One `tfmemsafe.fit` call: its settings, its attempts and its recovery.

`run` settles the size to start at and builds a `FitRun`, which trains
epoch by epoch, one `model.fit` call each, so that each epoch can be
given its own data: the epoch's shuffled order of arrays, or, after an
out-of-memory error at step k, the samples from step k on at the new
batch size. The sizes are the `SizePolicy`'s, where to go on is
`Position`'s, what a failed step can have changed is `StepGuard`'s.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _messages
from tfmemsafe import distribute
from tfmemsafe._sources import Arrays
from tfmemsafe._sources import Source
from tfmemsafe._step_guard import StepGuard
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.history import FitHistory
from tfmemsafe.history import OOMEvent
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery import _backup
from tfmemsafe.recovery._grow_back import GrowBack
from tfmemsafe.recovery._grow_back import GrowNow
from tfmemsafe.recovery._grow_back import Growth
from tfmemsafe.recovery._planner import SizePlanner
from tfmemsafe.recovery._policy import TRAINING
from tfmemsafe.recovery._policy import VALIDATION
from tfmemsafe.recovery._policy import SizeDecision
from tfmemsafe.recovery._policy import SizePolicy
from tfmemsafe.recovery._policy import accumulation_steps_of
from tfmemsafe.recovery._policy import window_closes_by_size
from tfmemsafe.recovery._resume import EpochStart
from tfmemsafe.recovery._resume import Position
from tfmemsafe.recovery._resume import ResumableCallbackList
from tfmemsafe.recovery._resume import ResumePoint
from tfmemsafe.recovery._resume import forget_epoch
from tfmemsafe.recovery._retry import release
from tfmemsafe.recovery._retry import retry_on_oom
from tfmemsafe.recovery._settings import FitSettings
from tfmemsafe.recovery._split import SplitBatch


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What an out-of-memory error stopped, noted as it was caught."""

    decision: SizeDecision
    epoch: int
    step: int
    error: str
    update_began: bool
    split: int = 0


class FitRun:
    """One `tfmemsafe.fit` call's attempts, and recovery between them.

    Each epoch is one `model.fit` call (the callbacks see one run), so
    that each epoch can be given its own data: the epoch's shuffled order
    of arrays, or, after an out-of-memory error at step k, the samples
    from step k on at the new batch size. The runner owns no size: it
    asks the `SizePolicy` (which asks the `SizePlanner`), asks `Position`
    where to go on, applies the answers, logs each decision in one line
    and records its `OOMEvent`. After a shrink, `GrowBack` says when the
    batch can grow back (a `GrowBackEvent`). The state that changes
    during the call lives in those owners; the runner's own is `next`,
    the `ResumePoint` the next attempt starts at.
    """

    def __init__(
        self,
        model,
        settings: FitSettings,
        *,
        train_source: Source,
        validation_source: Source | None,
        other_arguments: dict,
        policy: SizePolicy,
        planner: SizePlanner,
        backup: _backup.Decisions,
        guard: StepGuard,
        history: FitHistory,
        callbacks: list,
    ):
        self.model = model
        self.settings = settings
        self.train_source = train_source
        self.validation_source = validation_source
        # tfmemsafe shuffles arrays itself, one permutation per epoch from
        # a seed drawn from NumPy's generator (`set_random_seed` sets it).
        self.shuffle = other_arguments.pop(
            "shuffle", isinstance(train_source, Arrays)
        )
        self.other_arguments = other_arguments
        self.seed = int(np.random.randint(2**31))
        self.policy = policy
        self.planner = planner
        self.backup = backup
        self.guard = guard
        self.history = history
        self.first_epoch = settings.initial_epoch
        self.next = ResumePoint(settings.initial_epoch)
        self.position = Position(settings.initial_epoch, guard)
        self.epoch_start = EpochStart()
        self.grow_back = GrowBack.for_run(model, settings, policy, planner)
        self.split = SplitBatch.for_run(
            model, settings, train_source, guard, other_arguments
        )
        others = [c for c in callbacks if c is not history]
        # `GrowBack` last: every other callback has seen the step end
        # when it stops the call.
        self.callbacks = ResumableCallbackList(
            [
                *monitors_first(
                    [self.position, self.epoch_start, *others, history]
                ),
                self.grow_back,
            ],
            add_progbar=settings.verbose != 0,
            model=model,
        )

    def train(self) -> FitHistory:
        self._begin()
        try:
            retry_on_oom(self.model, self._attempt, self._on_oom, self._recover)
        finally:
            self.epoch_start.close()
        self.callbacks.end_run(self.position.last_logs)
        self.history.batch_size = self.policy.batch_size(TRAINING)
        return self.history

    def _begin(self) -> None:
        """Starts the run for the callbacks at the epoch to start at."""
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self.callbacks.set_params(_params(self.settings, None))
        self.callbacks.on_train_begin()
        # `BackupAndRestore` sets this private attribute in
        # `on_train_begin` to the epoch it restored; `fit` would prefer it
        # to our `initial_epoch`.
        restored = getattr(self.model, "_initial_epoch", None)
        self.model._initial_epoch = None
        self.first_epoch = max(self.settings.initial_epoch, restored or 0)
        self.next = ResumePoint(self.first_epoch)

    def _attempt(self) -> None:
        """Trains from where the last attempt stopped to the last epoch."""
        point = self.next
        if point.split:
            point = self.next = self._train_split(point)
            if self.model.stop_training and point.validation_skip is None:
                return
        epoch = point.epoch
        if point.validation_skip is not None:
            self._finish_validation(epoch, point.validation_skip)
            self._trained(TRAINING, VALIDATION)
            epoch += 1
            self.next = ResumePoint(epoch)
            if self.model.stop_training:
                return
        while epoch < self.settings.epochs:
            if not self.next.begun and self.grow_back.waiting():
                self._estimate_for_growing_back(may_trace=True)
                growth = self.grow_back.growth(epoch)
                if growth is not None:
                    self._grow(growth, epoch, step=0)
            try:
                self._fit_epoch(epoch, self.next)
            except GrowNow as now:
                growth = now.growth
            else:
                growth = None
            if growth is not None:
                gc.collect()  # The stopped call's iterator and its buffers.
                self.next = self._grow(growth, epoch, self.position.steps_done)
                continue
            self._trained(TRAINING, VALIDATION)
            epoch += 1
            self.next = ResumePoint(epoch)
            if self.model.stop_training:
                return

    def _trained(self, *phases: str) -> None:
        """Tells the planner which of `phases` ran steps at their size."""
        done = {
            TRAINING: self.position.steps_done,
            VALIDATION: self.position.validation_steps_done,
        }
        for phase in phases:
            if done[phase] and self._source(phase) is not None:
                self.planner.record_trained(
                    phase, self._source(phase), self.policy.batch_size(phase)
                )

    def _fit_epoch(self, epoch: int, point: ResumePoint) -> None:
        settings = self.settings
        source = self.train_source
        size = self.policy.batch_size(TRAINING)
        skip = point.skip if point.epoch == epoch else 0
        begun = point.epoch == epoch and point.begun
        order = None
        if self.shuffle and isinstance(source, Arrays):
            order = np.random.default_rng([self.seed, epoch]).permutation(
                source.num_samples
            )
        arguments = {**source.fit_defaults(), **self.other_arguments}
        arguments.update(source.keras_arguments(size, skip, order=order))
        # Keras ignores `shuffle` for datasets (and warns when it is
        # True); arrays are shuffled here.
        arguments["shuffle"] = False
        steps = self.policy.scaled_steps(TRAINING, settings.steps_per_epoch)
        done = self.position.steps_done if skip else 0
        total = steps or source.num_batches(arguments)
        total = done + total if total else None
        if self.validation_source is not None:
            arguments.update(
                self.validation_source.validation_arguments(
                    self.policy.batch_size(VALIDATION)
                ),
                validation_steps=self.policy.scaled_steps(
                    VALIDATION, settings.validation_steps
                ),
            )
            self.position.start_validation(
                0, self.policy.batch_size(VALIDATION)
            )
        self.position.start_epoch(skip, size)
        step = None if self.split is None else self.split.train_function()
        if step is not None:
            # Keras' loop calls it as its own (see `AgreedStep`).
            self.model.train_function = step
        self.callbacks.set_params(_params(settings, total))
        self.callbacks.resume_at(epoch if begun else None, done)
        try:
            self.model.fit(
                **arguments,
                epochs=epoch + 1,
                initial_epoch=epoch,
                steps_per_epoch=steps,
                callbacks=self.callbacks,
                verbose=settings.verbose,
            )
        finally:
            self.callbacks.end_call()

    def _finish_validation(self, epoch: int, skip: int) -> None:
        """Runs the rest of `epoch`'s validation, then ends the epoch."""
        size = self.policy.batch_size(VALIDATION)
        self.position.start_validation(skip, size)
        self.callbacks.resume_validation_at(
            self.position.validation_steps_done if skip else 0
        )
        try:
            logs = self.model.evaluate(
                **self.validation_source.keras_arguments(size, skip),
                steps=self.policy.scaled_steps(
                    VALIDATION, self.settings.validation_steps
                ),
                callbacks=self.callbacks,
                return_dict=True,
                verbose=0,
            )
        finally:
            self.callbacks.end_call()
        epoch_logs = dict(self.position.train_logs)
        epoch_logs.update({f"val_{name}": v for name, v in logs.items()})
        self.callbacks.on_epoch_end(epoch, epoch_logs)

    def _train_split(self, point: ResumePoint) -> ResumePoint:
        """Trains the failed step's batch split (`point.split`); where to
        go on: the next step, at the batch size of the others, or, after
        the epoch's last batch (or a callback's `stop_training`), the
        epoch's validation or end.

        Between `model.fit` calls, as `_grow` is: the callbacks see the
        step begin and end, as in a call.
        """
        epoch, step = point.epoch, point.resumed_at_step
        self.callbacks.on_train_batch_begin(step)
        batch, last = self.split.batch_at(
            self.policy.batch_size(TRAINING), step
        )
        logs = self.split.train(batch, point.split)
        self.callbacks.on_train_batch_end(step, logs)
        self.callbacks.end_call()
        self.position.carry_metrics()
        _carry_partial_window(self.model, None)
        if not (last or self.model.stop_training):
            return ResumePoint(
                epoch, skip=step + 1, resumed_at_step=step + 1, begun=True
            )
        # No `model.fit` call is left to end the epoch: end it here.
        if self.validation_source is not None:
            return ResumePoint(epoch, validation_skip=0, resumed_at_step=0)
        self.callbacks.on_epoch_end(epoch, dict(self.position.last_logs))
        self._trained(TRAINING)
        return ResumePoint(epoch + 1)

    def _grow(self, growth: Growth, epoch: int, step: int) -> ResumePoint:
        """Grows the training batch back; where to go on (the next step).

        Called between `model.fit` calls, after a step that finished: the
        model is as the step left it, and only the metrics of the steps
        done are carried into the next call.
        """
        decision = self.policy.grow(growth.batch_size, growth.predicted)
        self.grow_back.grown(self.history, decision, epoch, step)
        if not step:
            return ResumePoint(epoch)
        self.position.carry_metrics()
        _carry_partial_window(self.model, decision)
        return ResumePoint(
            epoch,
            skip=self.position.samples_done,
            resumed_at_step=step,
            begun=True,
        )

    def _estimate_for_growing_back(self, *, may_trace: bool) -> None:
        """Makes the training step's estimate, which growing back needs,
        where it is not made yet and there is room to probe: after a
        shrink, and between epochs while it waits to grow."""
        if self.grow_back.after is not None and self.policy.growth_sizes():
            self.planner.estimate_with_room(
                TRAINING,
                self.train_source,
                self.policy.batch_size(TRAINING),
                may_trace=may_trace,
            )

    def _on_oom(self, err: BaseException) -> _Failure:
        """Splits the failed batch, halves the failed phase's batch, or
        raises OutOfMemoryError."""
        phase = self.position.phase
        size = self.policy.batch_size(phase)
        # Read first: estimating trains, and so sets the marker.
        update_began = self.guard.touched()
        pieces = 0
        if self.split is not None:
            pieces = self.split.pieces(self.position, self.next, update_began)
        if pieces and self.policy.spend_retry():
            steps = accumulation_steps_of(self.model)
            decision = SizeDecision(phase, size, size, steps, steps)
            return dataclasses.replace(
                self._failure(decision, err, update_began), split=pieces
            )
        self.planner.record_ran_out(phase, self._source(phase), size)
        if phase == TRAINING:
            self.grow_back.shrunk(self.position.epoch, size)
        strategy = self.model.distribute_strategy
        if distribute.is_multi_worker(strategy):
            stop, decision = self.backup.stop_all_workers(
                err, phase, self.policy, strategy
            )
            if decision is not None:
                self._record(self._failure(decision, err, False), None)
            raise stop from err
        try:
            decision = self.policy.halve(phase, err)
        except OutOfMemoryError as gave_up:
            raise self._give_up(gave_up) from err
        return self._failure(decision, err, update_began)

    def _failure(self, decision, err, update_began: bool) -> _Failure:
        return _Failure(
            decision=decision,
            epoch=self.position.epoch,
            step=self.position.step,
            error=_messages.error_line(err),
            update_began=update_began,
        )

    def _recover(self, failure: _Failure) -> None:
        """Jumps to a size predicted to fit; goes on where it can."""
        if failure.split:
            self._recover_by_splitting(failure)
            return
        phase = failure.decision.phase
        source = self._source(phase)
        self.planner.note_held_after_failure(phase, source)
        decision = self.policy.jump(failure.decision, self.planner, source)
        if phase == TRAINING:
            self._estimate_for_growing_back(may_trace=False)
        point = self.position.resume_point(
            update_began=failure.update_began,
            steps_fixed=(
                self.settings.steps_per_epoch
                if phase == TRAINING
                else self.settings.validation_steps
            )
            is not None,
            reproducible=self._source(phase).position_is_reproducible(
                decision.batch_size_after
            ),
        )
        self.callbacks.abandon_attempt()
        self.position.abandon_attempt()
        if point.resumed_at_step is not None:
            # Only what the failed step's forward pass changed: metrics,
            # moving statistics, seeds.
            self.guard.restore_small_state()
            self.position.carry_metrics()
            if phase == TRAINING:
                _carry_partial_window(self.model, decision)
        else:
            self._put_epoch_start_back()
            forget_epoch(
                self.history, point.epoch, self.position.epoch_end_keys
            )
        event = self._record(
            dataclasses.replace(failure, decision=decision),
            resumed_at_step=point.resumed_at_step,
        )
        self.next = point
        # `BackupAndRestore` sets this private attribute in `on_train_begin`,
        # and `fit` would prefer it to our `initial_epoch`.
        self.model._initial_epoch = None
        logging.warning(
            "tfmemsafe.fit: out of memory in epoch %d, %s step %d: %s. "
            "Resuming at %s.",
            event.epoch + 1,
            event.phase,
            event.step,
            decision.describe(),
            point.describe(),
        )

    def _recover_by_splitting(self, failure: _Failure) -> None:
        """Goes on at the failed step, its batch to be split."""
        self.callbacks.abandon_attempt()
        self.position.abandon_attempt()
        self.guard.restore_small_state()
        event = self._record(failure, resumed_at_step=failure.step)
        self.next = ResumePoint(
            failure.epoch,
            skip=failure.step,
            resumed_at_step=failure.step,
            begun=True,
            split=failure.split,
        )
        self.model._initial_epoch = None  # As in `_recover`.
        logging.warning(
            "tfmemsafe.fit: out of memory in epoch %d, training step %d: "
            "%s. Training that batch alone as %d micro-batches accumulated "
            "into one update; the next batches at batch size %d.",
            event.epoch + 1,
            event.step,
            event.error,
            failure.split,
            event.batch_size_after,
        )

    def _record(self, failure: _Failure, resumed_at_step) -> OOMEvent:
        """The `OOMEvent` of `failure`, appended to the history."""
        decision = failure.decision
        event = OOMEvent(
            epoch=failure.epoch,
            step=failure.step,
            phase=decision.phase,
            batch_size_before=decision.batch_size_before,
            batch_size_after=decision.batch_size_after,
            accumulation_steps=decision.accumulation_steps_after,
            error=failure.error,
            resumed_at_step=resumed_at_step,
            split_into=failure.split or None,
        )
        self.history.oom_events.append(event)
        return event

    def _put_epoch_start_back(self) -> None:
        """Restores the epoch's start; says so if memory is too short.

        With the reserve let go (`EpochStart`), a piece fails to be read
        only where something else took that memory too.
        """
        try:
            self.epoch_start.restore()
        except tf.errors.ResourceExhaustedError as err:
            epoch = (self.epoch_start.epoch or 0) + 1
            raise OutOfMemoryError(
                "tfmemsafe.fit ran out of memory and then could not put "
                f"back the state epoch {epoch} started with: not even 1 MiB "
                "of it could be read back while something else held the "
                "rest of the memory. The model's variables are partly those "
                f"of the start of epoch {epoch} and partly those of the "
                "failed step: load them from a checkpoint "
                "(`keras.callbacks.BackupAndRestore` or `ModelCheckpoint`).",
                self.policy.tried(self.position.phase),
            ) from err

    def _source(self, phase: str) -> Source | None:
        if phase == VALIDATION:
            return self.validation_source
        return self.train_source

    def _give_up(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """Puts back the last completed epoch's state; says so."""
        self.callbacks.abandon_attempt()
        release(self.model)
        self._put_epoch_start_back()
        epoch = self.epoch_start.epoch
        if epoch is None or epoch == self.first_epoch:
            return _with_state(error, "before training", self.model)
        return _with_state(error, f"at the end of epoch {epoch}", self.model)


def _params(settings: FitSettings, steps) -> dict:
    """The callbacks' `params`."""
    return {
        "verbose": settings.verbose,
        "epochs": settings.epochs,
        "steps": steps,
    }


def _with_state(error: OutOfMemoryError, state: str, model) -> OutOfMemoryError:
    """`error` with a sentence saying which state the model is left in."""
    optimizer = model.optimizer
    iterations = 0 if optimizer is None else int(optimizer.iterations.numpy())
    message = str(error)
    advice = message.find(_messages.OOM_ADVICE)
    if advice < 0:
        advice = len(message)
    where = (
        f"The model is as it was {state} (optimizer iterations {iterations}). "
    )
    return OutOfMemoryError(
        (message[:advice] + where + message[advice:]).strip(),
        error.tried_batch_sizes,
    )


def _carry_partial_window(model, decision: SizeDecision | None) -> None:
    """Keeps an `AccumulatingModel`'s partial window for the resumed call.

    Its micro-batches are counted again in units of the new size (after
    `decision`; `None` when the size did not change), so that the window
    is applied after the same samples.
    """
    carry = getattr(model, "_carry_partial_window", None)
    if carry is not None and window_closes_by_size(model):
        carry(1.0)  # It closes after the same samples at any batch size.
        return
    if decision is None:
        before = after = accumulation_steps_of(model)
    else:
        before = decision.accumulation_steps_before
        after = decision.accumulation_steps_after
    if carry is not None and before and after:
        carry(after / before)
