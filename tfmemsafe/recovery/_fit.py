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

from collections.abc import Sequence

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe._sources import source_for
from tfmemsafe.history import FitHistory
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery._batch_search import find_max_batch_size
from tfmemsafe.recovery._planner import SizePlanner
from tfmemsafe.recovery._resume import PredictionProgress
from tfmemsafe.recovery._retry import Halving
from tfmemsafe.recovery._retry import RetryBudget
from tfmemsafe.recovery._retry import retry_on_oom
from tfmemsafe.recovery._runner import FitRun
from tfmemsafe.recovery._runner import FitSettings

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
    preflight: bool = True,
    memory_estimate: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    **fit_kwargs,
) -> FitHistory:
    """Trains a compiled model, halving the batch when memory runs out.

    Works like `model.fit`. When a step, or the validation at the end of an
    epoch, raises an out-of-memory error (`tfmemsafe.is_oom_error`), it:

    1. logs one line: the epoch, the step, the batch size before and after
       and the accumulation steps (see 3 for the size after);
    2. frees what it can: the failed iterator, the compiled train, test and
       predict functions (they are traced again at the new shapes), and
       Python garbage;
    3. halves the batch size of the phase that failed, or, when a memory
       estimate of the phase's step (`tfmemsafe.estimate_memory`, made
       now if not before) predicts that half still does not fit, jumps
       to the largest halving predicted to leave 10% of the device's
       limit free: one retry, not one per error. For an
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

    Before the first step (`preflight=True`), it estimates the training
    step's memory; when the batch size asked for is predicted not to fit,
    it starts at the largest halving predicted to fit, as recovery would
    (doubling `accumulation_steps`), logs one line and records an
    `OOMEvent` with `phase="preflight"`. Where the device keeps no memory
    statistics or its limit is unknown, or on a multi-worker job, there is
    no estimate and it halves once per error (docs/memory-estimate.md).

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
            start at. `"auto"` uses `find_max_batch_size` (and no
            pre-flight check: its size was tried). `None` means
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
        preflight: bool. Whether to estimate the training step's memory
            before the first step and start at a size predicted to fit.
            Defaults to `True`; it costs a few short training steps at
            small batch sizes (docs/benchmarks.md), and does nothing where
            no estimate can be made.
        memory_estimate: bool. Whether `fit` may estimate memory at all:
            the pre-flight check, and the jump after an error (with
            `False`, it halves once per error). Estimating runs the
            model's steps at small batches and puts back every variable
            the model tracks; turn it off for a model whose calls have
            effects outside its variables. Defaults to `True`.
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
    preflight = _checks.boolean("preflight", preflight)
    memory_estimate = _checks.boolean("memory_estimate", memory_estimate)
    if batch_size == "auto":
        batch_size = find_max_batch_size(
            model, data, memory_estimate=memory_estimate
        )
        logging.info("tfmemsafe.fit: batch_size='auto' chose %d.", batch_size)
        preflight = False
    other_arguments = dict(fit_kwargs)
    settings = FitSettings(
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
        preflight=preflight,
        memory_estimate=memory_estimate,
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
    return FitRun(model, settings, _checks.callbacks(callbacks)).train()


def evaluate(
    model: keras.Model,
    data,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    memory_estimate: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    return_dict: bool = False,
):
    """Evaluates a compiled model, halving the batch when memory runs out.

    Like `model.evaluate`. An out-of-memory error starts the evaluation
    again from the first batch at half the batch size (and twice the
    `steps`), so the metrics always cover the whole data once; or, when a
    memory estimate of the evaluation step predicts that half does not
    fit either, at the largest halving predicted to fit (as in `fit`).

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
        memory_estimate: bool. Whether to estimate the step's memory
            after an error, to jump to a size predicted to fit. Defaults
            to `True`.
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
    callbacks = monitors_first(_checks.callbacks(callbacks))

    def attempt():
        return model.evaluate(
            **source.keras_arguments(sizes.batch_size),
            steps=sizes.scaled_steps(steps),
            callbacks=callbacks,
            verbose=verbose,
            return_dict=return_dict,
        )

    planner = _planner(model, "tfmemsafe.evaluate", memory_estimate)

    def recover(batch_size_before: int) -> None:
        _jump(planner, sizes, source)
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
    memory_estimate: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
):
    """Predicts with a model, halving the batch when memory runs out.

    Like `model.predict`, and it returns every sample once, in order, even
    when it had to halve midway: the batches finished before an
    out-of-memory error are kept (moved to host memory), and prediction
    goes on from the first sample that was not finished (at half the
    batch size, or at the largest halving a memory estimate of the
    prediction step predicts to fit, as in `fit`). A dataset or a
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
        memory_estimate: bool. Whether to estimate the step's memory
            after an error, to jump to a size predicted to fit. Defaults
            to `True`.
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
    callbacks = monitors_first([progress, *_checks.callbacks(callbacks)])

    def attempt():
        outputs = model.predict(
            **source.keras_arguments(sizes.batch_size, skip=progress.rows_done),
            callbacks=callbacks,
            verbose=verbose,
        )
        return progress.all_outputs(outputs)

    planner = _planner(model, "tfmemsafe.predict", memory_estimate)

    def recover(batch_size_before: int):
        progress.keep_finished()
        if not progress.ended:
            _jump(planner, sizes, source)
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


def _planner(model, caller: str, memory_estimate) -> SizePlanner | None:
    if _checks.boolean("memory_estimate", memory_estimate):
        return SizePlanner(model, caller)
    return None


def _jump(planner: SizePlanner | None, sizes: Halving, source) -> None:
    """Halves `sizes` further to the largest halving predicted to fit."""
    if planner is not None:
        sizes.shrink(planner.halvings_after_error(sizes, source))


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
