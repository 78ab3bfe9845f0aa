"""Training, evaluation and prediction that survive running out of memory.

`fit` trains a compiled Keras model like `model.fit`, but when a batch does
not fit in device memory it halves the batch size (doubling an
`AccumulatingModel`'s `accumulation_steps`, so each update still averages
the same number of samples), puts back the weights and optimizer state of
the start of the failed epoch and carries on from that epoch. `evaluate`
and `predict` halve the same way. Every out-of-memory error takes one path,
`_halving.retry_on_oom`; the data kinds are in `_sources`, what a run
keeps to resume in `_resume`, and `find_max_batch_size` in `batch_search`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe import distribute
from tfmemsafe._halving import Halving
from tfmemsafe._halving import RetryBudget
from tfmemsafe._halving import retry_on_oom
from tfmemsafe._resume import EpochStart
from tfmemsafe._resume import Position
from tfmemsafe._resume import PredictionProgress
from tfmemsafe._resume import ResumableCallbackList
from tfmemsafe._resume import forget_epoch
from tfmemsafe._sources import Source
from tfmemsafe._sources import source_for
from tfmemsafe.batch_search import find_max_batch_size
from tfmemsafe.callbacks import MemoryMonitor
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
    4. restores the weights and optimizer state saved in memory at the
       start of the failed epoch, so no part of it is applied twice, and
       resumes at that epoch.

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
            `min_batch_size`, or `max_retries` is used up. The original
            error is chained as `__cause__`.
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
    """

    def __init__(self, model, settings: _FitSettings, callbacks: list):
        self.model = model
        self.settings = settings
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
        if settings.validation_source is not None:
            size = settings.validation_batch_size
            if size is None:
                size = settings.validation_source.batch_size
            self.validation_follows_training = size is None
            self.validation_sizes = Halving(
                "validation",
                size or settings.batch_size,
                model=model,
                min_batch_size=settings.min_batch_size,
                budget=budget,
            )
        self.warned_effective_batch = False
        self.resume_epoch = settings.initial_epoch
        self.position = Position(settings.initial_epoch)
        self.epoch_start = EpochStart()
        self.history = _fit_history(callbacks)
        others = [c for c in callbacks if c is not self.history]
        self.callbacks = ResumableCallbackList(
            _monitors_first(
                [self.position, self.epoch_start, *others, self.history]
            ),
            add_progbar=settings.verbose != 0,
            model=model,
        )

    def train(self) -> FitHistory:
        retry_on_oom(self.model, self._attempt, self._on_oom, self._recover)
        self.history.batch_size = self.train_sizes.batch_size
        return self.history

    def _attempt(self) -> None:
        settings = self.settings
        source = settings.train_source
        arguments = {**source.fit_defaults(), **settings.other_arguments}
        arguments.update(source.keras_arguments(self.train_sizes.batch_size))
        steps = self.train_sizes.scaled_steps(settings.steps_per_epoch)
        self.callbacks.set_params(
            {
                "verbose": settings.verbose,
                "epochs": settings.epochs,
                "steps": steps or source.num_batches(arguments),
            }
        )
        if settings.validation_source is not None:
            arguments.update(
                settings.validation_source.validation_arguments(
                    self.validation_sizes.batch_size
                ),
                validation_steps=self.validation_sizes.scaled_steps(
                    settings.validation_steps
                ),
            )
        self.model.fit(
            **arguments,
            epochs=settings.epochs,
            initial_epoch=self.resume_epoch,
            steps_per_epoch=steps,
            callbacks=self.callbacks,
            verbose=settings.verbose,
        )

    def _on_oom(self, err: BaseException) -> OOMEvent:
        """Halves the failed phase's batch, or raises OutOfMemoryError."""
        strategy = self.model.distribute_strategy
        if distribute.is_multi_worker(strategy):
            raise distribute.stop_all_workers(
                err, self.train_sizes.batch_size, strategy
            ) from err
        phase = self.position.phase
        sizes = (
            self.validation_sizes if phase == "validation" else self.train_sizes
        )
        before = sizes.halve(err)
        accumulation_steps = _accumulation_steps(self.model)
        if phase == "training":
            if self.validation_follows_training:
                self.validation_sizes.follow(self.train_sizes)
            accumulation_steps = self._keep_effective_batch(
                before, accumulation_steps
            )
        else:
            self.validation_follows_training = False
        event = OOMEvent(
            epoch=self.position.epoch,
            step=self.position.step,
            phase=phase,
            batch_size_before=before,
            batch_size_after=sizes.batch_size,
            accumulation_steps=accumulation_steps,
            error=_messages.error_line(err),
        )
        self.history.oom_events.append(event)
        return event

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
        """Makes the model ready to go on at the start of the failed epoch."""
        self.callbacks.abandon_attempt()
        self.epoch_start.restore()
        forget_epoch(self.history, event.epoch, self.position.epoch_end_keys)
        self.position.abandon_attempt()
        # `BackupAndRestore` sets this private attribute in `on_train_begin`,
        # and `fit` would prefer it to our `initial_epoch`.
        self.model._initial_epoch = None
        self.resume_epoch = event.epoch
        logging.warning(
            "tfmemsafe.fit: out of memory in epoch %d/%d, %s step %d: batch "
            "size %d -> %d%s. Resuming at the start of epoch %d.",
            event.epoch + 1,
            self.settings.epochs,
            event.phase,
            event.step,
            event.batch_size_before,
            event.batch_size_after,
            ""
            if event.accumulation_steps is None
            else f", accumulation steps {event.accumulation_steps}",
            event.epoch + 1,
        )


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
