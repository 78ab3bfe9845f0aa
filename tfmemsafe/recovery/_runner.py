"""One `tfmemsafe.fit` call: its settings, its attempts and its recovery.

`FitRun` trains epoch by epoch, one `model.fit` call each, so that each
epoch can be given its own data: the epoch's shuffled order of arrays, or,
after an out-of-memory error at step k, the samples from step k on at the
new batch size. `FitSizes` holds the batch sizes of training and
validation and halves them; `_step_guard` says what a failed step can
have changed.
"""

from __future__ import annotations

import dataclasses
import functools

import keras
import numpy as np
from absl import logging

from tfmemsafe import _messages
from tfmemsafe import distribute
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe._model_state import optimizers_of
from tfmemsafe._sources import Arrays
from tfmemsafe._sources import Source
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.history import FitHistory
from tfmemsafe.history import OOMEvent
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery import _backup
from tfmemsafe.recovery import _planner as _planning
from tfmemsafe.recovery._policy import FitSizes
from tfmemsafe.recovery._policy import accumulation_steps_of
from tfmemsafe.recovery._resume import EpochStart
from tfmemsafe.recovery._resume import Position
from tfmemsafe.recovery._resume import ResumableCallbackList
from tfmemsafe.recovery._resume import forget_epoch
from tfmemsafe.recovery._retry import release
from tfmemsafe.recovery._retry import retry_on_oom
from tfmemsafe.recovery._step_guard import StepGuard


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """What one `tfmemsafe.fit` call asks for, checked; fixed for the run.

    Attributes:
        train_source: Source. The training data.
        validation_source: Source or `None`. The validation data.
        batch_size: int. The training batch size to start at.
        validation_batch_size: int or `None`. The user's
            `validation_batch_size`.
        epochs: int. The epoch to stop at.
        initial_epoch: int. The epoch to start at.
        steps_per_epoch: int or `None`. At the first batch size.
        validation_steps: int or `None`. At the first validation batch
            size.
        min_batch_size: int. The smallest batch size to try.
        max_retries: int or `None`. How many errors to recover from.
        keep_effective_batch_size: bool. Whether to double the model's
            `accumulation_steps` when the training batch halves.
        preflight: bool. Whether to estimate the training step's memory
            before the first step and start at a size predicted to fit.
        memory_estimate: bool. Whether memory may be estimated at all
            (the pre-flight check, and the jump after an error).
        verbose: `"auto"`, 0, 1 or 2.
        other_arguments: dict. The other `model.fit` arguments, passed to
            every attempt as they are.
    """

    train_source: Source
    validation_source: Source | None
    batch_size: int
    validation_batch_size: int | None
    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    validation_steps: int | None
    min_batch_size: int
    max_retries: int | None
    keep_effective_batch_size: bool
    preflight: bool
    memory_estimate: bool
    verbose: int | str
    other_arguments: dict


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What an out-of-memory error stopped, noted as it was caught."""

    phase: str
    epoch: int
    step: int
    batch_size_before: int
    accumulation_steps_before: int | None
    error: str
    update_began: bool


class FitRun:
    """One `tfmemsafe.fit` call: its attempts, and recovery between them.

    It owns all the state that changes during the call, declared here.
    Each epoch is one `model.fit` call (the callbacks see one run), so
    that each epoch can be given its own data: the epoch's shuffled order
    of arrays, or, after an out-of-memory error at step k, the samples
    from step k on at the new batch size.
    """

    def __init__(self, model, settings: FitSettings, callbacks: list):
        self.model = model
        self.settings = settings
        self.other_arguments = dict(settings.other_arguments)
        self.train_source, self.validation_source = _split_for_validation(
            settings, self.other_arguments
        )
        # tfmemsafe shuffles arrays itself, one permutation per epoch from
        # a seed drawn from NumPy's generator (`set_random_seed` sets it).
        self.shuffle = self.other_arguments.pop(
            "shuffle", isinstance(self.train_source, Arrays)
        )
        self.seed = int(np.random.randint(2**31))
        self.sizes = FitSizes(model, settings, self.validation_source)
        # Where the next attempt starts: epoch, training sample, and the
        # validation sample when only the epoch's validation remains.
        self.resume_epoch = settings.initial_epoch
        self.first_epoch = settings.initial_epoch
        self.skip = 0
        self.validation_skip = None
        self.resume_refusal = ""
        self.guard = None
        self.planner = _planning.SizePlanner(model, "tfmemsafe.fit")
        self.history = _fit_history(callbacks)
        self.decisions = _backup.Decisions(callbacks)
        self.decisions.load(self.sizes.train, model)
        if self.decisions.loaded and self.sizes.validation_follows_training:
            self.sizes.validation.follow(self.sizes.train)
        self.position = Position(settings.initial_epoch, guard=None)
        self.epoch_start = EpochStart()
        others = [c for c in callbacks if c is not self.history]
        self.callbacks = ResumableCallbackList(
            monitors_first(
                [self.position, self.epoch_start, *others, self.history]
            ),
            add_progbar=settings.verbose != 0,
            model=model,
        )

    def train(self) -> FitHistory:
        settings = self.settings
        # A stopped job's stored size was tried: no check then.
        if settings.preflight and settings.memory_estimate:
            if not self.decisions.loaded:
                self.history.oom_events += _planning.preflight(
                    self.planner, self.sizes, self.train_source, settings
                )
        self.guard = StepGuard(
            self.model,
            optimizers_of(self.model),
            gradient_accumulators_of(self.model),
        )
        self.position.guard = self.guard
        try:
            self._begin()
            retry_on_oom(self.model, self._attempt, self._on_oom, self._recover)
        finally:
            self.guard.close()
        self.callbacks.end_run(self.position.last_logs)
        self.history.batch_size = self.sizes.train.batch_size
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
        self.resume_epoch = self.first_epoch

    def _attempt(self) -> None:
        """Trains from where the last attempt stopped to the last epoch."""
        if self.validation_skip is not None:
            self._finish_validation(self.resume_epoch, self.validation_skip)
            self.resume_epoch, self.skip = self.resume_epoch + 1, 0
            self.validation_skip = None
            if self.model.stop_training:
                return
        while self.resume_epoch < self.settings.epochs:
            self._fit_epoch(self.resume_epoch, self.skip)
            self.resume_epoch, self.skip = self.resume_epoch + 1, 0
            if self.model.stop_training:
                return

    def _fit_epoch(self, epoch: int, skip: int) -> None:
        settings = self.settings
        source = self.train_source
        size = self.sizes.train.batch_size
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
        steps = self.sizes.train.scaled_steps(settings.steps_per_epoch)
        done = self.position.steps_done if skip else 0
        total = steps or source.num_batches(arguments)
        total = done + total if total else None
        self.callbacks.set_params(_params(settings, total))
        if self.validation_source is not None:
            arguments.update(
                self.validation_source.validation_arguments(
                    self.sizes.validation.batch_size
                ),
                validation_steps=self.sizes.validation.scaled_steps(
                    settings.validation_steps
                ),
            )
            self.position.start_validation(0, self.sizes.validation.batch_size)
        self.position.start_epoch(skip, size)
        self.callbacks.resume_at(epoch if skip else None, done)
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
        size = self.sizes.validation.batch_size
        self.position.start_validation(skip, size)
        self.callbacks.resume_validation_at(
            self.position.validation_steps_done if skip else 0
        )
        try:
            logs = self.model.evaluate(
                **self.validation_source.keras_arguments(size, skip),
                steps=self.sizes.validation.scaled_steps(
                    self.settings.validation_steps
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

    def _on_oom(self, err: BaseException) -> _Failure:
        """Halves the failed phase's batch, or raises OutOfMemoryError."""
        strategy = self.model.distribute_strategy
        if distribute.is_multi_worker(strategy):
            training = self.position.phase == "training"
            raise self.decisions.stop_all_workers(
                err,
                strategy,
                self.sizes.train,
                self.model,
                halve=(lambda: self._event(self._halve(err)))
                if training
                else None,
            ) from err
        try:
            return self._halve(err)
        except OutOfMemoryError as gave_up:
            raise self._give_up(gave_up) from err

    def _halve(self, err: BaseException) -> _Failure:
        """Halves the failed phase's batch once; notes what failed."""
        phase = self.position.phase
        before, steps_before, _ = self.sizes.halve(err, phase)
        return _Failure(
            phase=phase,
            epoch=self.position.epoch,
            step=self.position.step,
            batch_size_before=before,
            accumulation_steps_before=steps_before,
            error=_messages.error_line(err),
            # Read now: estimating trains, and so sets the marker.
            update_began=self.guard.touched(),
        )

    def _event(self, failure: _Failure) -> OOMEvent:
        """Records the recovery from `failure` at the sizes now chosen."""
        phase = failure.phase
        sizes = self.sizes.of(phase)
        steps_before = failure.accumulation_steps_before
        accumulation_steps = accumulation_steps_of(self.model)
        resumed_at_step = None
        if phase == "training":
            self.resume_refusal = _resume_refusal(
                self.position,
                failure.update_began,
                self.settings,
                self.train_source.position_is_reproducible(sizes.batch_size),
            )
            if not self.resume_refusal:
                resumed_at_step = self.position.steps_done
                if steps_before and accumulation_steps:
                    _carry_partial_window(
                        self.model, accumulation_steps / steps_before
                    )
        elif (
            self.validation_source.position_is_reproducible(sizes.batch_size)
            and self.settings.validation_steps is None
        ):
            # Training of the epoch is done: it is never replayed. The
            # validation goes on at its failed step, or starts again (0).
            resumed_at_step = self.position.validation_steps_done
        else:
            resumed_at_step = 0
        event = OOMEvent(
            epoch=failure.epoch,
            step=failure.step,
            phase=phase,
            batch_size_before=failure.batch_size_before,
            batch_size_after=sizes.batch_size,
            accumulation_steps=accumulation_steps,
            error=failure.error,
            resumed_at_step=resumed_at_step,
        )
        self.history.oom_events.append(event)
        return event

    def _recover(self, failure: _Failure) -> None:
        """Jumps to a size predicted to fit; goes on where it can."""
        if self.settings.memory_estimate:
            training = failure.phase == "training"
            source = self.train_source if training else self.validation_source
            self.sizes.jump(failure.phase, self.planner, source)
        event = self._event(failure)
        self.callbacks.abandon_attempt()
        self.position.abandon_attempt()
        self.resume_epoch = event.epoch
        self.skip, self.validation_skip = 0, None
        if event.phase == "validation":
            self.validation_skip = 0
            where = f"the start of the validation of epoch {event.epoch + 1}"
            if event.resumed_at_step:
                self.guard.restore_small_state()
                self.position.carry_metrics()
                self.validation_skip = self.position.validation_samples_done
                where = (
                    f"validation step {event.resumed_at_step} of epoch "
                    f"{event.epoch + 1}"
                )
        elif event.resumed_at_step is not None:
            # Only what the failed step's forward pass changed: metrics,
            # moving statistics, seeds.
            self.guard.restore_small_state()
            self.position.carry_metrics()
            self.skip = self.position.samples_done
            where = f"step {event.resumed_at_step} of epoch {event.epoch + 1}"
        else:
            self.epoch_start.restore()
            forget_epoch(
                self.history, event.epoch, self.position.epoch_end_keys
            )
            where = (
                f"the start of epoch {event.epoch + 1} ({self.resume_refusal})"
            )
        # `BackupAndRestore` sets this private attribute in `on_train_begin`,
        # and `fit` would prefer it to our `initial_epoch`.
        self.model._initial_epoch = None
        logging.warning(
            "tfmemsafe.fit: out of memory in %s. Resuming at %s.",
            event,
            where,
        )

    def _give_up(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """Puts back the last completed epoch's state; says so."""
        self.callbacks.abandon_attempt()
        release(self.model)
        self.epoch_start.restore()
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


def _resume_refusal(position, update_began, settings, reproducible) -> str:
    """Why training cannot go on at the failed step, or `""` if it can."""
    if position.ending:
        return "it came after the epoch's last step"
    if update_began:
        return "an update had begun when memory ran out"
    if settings.steps_per_epoch is not None:
        return "`steps_per_epoch` is set"
    if not reproducible:
        return (
            "the data does not give the same order again: shuffled "
            "without a fixed seed, or not deterministic"
        )
    return ""


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


def _split_for_validation(settings: FitSettings, other_arguments: dict):
    """The training and validation sources, `validation_split` applied.

    Arrays are split once, as Keras splits them (the last rows), so that
    the rest of an epoch is never split again; other data keeps the
    argument for Keras.
    """
    split = other_arguments.pop("validation_split", None)
    train, validation = settings.train_source, settings.validation_source
    if split and validation is None:
        if isinstance(train, Arrays):
            return train.split(split)
        other_arguments["validation_split"] = split
    return train, validation


def _carry_partial_window(model, ratio: float) -> None:
    """Keeps an `AccumulatingModel`'s partial window for the resumed call.

    Its micro-batches are counted again in units of the new, smaller
    ones, so that the window is applied after the same samples.
    """
    carry = getattr(model, "_carry_partial_window", None)
    if carry is not None:
        carry(ratio)


def _fit_history(callbacks: list) -> FitHistory:
    """The `History` in `callbacks`, made a `FitHistory`, or a new one."""
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.History):
            if not isinstance(callback, FitHistory):
                callback.__class__ = _with_fit_history(type(callback))
            callback.oom_events = []
            callback.batch_size = None
            return callback
    return FitHistory()


@functools.cache
def _with_fit_history(cls: type) -> type:
    """`FitHistory`, or a subclass of both `cls` and `FitHistory`."""
    if cls is keras.callbacks.History:
        return FitHistory
    return type(cls.__name__, (cls, FitHistory), {"__module__": cls.__module__})
