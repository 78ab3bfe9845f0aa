"""Training, evaluation and prediction that survive running out of memory.

`fit` trains a compiled Keras model like `model.fit`, but when a batch does
not fit in device memory it halves the batch size (doubling an
`AccumulatingModel`'s `accumulation_steps`, so each update still averages
the same number of samples), puts back what the failed step changed and
goes on at that step (`_step_guard` says what a failed step can have
changed; the epoch starts again in the rare cases it must). `evaluate`
and `predict` halve the same way. Every out-of-memory error takes one path,
`_halving.retry_on_oom`; the data kinds are in `_sources`, what a run
keeps to resume in `_resume`, and `find_max_batch_size` in `batch_search`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import keras
import numpy as np
from absl import logging

from tfmemsafe import _backup
from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe import distribute
from tfmemsafe._halving import Halving
from tfmemsafe._halving import RetryBudget
from tfmemsafe._halving import release
from tfmemsafe._halving import retry_on_oom
from tfmemsafe._resume import EpochStart
from tfmemsafe._resume import Position
from tfmemsafe._resume import PredictionProgress
from tfmemsafe._resume import ResumableCallbackList
from tfmemsafe._resume import forget_epoch
from tfmemsafe._resume import gradient_accumulators_of
from tfmemsafe._resume import optimizers_of
from tfmemsafe._sources import Arrays
from tfmemsafe._sources import Source
from tfmemsafe._sources import source_for
from tfmemsafe._step_guard import StepGuard
from tfmemsafe.batch_search import find_max_batch_size
from tfmemsafe.callbacks import MemoryMonitor
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.history import FitHistory
from tfmemsafe.history import OOMEvent

# `model.fit` arguments that `tfmemsafe.fit` takes in its own way.
_DATA_ARGUMENTS = ("x", "y", "sample_weight")


def fit(
    model: keras.Model,
    data,
    *,
    batch_size: int | str | None = None,
    epochs: int = 1,
    validation_data=None,
    min_batch_size: int = 1,
    keep_effective_batch_size: bool = True,
    max_retries: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    **fit_kwargs,
) -> FitHistory:
    """Trains a compiled model, halving the batch when memory runs out.

    Works like `model.fit`. When a step, or the validation at the end of an
    epoch, raises an out-of-memory error (`tfmemsafe.is_oom_error`), it:

    1. logs one line: the epoch, the step, the batch size before and after
       and the accumulation steps;
    2. frees what it can: the failed iterator, the compiled train, test and
       predict functions (they are traced again at the new shapes), and
       Python garbage;
    3. halves the batch size of the phase that failed. For an
       `AccumulatingModel` with `keep_effective_batch_size=True`, it
       doubles `accumulation_steps` so each update averages as many
       samples as before; for other models it warns once that the
       effective batch shrinks. `steps_per_epoch` and `validation_steps`
       double, so an epoch still covers the same data;
    4. puts back what the failed step changed (metrics, moving
       statistics; no update runs before all gradients exist) and goes on
       at that step: nothing before it is replayed, no sample is skipped
       or used twice, and the epoch's logs cover the whole epoch. A
       failure in validation goes on at the failed validation step. When
       the data cannot give the same order again, or the failed step had
       begun its update, it restores the state the epoch started with and
       starts the epoch again (see docs/oom-recovery.md).

    The same callback objects see every attempt as one run: each gets
    `on_train_begin` once and `on_train_end` once, at the end, so
    `EarlyStopping`'s patience, `CSVLogger`'s open file, `History` and
    `TensorBoard`'s step counters carry on across retries.

    Args:
        model: A compiled `keras.Model`.
        data: The training data: a callable `batch_size -> tf.data.Dataset`
            (your pipeline, rebuilt at each new batch size), an unbatched
            `tf.data.Dataset` (batched and prefetched here), a batched
            `tf.data.Dataset` (rebatched), or a tuple `(x, y)` or
            `(x, y, sample_weight)` of arrays.
        batch_size: int, `"auto"` or `None`. The (global) batch size to
            start at. `"auto"` uses `find_max_batch_size`. `None` means
            the batch size of a batched dataset, else 32; a callable
            needs one.
        epochs: int. The number of epochs; with `initial_epoch`, the
            epoch to stop at, as in `model.fit`. Defaults to 1.
        validation_data: Validation data of any kind `data` accepts.
            Defaults to `None`.
        min_batch_size: int. The smallest batch size to try. Defaults
            to 1.
        keep_effective_batch_size: bool. Whether to double the model's
            `accumulation_steps` each time the batch halves. Defaults to
            `True`.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        callbacks: list of `keras.callbacks.Callback`. Passed to every
            attempt, `tfmemsafe.MemoryMonitor`s first so that the callbacks
            after them see `memory_peak_mb` in the epoch logs.
        verbose: `"auto"`, 0, 1 or 2, as in `model.fit`.
        **fit_kwargs: Other `model.fit` arguments (`initial_epoch`,
            `steps_per_epoch`, `validation_batch_size`, `validation_steps`,
            `validation_freq`, `shuffle`, `class_weight`, ...).

    Returns:
        A `tfmemsafe.FitHistory`: a `keras.callbacks.History` with one
        entry per completed epoch across all attempts, plus `oom_events`
        (a list of `OOMEvent`) and `batch_size` (the training batch size at
        the end). A `History` passed in `callbacks` is the one returned,
        made a `FitHistory` in place.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up. The model is
            then put back in the state of the last completed epoch (or of
            the start), which the message names. The original error is
            chained as `__cause__`.
        TypeError: If `data` or `validation_data` is of no accepted kind.
        ValueError: If an argument is out of range.

    Any error that is not an out-of-memory error, and `KeyboardInterrupt`,
    propagates at once, unchanged.

    Example:
    >>> history = tfmemsafe.fit(model, (x, y), batch_size=1024, epochs=3)
    >>> [event.batch_size_after for event in history.oom_events]
    [512]
    """
    _checks.compiled_model(model, "fit")
    _checks.integer("epochs", epochs, 1)
    _check_limits(min_batch_size, max_retries)
    for name in _DATA_ARGUMENTS:
        if name in fit_kwargs:
            raise TypeError(
                f"`{name}` is not an argument of `tfmemsafe.fit`: pass the "
                "inputs, targets and sample weights together as `data`, "
                "e.g. data=(x, y, sample_weight). "
                f"Received: {name}={fit_kwargs[name]!r:.60}"
            )
    train_source = source_for(data, "data", labelled=True)
    validation_source = None
    if validation_data is not None:
        validation_source = source_for(
            validation_data, "validation_data", labelled=True
        )
    if batch_size == "auto":
        batch_size = find_max_batch_size(model, data)
        logging.info("tfmemsafe.fit: batch_size='auto' chose %d.", batch_size)
    other_arguments = dict(fit_kwargs)
    settings = _FitSettings(
        train_source=train_source,
        validation_source=validation_source,
        batch_size=train_source.resolve_batch_size(batch_size),
        validation_batch_size=other_arguments.pop(
            "validation_batch_size", None
        ),
        epochs=epochs,
        initial_epoch=other_arguments.pop("initial_epoch", 0),
        steps_per_epoch=other_arguments.pop("steps_per_epoch", None),
        validation_steps=other_arguments.pop("validation_steps", None),
        min_batch_size=min_batch_size,
        max_retries=max_retries,
        keep_effective_batch_size=keep_effective_batch_size,
        verbose=verbose,
        other_arguments=other_arguments,
    )
    if settings.validation_batch_size is not None:
        _checks.integer("validation_batch_size", settings.validation_batch_size)
    _check_start(
        min_batch_size,
        batch_size=settings.batch_size,
        validation_batch_size=settings.validation_batch_size,
    )
    if not model.built:
        # The epoch snapshot builds the optimizer: the model's variables
        # must exist by then (a subclassed model makes them in its call).
        model(train_source.sample_inputs(), training=False)
    return _FitRun(model, settings, _checks.callbacks(callbacks)).train()


def evaluate(
    model: keras.Model,
    data,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    return_dict: bool = False,
):
    """Evaluates a compiled model, halving the batch when memory runs out.

    Like `model.evaluate`. An out-of-memory error starts the evaluation
    again from the first batch at half the batch size (and twice the
    `steps`), so the metrics always cover the whole data once.

    Args:
        model: A compiled `keras.Model`.
        data: Data of any kind `tfmemsafe.fit` accepts.
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        steps: int or `None`. As in `model.evaluate`, at the first batch
            size.
        min_batch_size: int. The smallest batch size to try. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        callbacks: list of `keras.callbacks.Callback`.
        verbose: `"auto"`, 0, 1 or 2.
        return_dict: bool. Whether to return `{name: value}`.

    Returns:
        What `model.evaluate` returns.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.evaluate(model, (x, y), batch_size=4096, return_dict=True)
    {'loss': 0.31}
    """
    _checks.compiled_model(model, "evaluate")
    _check_limits(min_batch_size, max_retries)
    source = source_for(data, "data", labelled=True)
    sizes = Halving(
        "evaluation",
        source.resolve_batch_size(batch_size),
        model=model,
        min_batch_size=min_batch_size,
        budget=RetryBudget(max_retries),
    )
    _check_start(min_batch_size, batch_size=sizes.batch_size)
    callbacks = _monitors_first(_checks.callbacks(callbacks))

    def attempt():
        return model.evaluate(
            **source.keras_arguments(sizes.batch_size),
            steps=sizes.scaled_steps(steps),
            callbacks=callbacks,
            verbose=verbose,
            return_dict=return_dict,
        )

    def recover(batch_size_before: int) -> None:
        logging.warning(
            "tfmemsafe.evaluate: out of memory at batch size %d; starting "
            "again at %d.",
            batch_size_before,
            sizes.batch_size,
        )

    return retry_on_oom(model, attempt, sizes.halve, recover)


def predict(
    model: keras.Model,
    data,
    *,
    batch_size: int | None = None,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
):
    """Predicts with a model, halving the batch when memory runs out.

    Like `model.predict`, and it returns every sample once, in order, even
    when it had to halve midway: the batches finished before an
    out-of-memory error are kept (moved to host memory), and prediction
    goes on from the first sample that was not finished. A dataset or a
    callable's dataset must therefore give the same samples in the same
    order each time (no shuffling), and be finite.

    Args:
        model: A `keras.Model`.
        data: The inputs: a callable `batch_size -> tf.data.Dataset`, an
            unbatched or batched `tf.data.Dataset`, or an array (or a
            dict or list of arrays, for several inputs).
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        min_batch_size: int. The smallest batch size to try. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        callbacks: list of `keras.callbacks.Callback`.
        verbose: `"auto"`, 0, 1 or 2.

    Returns:
        NumPy arrays, structured as the model's outputs.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.predict(model, x, batch_size=4096).shape
    (10000, 10)
    """
    _checks.model(model)
    _check_limits(min_batch_size, max_retries)
    source = source_for(data, "data", labelled=False)
    sizes = Halving(
        "prediction",
        source.resolve_batch_size(batch_size),
        model=model,
        min_batch_size=min_batch_size,
        budget=RetryBudget(max_retries),
    )
    _check_start(min_batch_size, batch_size=sizes.batch_size)
    progress = PredictionProgress()
    callbacks = _monitors_first([progress, *_checks.callbacks(callbacks)])

    def attempt():
        outputs = model.predict(
            **source.keras_arguments(sizes.batch_size, skip=progress.rows_done),
            callbacks=callbacks,
            verbose=verbose,
        )
        return progress.all_outputs(outputs)

    def recover(batch_size_before: int):
        progress.keep_finished()
        logging.warning(
            "tfmemsafe.predict: out of memory at batch size %d after %d "
            "samples; going on at %d.",
            batch_size_before,
            progress.rows_done,
            sizes.batch_size,
        )
        if progress.ended:  # Every batch was done; what failed came after.
            return progress.all_outputs()
        return None

    return retry_on_oom(model, attempt, sizes.halve, recover)


@dataclasses.dataclass(frozen=True)
class _FitSettings:
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
    verbose: int | str
    other_arguments: dict


class _FitRun:
    """One `tfmemsafe.fit` call: its attempts, and recovery between them.

    It owns all the state that changes during the call, declared here.
    Each epoch is one `model.fit` call (the callbacks see one run), so
    that each epoch can be given its own data: the epoch's shuffled order
    of arrays, or, after an out-of-memory error at step k, the samples
    from step k on at the new batch size.
    """

    def __init__(self, model, settings: _FitSettings, callbacks: list):
        self.model = model
        self.settings = settings
        self.other_arguments = dict(settings.other_arguments)
        self.train_source = settings.train_source
        self.validation_source = settings.validation_source
        split = self.other_arguments.pop("validation_split", None)
        if split and self.validation_source is None:
            if isinstance(self.train_source, Arrays):
                # Split once, as Keras does (the last rows), so that the
                # rest of an epoch is never split again.
                self.train_source, self.validation_source = (
                    self.train_source.split(split)
                )
            else:
                self.other_arguments["validation_split"] = split
        # tfmemsafe shuffles arrays itself, one permutation per epoch from
        # a seed drawn from NumPy's generator (`set_random_seed` sets it).
        self.shuffle = self.other_arguments.pop(
            "shuffle", isinstance(self.train_source, Arrays)
        )
        self.seed = int(np.random.randint(2**31))
        # One budget: `max_retries` counts both phases' halvings.
        budget = RetryBudget(settings.max_retries)
        self.train_sizes = Halving(
            "training",
            settings.batch_size,
            model=model,
            min_batch_size=settings.min_batch_size,
            budget=budget,
        )
        self.validation_sizes = None
        # Without a size of its own, validation follows training.
        self.validation_follows_training = False
        if self.validation_source is not None:
            size = settings.validation_batch_size
            if size is None:
                size = self.validation_source.batch_size
            self.validation_follows_training = size is None
            self.validation_sizes = Halving(
                "validation",
                size or settings.batch_size,
                model=model,
                min_batch_size=settings.min_batch_size,
                budget=budget,
            )
        self.warned_effective_batch = False
        # Where the next attempt starts: epoch, training sample, and the
        # validation sample when only the epoch's validation remains.
        self.resume_epoch = settings.initial_epoch
        self.first_epoch = settings.initial_epoch
        self.skip = 0
        self.validation_skip = None
        self.resume_refusal = ""
        self.guard = None
        self.history = _fit_history(callbacks)
        self.decisions = _backup.Decisions(callbacks)
        self.decisions.load(self.train_sizes, model, _accumulation_steps)
        if self.decisions.loaded and self.validation_follows_training:
            self.validation_sizes.follow(self.train_sizes)
        self.position = Position(settings.initial_epoch, guard=None)
        self.epoch_start = EpochStart()
        others = [c for c in callbacks if c is not self.history]
        self.callbacks = ResumableCallbackList(
            _monitors_first(
                [self.position, self.epoch_start, *others, self.history]
            ),
            add_progbar=settings.verbose != 0,
            model=model,
        )

    def train(self) -> FitHistory:
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
        self.history.batch_size = self.train_sizes.batch_size
        return self.history

    def _begin(self) -> None:
        """Starts the run for the callbacks at the epoch to start at."""
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self.callbacks.set_params(self._params(None))
        self.callbacks.on_train_begin()
        # `BackupAndRestore` sets this private attribute in
        # `on_train_begin` to the epoch it restored; `fit` would prefer it
        # to our `initial_epoch`.
        restored = getattr(self.model, "_initial_epoch", None)
        self.model._initial_epoch = None
        self.first_epoch = max(self.settings.initial_epoch, restored or 0)
        self.resume_epoch = self.first_epoch

    def _params(self, steps) -> dict:
        settings = self.settings
        return {
            "verbose": settings.verbose,
            "epochs": settings.epochs,
            "steps": steps,
        }

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
        size = self.train_sizes.batch_size
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
        steps = self.train_sizes.scaled_steps(settings.steps_per_epoch)
        done = self.position.steps_done if skip else 0
        total = steps or source.num_batches(arguments)
        self.callbacks.set_params(self._params(done + total if total else None))
        if self.validation_source is not None:
            arguments.update(
                self.validation_source.validation_arguments(
                    self.validation_sizes.batch_size
                ),
                validation_steps=self.validation_sizes.scaled_steps(
                    settings.validation_steps
                ),
            )
            self.position.start_validation(0, self.validation_sizes.batch_size)
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
        size = self.validation_sizes.batch_size
        self.position.start_validation(skip, size)
        self.callbacks.resume_validation_at(
            self.position.validation_steps_done if skip else 0
        )
        try:
            logs = self.model.evaluate(
                **self.validation_source.keras_arguments(size, skip),
                steps=self.validation_sizes.scaled_steps(
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

    def _on_oom(self, err: BaseException) -> OOMEvent:
        """Halves the failed phase's batch, or raises OutOfMemoryError."""
        strategy = self.model.distribute_strategy
        if distribute.is_multi_worker(strategy):
            raise self._stop_all_workers(err, strategy) from err
        try:
            return self._next_sizes(err)
        except OutOfMemoryError as gave_up:
            raise self._give_up(gave_up) from err

    def _next_sizes(self, err: BaseException) -> OOMEvent:
        phase = self.position.phase
        sizes = (
            self.validation_sizes if phase == "validation" else self.train_sizes
        )
        steps_before = _accumulation_steps(self.model)
        before = sizes.halve(err)
        accumulation_steps = _accumulation_steps(self.model)
        resumed_at_step = None
        if phase == "training":
            if self.validation_follows_training:
                self.validation_sizes.follow(self.train_sizes)
            accumulation_steps = self._keep_effective_batch(
                before, accumulation_steps
            )
            if self._can_resume(sizes.batch_size):
                resumed_at_step = self.position.steps_done
                if steps_before and accumulation_steps:
                    _carry_partial_window(
                        self.model, accumulation_steps / steps_before
                    )
        else:
            self.validation_follows_training = False
            # Training of the epoch is done: it is never replayed. The
            # validation goes on at its failed step, or starts again.
            resumed_at_step = 0
            if (
                self.validation_source.position_is_reproducible(
                    sizes.batch_size
                )
                and self.settings.validation_steps is None
            ):
                resumed_at_step = self.position.validation_steps_done
        event = OOMEvent(
            epoch=self.position.epoch,
            step=self.position.step,
            phase=phase,
            batch_size_before=before,
            batch_size_after=sizes.batch_size,
            accumulation_steps=accumulation_steps,
            error=_messages.error_line(err),
            resumed_at_step=resumed_at_step,
        )
        self.history.oom_events.append(event)
        return event

    def _can_resume(self, batch_size: int) -> bool:
        """Whether training can go on at the failed step (see the docs)."""
        if self.position.ending:
            self.resume_refusal = "it came after the epoch's last step"
        elif self.guard.touched():
            self.resume_refusal = "an update had begun when memory ran out"
        elif self.settings.steps_per_epoch is not None:
            self.resume_refusal = "`steps_per_epoch` is set"
        elif not self.train_source.position_is_reproducible(batch_size):
            self.resume_refusal = (
                "the data does not give the same order again: shuffled "
                "without a fixed seed, or not deterministic"
            )
        else:
            return True
        return False

    def _keep_effective_batch(self, before: int, steps: int | None):
        after = self.train_sizes.batch_size
        if not self.settings.keep_effective_batch_size:
            return steps
        if steps is None:
            if not self.warned_effective_batch:
                self.warned_effective_batch = True
                logging.warning(
                    "tfmemsafe.fit: %s has no `accumulation_steps`, so each "
                    "update now averages %d samples instead of %d. To keep "
                    "the effective batch, train a "
                    "`tfmemsafe.with_gradient_accumulation(model)`.",
                    self.model.name,
                    after,
                    before,
                )
            return None
        self.model.accumulation_steps = steps * 2
        if after * steps * 2 != before * steps:
            logging.warning(
                "tfmemsafe.fit: the effective batch changes from %d to %d "
                "because batch size %d does not halve evenly.",
                before * steps,
                after * steps * 2,
                before,
            )
        return steps * 2

    def _recover(self, event: OOMEvent) -> None:
        """Makes the model ready to go on where `event` says."""
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
        optimizer = self.model.optimizer
        iterations = 0 if optimizer is None else optimizer.iterations.numpy()
        if epoch is None or epoch == self.first_epoch:
            state = "before training"
        else:
            state = f"at the end of epoch {epoch}"
        message = str(error)
        advice = message.find(_messages.OOM_ADVICE)
        if advice < 0:
            advice = len(message)
        where = (
            f"The model is as it was {state} (optimizer iterations "
            f"{int(iterations)}). "
        )
        return OutOfMemoryError(
            (message[:advice] + where + message[advice:]).strip(),
            error.tried_batch_sizes,
        )

    def _stop_all_workers(self, err, strategy) -> OutOfMemoryError:
        """Stores the smaller size with the backup, then stops the job."""
        before = self.train_sizes.batch_size
        after = None
        if self.decisions.directories and self.position.phase == "training":
            try:
                self._next_sizes(err)
            except OutOfMemoryError:
                pass  # Nothing smaller to store: stop all the same.
            else:
                after = self.train_sizes.batch_size
                self.decisions.store(
                    self.train_sizes, _accumulation_steps(self.model)
                )
        return distribute.stop_all_workers(
            err, before, strategy, resume_batch_size=after
        )


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


def _monitors_first(callbacks: list) -> list:
    """The callbacks, `MemoryMonitor`s first, the others in their order.

    Keras passes one `logs` dict down the list in order, so the callbacks
    after a monitor see its `memory_peak_mb` in their `on_epoch_end`.
    """
    return sorted(callbacks, key=lambda c: not isinstance(c, MemoryMonitor))


def _accumulation_steps(model) -> int | None:
    steps = getattr(model, "accumulation_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    return None


def _check_limits(min_batch_size, max_retries) -> None:
    _checks.integer("min_batch_size", min_batch_size, 1)
    if max_retries is not None:
        _checks.integer("max_retries", max_retries, 0)


def _check_start(min_batch_size: int, **sizes: int | None) -> None:
    """Refuses a batch size to start at that is below `min_batch_size`."""
    for name, size in sizes.items():
        if size is not None and size < min_batch_size:
            raise ValueError(
                f"`min_batch_size` must be <= `{name}`, the batch size to "
                f"start at. Received: min_batch_size={min_batch_size}, "
                f"{name}={size}"
            )
