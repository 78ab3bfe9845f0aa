"""Training, evaluation and prediction that survive running out of memory.

`fit` trains a compiled Keras model like `model.fit`, but when a batch does
not fit in device memory it halves the batch size (doubling an
`AccumulatingModel`'s `accumulation_steps`, so each update still averages
the same number of samples), puts back the weights and optimizer state of
the start of the failed epoch and carries on from that epoch. `evaluate`
and `predict` halve the same way. `find_max_batch_size` measures the
largest batch that trains with some memory to spare.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe import _step_guard
from tfmemsafe import accumulation
from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe.errors import OutOfMemoryError

# Keras' default batch size, used for arrays and unbatched datasets.
_DEFAULT_BATCH_SIZE = 32
_DEFAULT_MAX_BATCH_SIZE = 4096
# `tf.data` transformations that batch or unbatch their input, by class.
_BATCHING = (
    "_BatchDataset",
    "_PaddedBatchDataset",
    "_ParallelBatchDataset",
    "_RebatchDataset",
)
_UNBATCHING = ("_UnbatchDataset",)
# Where a stopped multi-worker job stores the batch size to go on with,
# next to `BackupAndRestore`'s files (which it deletes with them).
_DECISION_FILE = "tfmemsafe_batch_size.json"
# `model.fit` arguments that `tfmemsafe.fit` takes in its own way.
_DATA_ARGUMENTS = ("x", "y", "sample_weight")


@dataclasses.dataclass(frozen=True)
class OOMEvent:
    """An out-of-memory error that `tfmemsafe.fit` recovered from.

    Attributes:
        epoch: int. The epoch that failed, counted from 0 as Keras
            callbacks count; training resumed at its start.
        step: int. The batch within the epoch (or within its validation)
            that was running.
        phase: str. `"training"` or `"validation"`.
        batch_size_before: int. The batch size that ran out of memory.
        batch_size_after: int. The batch size used from then on.
        accumulation_steps: int or `None`. The model's
            `accumulation_steps` after recovery; `None` for a model
            without gradient accumulation.
        error: str. The line of the error that says what ran out.
        resumed_at_step: int or `None`. The step of the epoch (or of its
            validation) that training resumed at, counted in batches of
            any size; `None` when the epoch started again from its first
            step (see docs/oom-recovery.md for when).
    """

    epoch: int
    step: int
    phase: str
    batch_size_before: int
    batch_size_after: int
    accumulation_steps: int | None
    error: str
    resumed_at_step: int | None = None


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
) -> keras.callbacks.History:
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
            attempt.
        verbose: `"auto"`, 0, 1 or 2, as in `model.fit`.
        **fit_kwargs: Other `model.fit` arguments (`initial_epoch`,
            `steps_per_epoch`, `validation_batch_size`, `validation_steps`,
            `validation_freq`, `shuffle`, `class_weight`, ...).

    Returns:
        A `keras.callbacks.History` with one entry per completed epoch
        across all attempts, plus `oom_events` (a list of `OOMEvent`) and
        `batch_size` (the training batch size at the end).

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
    train = _Data(data, "data", labelled=True)
    validation = None
    if validation_data is not None:
        validation = _Data(validation_data, "validation_data", labelled=True)
    if batch_size == "auto":
        batch_size = _search_max_batch_size(
            model, train, _DEFAULT_BATCH_SIZE, _DEFAULT_MAX_BATCH_SIZE, 2, 0.1
        )
        logging.info("tfmemsafe.fit: batch_size='auto' chose %d.", batch_size)
    # The epoch snapshot builds the optimizer: the model's variables must
    # all exist by then (a subclassed model creates them in its first call).
    _ensure_built(model, train)
    run = _FitRun(
        model,
        train,
        validation,
        batch_size=train.resolve_batch_size(batch_size, "batch_size"),
        epochs=epochs,
        min_batch_size=min_batch_size,
        keep_effective_batch_size=keep_effective_batch_size,
        max_retries=max_retries,
        callbacks=_checks.callbacks(callbacks),
        verbose=verbose,
        fit_kwargs=fit_kwargs,
    )
    return run.train()


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
    source = _Data(data, "data", labelled=True)
    halving = _Halving.start(
        "evaluation", model, source, batch_size, min_batch_size
    )
    callbacks = _checks.callbacks(callbacks)
    while True:
        size = halving.batch_size
        try:
            return model.evaluate(
                **source.keras_arguments(size),
                steps=_scaled(steps, halving),
                callbacks=callbacks,
                verbose=verbose,
                return_dict=return_dict,
            )
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            halving.halve(err, max_retries, halving.retries)
        logging.warning(
            "tfmemsafe.evaluate: out of memory at batch size %d; starting "
            "again at %d.",
            size,
            halving.batch_size,
        )
        _release(model)


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
    source = _Data(data, "data", labelled=False)
    halving = _Halving.start(
        "prediction", model, source, batch_size, min_batch_size
    )
    collector = _OutputCollector()
    callbacks = [collector, *_checks.callbacks(callbacks)]
    finished = []  # Outputs of the batches done before each failure.
    done = 0
    while True:
        size = halving.batch_size
        collector.outputs = []
        try:
            outputs = model.predict(
                **source.keras_arguments(size, skip=done),
                callbacks=callbacks,
                verbose=verbose,
            )
            break
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            halving.halve(err, max_retries, halving.retries)
        # Host copies, so the device memory of the finished batches is free.
        kept = [
            keras.tree.map_structure(np.asarray, o) for o in collector.outputs
        ]
        collector.outputs = []
        done += sum(_num_rows(o) for o in kept)
        finished.extend(kept)
        logging.warning(
            "tfmemsafe.predict: out of memory at batch size %d after %d "
            "samples; going on at %d.",
            size,
            done,
            halving.batch_size,
        )
        _release(model)
        if collector.ended:  # Every batch was done; what failed came after.
            return _concatenate(finished)
    if not finished:
        return outputs
    return _concatenate([*finished, outputs])


def find_max_batch_size(
    model: keras.Model,
    data,
    *,
    start: int = _DEFAULT_BATCH_SIZE,
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
    steps_per_trial: int = 2,
    headroom: float = 0.1,
) -> int:
    """Finds the largest batch size that trains with memory to spare.

    Trains `steps_per_trial` steps at `start`, then at twice that, and so
    on, until a size runs out of memory, or its peak memory (read with
    `tfmemsafe.memory_info`) leaves less than `headroom` of the device's
    limit free, or `max_batch_size` (or the number of samples) is reached.
    It then bisects between the last good and the first bad size, to
    within an eighth of the good one: each trial that runs out of memory
    costs about ten seconds, the time the allocator waits for memory to
    be freed before it gives up. If `start` is already bad, it halves
    down first.

    The model's weights, optimizer state (including the iteration count
    and a `LossScaleOptimizer`'s scale) and random-seed state are put back
    exactly as they were found; the compiled functions are dropped.

    Without memory statistics (a CPU without `TF_CPU_ALLOCATOR_USE_BFC`)
    only out-of-memory errors and `max_batch_size` bound the search.

    Args:
        model: A compiled `keras.Model`.
        data: Training data of any kind `tfmemsafe.fit` accepts.
        start: int. The first batch size to try. Defaults to 32.
        max_batch_size: int. The largest batch size to try. Defaults to
            4096.
        steps_per_trial: int. Training steps per batch size tried.
            Defaults to 2.
        headroom: float. The fraction of the memory limit that must stay
            free at the peak, in [0, 1). Defaults to 0.1.

    Returns:
        The largest good batch size found.

    Raises:
        OutOfMemoryError: If not even a batch of one fits.

    Example:
    >>> tfmemsafe.find_max_batch_size(model, (x, y), start=64)
    448
    """
    _checks.compiled_model(model, "find_max_batch_size")
    _checks.integer("start", start, 1)
    _checks.integer("max_batch_size", max_batch_size, 1)
    _checks.integer("steps_per_trial", steps_per_trial, 1)
    _checks.fraction("headroom", headroom)
    source = _Data(data, "data", labelled=True)
    return _search_max_batch_size(
        model, source, start, max_batch_size, steps_per_trial, headroom
    )


class _Data:
    """The user's data, in one of the accepted kinds, at any batch size."""

    def __init__(self, data, argument: str, *, labelled: bool):
        self.argument = argument
        self.data = data
        self.batch_size = None  # The size a batched dataset comes in.
        if isinstance(data, tf.data.Dataset):
            batched, self.batch_size = _batching_of(data)
            self.kind = "batched" if batched else "unbatched"
        elif callable(data):
            self.kind = "callable"
        elif labelled and _is_labelled_arrays(data):
            self.kind = "arrays"
        elif not labelled and _is_arrays(data):
            self.kind = "arrays"
        else:
            arrays = "(x, y) or (x, y, sample_weight)" if labelled else "x"
            raise TypeError(
                f"`{argument}` must be a callable `batch_size -> "
                "tf.data.Dataset`, a tf.data.Dataset, or arrays "
                f"{arrays}. Received: {argument}={data!r:.80} of type "
                f"{type(data).__name__}"
            )
        self._labelled = labelled

    def resolve_batch_size(self, batch_size, argument: str) -> int:
        if batch_size is None:
            if self.kind == "callable":
                raise ValueError(
                    f"`{argument}` is required when `{self.argument}` is a "
                    "callable: it is the size your pipeline is built at. "
                    f"Received: {argument}=None"
                )
            if self.kind == "batched" and self.batch_size is None:
                raise ValueError(
                    f"`{argument}` is required: the batch size of "
                    f"`{self.argument}` could not be read from its "
                    f"pipeline. Received: {argument}=None"
                )
            return self.batch_size or _DEFAULT_BATCH_SIZE
        return _checks.integer(argument, batch_size, 1)

    @property
    def num_samples(self) -> int | None:
        if self.kind == "arrays":
            x = self.data[0] if self._labelled else self.data
            return _num_rows(x)
        if self.kind == "unbatched":
            cardinality = int(self.data.cardinality())
            return cardinality if cardinality >= 0 else None
        return None

    def dataset(self, batch_size: int, *, repeat: bool = False):
        """The data as a dataset of batches of `batch_size`."""
        if self.kind == "callable":
            dataset = self.data(batch_size)
            if not isinstance(dataset, tf.data.Dataset):
                raise TypeError(
                    f"`{self.argument}` must return a tf.data.Dataset when "
                    f"called with a batch size. Received: "
                    f"{self.argument}({batch_size}) = {dataset!r:.80}"
                )
            return dataset.repeat() if repeat else dataset
        dataset = self.data.repeat() if repeat else self.data
        if self.kind == "unbatched":
            dataset = dataset.batch(batch_size)
        elif batch_size != self.batch_size or repeat:
            dataset = dataset.rebatch(batch_size)
            rows = None if repeat else _rows_of_batched(self.data)
            if rows is not None:
                # `rebatch` hides the length; Keras shows it in the
                # progress bar and stops the epoch by it.
                dataset = dataset.apply(
                    tf.data.experimental.assert_cardinality(
                        math.ceil(rows / batch_size)
                    )
                )
        else:
            return dataset  # The user's pipeline, as it is.
        return dataset.prefetch(tf.data.AUTOTUNE)

    def keras_arguments(
        self, batch_size: int, skip: int = 0, order=None
    ) -> dict:
        """Arguments for `model.fit/evaluate/predict`, from sample `skip`.

        `order`, for arrays, is the permutation of the rows to train in.
        """
        if self.kind == "arrays":

            def rows(a):
                if a is None:
                    return None
                return (a if order is None else a[order])[skip:]

            if not self._labelled:
                x = keras.tree.map_structure(rows, self.data)
                return {"x": x, "batch_size": batch_size}
            x, y, sample_weight = [
                None if part is None else keras.tree.map_structure(rows, part)
                for part in (*self.data, None)[:3]
            ]
            return {
                "x": x,
                "y": y,
                "sample_weight": sample_weight,
                "batch_size": batch_size,
            }
        dataset = self.dataset(batch_size)
        if skip and skip % batch_size == 0:
            dataset = dataset.skip(skip // batch_size)
        elif skip:
            dataset = dataset.unbatch().skip(skip).batch(batch_size)
        return {"x": dataset}

    def split(self, fraction: float) -> tuple[_Data, _Data]:
        """Arrays split as Keras' `validation_split` does: the last rows."""
        rows = self.num_samples
        cut = int(math.floor(rows * (1.0 - fraction)))

        def part(rows_slice):
            return tuple(
                None
                if p is None
                else keras.tree.map_structure(lambda a: a[rows_slice], p)
                for p in self.data
            )

        return (
            _Data(part(slice(None, cut)), self.argument, labelled=True),
            _Data(part(slice(cut, None)), self.argument, labelled=True),
        )

    def position_is_reproducible(self, batch_size: int) -> bool:
        """Whether the data gives the same samples in the same order again.

        Arrays do (tfmemsafe owns their shuffling); a dataset does unless
        it shuffles without a fixed seed and order, or lets `tf.data`
        trade order for speed.
        """
        if self.kind == "arrays":
            return True
        if self.kind == "callable":
            # A shuffle is only the same in a new pipeline if its seeds are
            # the user's, not drawn anew at each build.
            first, second = (self.dataset(batch_size) for _ in range(2))
            seeds = _shuffle_seeds(first)
            return (
                _is_deterministic(first)
                and seeds == _shuffle_seeds(second)
                and (0, 0) not in seeds  # (0, 0): drawn when it runs.
            )
        return _is_deterministic(self.data)

    def validation_arguments(self, batch_size: int) -> dict:
        if self.kind == "arrays":
            return {
                "validation_data": tuple(self.data),
                "validation_batch_size": batch_size,
            }
        return {"validation_data": self.dataset(batch_size)}

    def trial_arguments(self, batch_size: int, steps: int) -> dict:
        """Arguments for `model.fit` to train `steps` full batches.

        The whole arrays are passed, not a slice: Keras holds them in
        device memory, and the trial must need what training will.
        """
        if self.kind == "arrays":
            arguments = self.keras_arguments(batch_size)
            arguments.update(shuffle=False, steps_per_epoch=steps)
            return arguments
        return {
            "x": self.dataset(batch_size, repeat=True).take(steps),
            "shuffle": False,
        }

    def num_batches(self, arguments: dict) -> int | None:
        """The batches per epoch of `keras_arguments`, if known."""
        if self.kind == "arrays":
            split = arguments.get("validation_split") or 0.0
            rows = _num_rows(arguments["x"])  # The rest, when resumed.
            rows = math.floor(rows * (1.0 - split))
            return math.ceil(rows / arguments["batch_size"])
        cardinality = int(arguments["x"].cardinality())
        return cardinality if cardinality >= 0 else None


class _FitRun:
    """One `tfmemsafe.fit` call: its attempts, and recovery between them.

    Each epoch is one `model.fit` call (the callbacks see one run), so
    that each epoch can be given its own data: the epoch's shuffled order
    of arrays, or, after an out-of-memory error at step k, the samples
    from step k on at the new batch size.
    """

    def __init__(
        self,
        model,
        train,
        validation,
        *,
        batch_size,
        epochs,
        min_batch_size,
        keep_effective_batch_size,
        max_retries,
        callbacks,
        verbose,
        fit_kwargs,
    ):
        self.model = model
        self.fit_kwargs = dict(fit_kwargs)
        split = self.fit_kwargs.pop("validation_split", None)
        if split and train.kind == "arrays" and validation is None:
            # Split once, as Keras does (the last rows), so that slicing
            # an epoch's rest never splits again.
            train, validation = train.split(split)
        elif split:
            self.fit_kwargs["validation_split"] = split
        self.train_data = train
        self.validation_data = validation
        self.epochs = epochs
        self.keep_effective_batch_size = keep_effective_batch_size
        self.max_retries = max_retries
        self.verbose = verbose
        self.initial_epoch = self.fit_kwargs.pop("initial_epoch", 0)
        self.steps_per_epoch = self.fit_kwargs.pop("steps_per_epoch", None)
        self.validation_steps = self.fit_kwargs.pop("validation_steps", None)
        self.shuffle = self.fit_kwargs.pop("shuffle", True)
        # The seed of tfmemsafe's own shuffling of arrays, drawn from the
        # global NumPy generator that `keras.utils.set_random_seed` seeds.
        self.seed = int(np.random.randint(2**31))
        validation_batch_size = self.fit_kwargs.pop(
            "validation_batch_size", None
        )
        floor = _batch_floor(model, min_batch_size)
        self.training = _Halving("training", batch_size, floor, min_batch_size)
        self.validation = None
        if validation is not None:
            if validation_batch_size is None and validation.kind == "batched":
                validation_batch_size = validation.batch_size
            # Without a size of its own, validation follows training.
            self.validation_follows_training = validation_batch_size is None
            self.validation = _Halving(
                "validation",
                validation_batch_size or batch_size,
                floor,
                min_batch_size,
            )
        self.events = []
        self.warned_effective_batch = False
        self.backup_dirs = [
            c.backup_dir
            for c in callbacks
            if isinstance(c, keras.callbacks.BackupAndRestore)
        ]
        self._load_decision()
        self.tracker = _Tracker(self.initial_epoch)
        self.history = (
            next(
                (
                    c
                    for c in callbacks
                    if isinstance(c, keras.callbacks.History)
                ),
                None,
            )
            or keras.callbacks.History()
        )
        user = [c for c in callbacks if c is not self.history]
        self.callbacks = _ResumableCallbackList(
            [self.tracker, *user, self.history],
            add_progbar=verbose != 0,
            model=model,
        )

    def train(self) -> keras.callbacks.History:
        guard = _step_guard.StepGuard(
            self.model,
            _optimizers(self.model),
            _gradient_accumulators(self.model),
        )
        self.tracker.guard = guard
        try:
            self._train()
        finally:
            guard.close()
        self.history.oom_events = self.events
        self.history.batch_size = self.training.batch_size
        return self.history

    def _train(self) -> None:
        epoch = self._begin()
        skip, validation_skip = 0, None
        while True:
            try:
                if validation_skip is not None:
                    self._finish_validation(epoch, validation_skip)
                    epoch, skip, validation_skip = epoch + 1, 0, None
                    if self.model.stop_training:
                        break
                self._attempt(epoch, skip)
                break
            except Exception as err:
                if not memory.is_oom_error(err):
                    raise
                strategy = self.model.distribute_strategy
                if distribute.is_multi_worker(strategy):
                    raise self._stop_all_workers(err, strategy) from err
                try:
                    event = self._next_sizes(err)
                except OutOfMemoryError as gave_up:
                    raise self._give_up(gave_up) from err
            # Out of the `except` block the failed attempt's frames, and
            # the tensors they hold, can be freed.
            epoch, skip, validation_skip = self._recover(event)
        self.callbacks.end_run(self.tracker.last_logs)

    def _stop_all_workers(self, err, strategy) -> OutOfMemoryError:
        """Stores the smaller size with the backup, then stops the job."""
        before = self.training.batch_size
        after = None
        if self.backup_dirs and self.tracker.phase == "training":
            try:
                self._next_sizes(err)
            except OutOfMemoryError:
                pass  # Nothing smaller to store: stop all the same.
            else:
                after = self.training.batch_size
                self._store_decision()
        return distribute.stop_all_workers(
            err, before, strategy, resume_batch_size=after
        )

    def _store_decision(self) -> None:
        """Writes the batch size and accumulation steps to go on with.

        Every worker writes the same content (atomically), so it is there
        whichever of them learnt of the error.
        """
        decision = {
            "requested_batch_size": self.training.tried[0],
            "tried": self.training.tried,
            "accumulation_steps": _accumulation_steps(self.model),
        }
        for directory in self.backup_dirs:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, _DECISION_FILE)
            temporary = f"{path}.{distribute.worker_index()}.tmp"
            with open(temporary, "w") as f:
                json.dump(decision, f)
            os.replace(temporary, path)

    def _load_decision(self) -> None:
        """Goes on at the size a stopped multi-worker job stored."""
        for directory in self.backup_dirs:
            path = os.path.join(directory, _DECISION_FILE)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                decision = json.load(f)
            if decision["requested_batch_size"] != self.training.tried[0]:
                logging.warning(
                    "tfmemsafe.fit: ignoring the batch size stored in %s, "
                    "which was decided for batch_size=%d: this run asks "
                    "for %d.",
                    path,
                    decision["requested_batch_size"],
                    self.training.tried[0],
                )
                return
            self.training.tried = list(decision["tried"])
            steps = decision["accumulation_steps"]
            if steps is not None and _accumulation_steps(self.model):
                self.model.accumulation_steps = steps
            if self.validation is not None and self.validation_follows_training:
                self.validation.follow(self.training)
            logging.warning(
                "tfmemsafe.fit: resuming at batch size %d%s, as stored in "
                "%s after running out of memory at %d.",
                self.training.batch_size,
                "" if steps is None else f" x {steps} accumulation steps",
                path,
                self.training.tried[-2],
            )
            return

    def _begin(self) -> int:
        """Starts the run for the callbacks; returns the first epoch."""
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self.callbacks.set_params(self._params(None))
        self.callbacks.on_train_begin()
        # `BackupAndRestore` tells where it restored to.
        restored = getattr(self.model, "_initial_epoch", None)
        self.model._initial_epoch = None
        self.first_epoch = max(self.initial_epoch, restored or 0)
        return self.first_epoch

    def _params(self, steps) -> dict:
        return {"verbose": self.verbose, "epochs": self.epochs, "steps": steps}

    def _attempt(self, epoch: int, skip: int) -> None:
        """Trains from sample `skip` of `epoch` to the last epoch."""
        while epoch < self.epochs:
            self._fit_epoch(epoch, skip)
            skip = 0
            epoch += 1
            if self.model.stop_training:
                break

    def _fit_epoch(self, epoch: int, skip: int) -> None:
        arguments = dict(self.fit_kwargs)
        size = self.training.batch_size
        if self.train_data.kind == "arrays":
            order = None
            if self.shuffle:
                rows = self.train_data.num_samples
                order = np.random.default_rng([self.seed, epoch]).permutation(
                    rows
                )
            arguments.update(
                self.train_data.keras_arguments(size, skip, order=order)
            )
        else:
            arguments.update(self.train_data.keras_arguments(size, skip))
        # Keras ignores `shuffle` for datasets (and warns when it is
        # True); the order of arrays is shuffled here.
        arguments["shuffle"] = False
        steps = _scaled(self.steps_per_epoch, self.training)
        done = self.tracker.steps_done if skip else 0
        known = self.train_data.num_batches(arguments)
        self.callbacks.set_params(
            self._params(done + (steps or known) if (steps or known) else None)
        )
        if self.validation_data is not None:
            arguments.update(
                self.validation_data.validation_arguments(
                    self.validation.batch_size
                ),
                validation_steps=_scaled(
                    self.validation_steps, self.validation
                ),
            )
        self.tracker.start_epoch(epoch, skip, size)
        if self.validation is not None:
            self.tracker.start_validation(0, self.validation.batch_size)
        self.callbacks.resume_at(epoch if skip else None, done)
        try:
            self.model.fit(
                **arguments,
                epochs=epoch + 1,
                initial_epoch=epoch,
                steps_per_epoch=steps,
                callbacks=self.callbacks,
                verbose=self.verbose,
            )
        finally:
            self.callbacks.end_call()

    def _finish_validation(self, epoch: int, skip: int) -> None:
        """Runs the rest of `epoch`'s validation, then ends the epoch."""
        size = self.validation.batch_size
        self.tracker.start_validation(skip, size)
        self.callbacks.resume_validation_at(self.tracker.validation_steps_done)
        try:
            logs = self.model.evaluate(
                **self.validation_data.keras_arguments(size, skip),
                steps=_scaled(self.validation_steps, self.validation),
                callbacks=self.callbacks,
                return_dict=True,
                verbose=0,
            )
        finally:
            self.callbacks.end_call()
        epoch_logs = dict(self.tracker.train_logs)
        epoch_logs.update({f"val_{name}": v for name, v in logs.items()})
        self.callbacks.on_epoch_end(epoch, epoch_logs)

    def _next_sizes(self, err: BaseException) -> OOMEvent:
        """Halves the failed phase's batch, or raises OutOfMemoryError."""
        phase = self.tracker.phase
        halving = self.validation if phase == "validation" else self.training
        before = halving.batch_size
        ratio_before = _accumulation_steps(self.model)
        halving.halve(err, self.max_retries, len(self.events))
        accumulation_steps = _accumulation_steps(self.model)
        if phase == "training":
            if self.validation is not None and self.validation_follows_training:
                self.validation.follow(self.training)
            accumulation_steps = self._keep_effective_batch(
                before, accumulation_steps
            )
        else:
            self.validation_follows_training = False
        resumed_at_step = None
        if phase == "validation":
            # Training of the epoch is done: never replay it. Validation
            # goes on at its failed step, or starts again.
            resumed_at_step = 0
            if (
                self.validation_data.position_is_reproducible(
                    halving.batch_size
                )
                and self.validation_steps is None
            ):
                resumed_at_step = self.tracker.validation_steps_done
        elif self._can_resume(halving.batch_size):
            resumed_at_step = self.tracker.steps_done
            if ratio_before and accumulation_steps:
                _carry_partial_window(
                    self.model, accumulation_steps / ratio_before
                )
        event = OOMEvent(
            epoch=self.tracker.epoch,
            step=self.tracker.step,
            phase=phase,
            batch_size_before=before,
            batch_size_after=halving.batch_size,
            accumulation_steps=accumulation_steps,
            error=_messages.error_line(err),
            resumed_at_step=resumed_at_step,
        )
        self.events.append(event)
        return event

    def _can_resume(self, batch_size: int) -> bool:
        """Whether training can go on at the failed step (see the docs)."""
        if self.tracker.ending:
            self.resume_refusal = "it came after the epoch's last step"
        elif self.tracker.guard.touched():
            self.resume_refusal = "an update had begun when memory ran out"
        elif self.steps_per_epoch is not None:
            self.resume_refusal = "`steps_per_epoch` is set"
        elif not self.train_data.position_is_reproducible(batch_size):
            self.resume_refusal = (
                "the data does not give the same order again (shuffled "
                "without a fixed seed, or not deterministic)"
            )
        else:
            return True
        return False

    def _keep_effective_batch(self, before: int, steps: int | None):
        after = self.training.batch_size
        if not self.keep_effective_batch_size:
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

    def _recover(self, event: OOMEvent) -> tuple[int, int, int | None]:
        """Makes the model ready to go on.

        Returns:
            The epoch, the training sample and the validation sample (or
            `None`) to go on from.
        """
        self.callbacks.abandon_attempt()
        _release(self.model)
        guard = self.tracker.guard
        skip, validation_skip = 0, None
        if event.phase == "validation":
            validation_skip = 0
            where = f"the start of the validation of epoch {event.epoch + 1}"
            if event.resumed_at_step:
                guard.restore_small_state()
                self.tracker.carry_metrics()
                validation_skip = self.tracker.validation_samples_done
                where = (
                    f"validation step {event.resumed_at_step} of epoch "
                    f"{event.epoch + 1}"
                )
        elif event.resumed_at_step is not None:
            # Only what the failed step's forward pass changed: metrics,
            # moving statistics, seeds.
            guard.restore_small_state()
            self.tracker.carry_metrics()
            skip = self.tracker.samples_done
            where = f"step {event.resumed_at_step} of epoch {event.epoch + 1}"
        else:
            if self.tracker.snapshot is not None:
                self.tracker.snapshot.restore()
            _forget_epoch(
                self.history, event.epoch, self.tracker.epoch_end_keys
            )
            where = f"the start of epoch {event.epoch + 1}"
            if event.phase == "training":
                where += f" ({self.resume_refusal})"
        self.tracker.phase = "training"
        # `BackupAndRestore` sets this in `on_train_begin`, and `fit` would
        # prefer it to our `initial_epoch`.
        self.model._initial_epoch = None
        accumulation = (
            ""
            if event.accumulation_steps is None
            else f", accumulation steps {event.accumulation_steps}"
        )
        logging.warning(
            "tfmemsafe.fit: out of memory in epoch %d/%d, %s step %d: batch "
            "size %d -> %d%s. Resuming at %s.",
            event.epoch + 1,
            self.epochs,
            event.phase,
            event.step,
            event.batch_size_before,
            event.batch_size_after,
            accumulation,
            where,
        )
        return event.epoch, skip, validation_skip

    def _give_up(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """Puts back the last completed epoch's state; says so."""
        self.callbacks.abandon_attempt()
        _release(self.model)
        snapshot = self.tracker.snapshot
        if snapshot is not None:
            snapshot.restore()
        epoch = self.tracker.snapshot_epoch
        iterations = (
            int(self.model.optimizer.iterations.numpy())
            if self.model.optimizer is not None
            else 0
        )
        if snapshot is None or epoch == self.first_epoch:
            state = "before training"
        else:
            state = f"at the end of epoch {epoch}"
        message = str(error)
        advice = message.find(_messages.OOM_ADVICE)
        if advice < 0:
            advice = len(message)
        where = (
            f"The model is as it was {state} (optimizer iterations "
            f"{iterations}). "
        )
        return OutOfMemoryError(
            (message[:advice] + where + message[advice:]).strip(),
            error.tried_batch_sizes,
        )


class _Halving:
    """The batch sizes of one phase, and when to stop halving them."""

    def __init__(self, phase, batch_size, floor, min_batch_size):
        self.phase = phase
        self.tried = [batch_size]
        self.floor = floor
        self.min_batch_size = min_batch_size

    @classmethod
    def start(cls, phase, model, source, batch_size, min_batch_size):
        return cls(
            phase,
            source.resolve_batch_size(batch_size, "batch_size"),
            _batch_floor(model, min_batch_size),
            min_batch_size,
        )

    @property
    def batch_size(self) -> int:
        return self.tried[-1]

    @property
    def retries(self) -> int:
        return len(self.tried) - 1

    @property
    def ratio(self) -> float:
        return self.tried[0] / self.tried[-1]

    def follow(self, other: _Halving) -> None:
        self.tried.append(other.batch_size)

    def halve(self, err, max_retries: int | None, retries: int) -> None:
        """Halves the batch size, or raises OutOfMemoryError from `err`."""
        size = self.batch_size
        if max_retries is not None and retries >= max_retries:
            reason = "`max_retries` is used up"
        elif size // 2 < self.floor:
            reason = (
                f"half of it would be below `min_batch_size`="
                f"{self.min_batch_size}"
                if self.floor == self.min_batch_size
                else f"half of it would leave a replica with no sample "
                f"(the global batch must be >= {self.floor})"
            )
        else:
            self.tried.append(size // 2)
            return
        raise OutOfMemoryError(
            f"Could not fit a {self.phase} batch of {size} after trying "
            f"{_messages.format_sizes(self.tried)}, and {reason}. "
            f"{_messages.OOM_ADVICE}",
            self.tried,
        ) from err


class _Snapshot:
    """Host copies of a model's variables and its optimizers', to put back.

    The optimizers are the compiled one and any the model holds as
    attributes (a GAN's `generator_optimizer`, say). Copies are per
    variable, so under `tf.distribute` a mirrored variable is read once
    and assigned back to every replica.
    """

    def __init__(self, model: keras.Model):
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            # Its variables must exist to be saved (and restored to zeros).
            # Only the compiled optimizer is known to update exactly the
            # model's trainable variables; others are saved as they are.
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        optimizers = _optimizers(model)
        variables = list(model.variables)
        for each in optimizers:
            variables += each.variables
        self.model = model
        self.unbuilt = [each for each in optimizers if not each.built]
        self.variables = list({id(v): v for v in variables}.values())
        self.values = [np.array(v.numpy(), copy=True) for v in self.variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)
        for optimizer in self.unbuilt:
            if optimizer.built:
                logging.warning(
                    "tfmemsafe: optimizer %r of %s was built after its "
                    "state was saved, so what it gathered since (such as "
                    "Adam's moments) is kept, not rewound. Build it in "
                    "`compile`.",
                    optimizer.name,
                    self.model.name,
                )
        self.unbuilt = [each for each in self.unbuilt if not each.built]
        # An `AccumulatingModel`'s partial window is state too; at the start
        # of an epoch it is empty.
        for accumulator in _gradient_accumulators(self.model):
            accumulator.reset()


class _Tracker(keras.callbacks.Callback):
    """Knows where training is, and keeps what resuming there needs.

    Per epoch: the state the epoch starts with (an `_Snapshot`, for the
    cases that must start the epoch again), and how many steps and
    samples are done. Per step, through the `StepGuard`: a device-side
    copy of the small state the step can change. After a failure, the
    metric values to carry into the resumed epoch.
    """

    def __init__(self, initial_epoch: int):
        super().__init__()
        self.epoch = initial_epoch
        self.step = 0
        self.phase = "training"
        self.guard = None
        self.snapshot = None
        self.snapshot_epoch = None
        self.epoch_end_keys = ()
        self.steps_done = 0
        self.samples_done = 0
        self.last_logs = None
        self._call_start = (0, 0)
        self._batch_size = None
        self._resuming = False
        self._carried = None
        self.ending = False
        self.train_logs = {}
        self.validation_steps_done = 0
        self.validation_samples_done = 0
        self._validation_start = (0, 0)
        self._validation_batch_size = None
        self._resuming_validation = False

    def start_epoch(self, epoch: int, skip: int, batch_size: int) -> None:
        """Called before each `model.fit` call, for one epoch."""
        self._resuming = bool(skip)
        if not skip:
            self.steps_done = self.samples_done = 0
        self._call_start = (self.steps_done, self.samples_done)
        self._batch_size = batch_size

    def start_validation(self, skip: int, batch_size: int) -> None:
        """Called before an epoch's validation is resumed at sample `skip`."""
        self._resuming_validation = bool(skip)
        if not skip:
            self.validation_steps_done = self.validation_samples_done = 0
        self._validation_start = (
            self.validation_steps_done,
            self.validation_samples_done,
        )
        self._validation_batch_size = batch_size

    def carry_metrics(self) -> None:
        self._carried = self.guard.metric_values()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.step, self.phase = epoch, self.steps_done, "training"
        self.ending = False
        if self._resuming:
            # Keras reset the metrics: put back those of the steps done.
            self.guard.set_metric_values(self._carried)
            return
        # A retry starts at the epoch it has just restored: no new copy.
        if epoch != self.snapshot_epoch:
            self.snapshot = _Snapshot(self.model)
            self.snapshot_epoch = epoch
        self.epoch_end_keys = ()

    def on_train_batch_begin(self, batch, logs=None):
        self.step = batch
        self.guard.save_small_state()

    def on_train_batch_end(self, batch, logs=None):
        steps, samples = self._call_start
        self.steps_done = batch + 1
        self.samples_done = samples + (batch + 1 - steps) * self._batch_size
        self.last_logs = logs

    def on_test_begin(self, logs=None):
        self.phase, self.step = "validation", 0
        if self._resuming_validation:
            return
        # Keras' epoch logs are the last step's running metrics.
        self.train_logs = {
            name: float(value) for name, value in (self.last_logs or {}).items()
        }
        self.start_validation(0, self._validation_batch_size)

    def on_test_batch_begin(self, batch, logs=None):
        self.step = batch
        if self._resuming_validation and batch == self._validation_start[0]:
            # `evaluate` reset the metrics after `on_test_begin`.
            self.guard.set_metric_values(self._carried)
            self._resuming_validation = False
        self.guard.save_small_state()

    def on_test_batch_end(self, batch, logs=None):
        steps, samples = self._validation_start
        self.validation_steps_done = batch + 1
        size = self._validation_batch_size or 0
        self.validation_samples_done = samples + (batch + 1 - steps) * size

    def on_test_end(self, logs=None):
        self.phase = "training"

    def on_epoch_end(self, epoch, logs=None):
        self.ending = True
        self.epoch_end_keys = tuple(logs or ())
        self.last_logs = logs


class _ResumableCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` that makes several `model.fit` calls one run.

    Each callback gets `on_train_begin` once, at the start, and
    `on_train_end` once, at the end, so what callbacks reset there
    (`EarlyStopping`'s patience, `CSVLogger`'s file, `History.epoch`,
    `TensorBoard`'s step) carries on across epochs and retries. An epoch
    resumed at step k is one epoch to them: no second `on_epoch_begin`,
    and batch indices that go on from k. A callback that a model's own
    `fit` adds on each call (`AccumulatingModel` does) gets its own
    `on_train_begin` and `on_train_end`, and is dropped after its call.
    """

    def __init__(self, callbacks, **kwargs):
        super().__init__(callbacks, **kwargs)
        self._own = list(self.callbacks)
        self._started = set()
        self._resumed_epoch = None
        self._offset = 0

    def _added(self):
        own = {id(c) for c in self._own}
        return [c for c in self.callbacks if id(c) not in own]

    def on_train_begin(self, logs=None):
        if not self._started:
            super().on_train_begin(logs)
        else:
            for callback in self.callbacks:
                if id(callback) not in self._started:
                    callback.on_train_begin(logs)
        self._started.update(id(c) for c in self.callbacks)

    def on_train_end(self, logs=None):
        # The end of one `model.fit` call, not of the run.
        for callback in self._added():
            callback.on_train_end(logs)

    def end_run(self, logs=None) -> None:
        """`on_train_end` for every callback: the run is over."""
        super().on_train_end(logs)

    def resume_at(self, epoch, offset: int) -> None:
        """Makes the next call's `epoch` go on from batch `offset`."""
        self._resumed_epoch = epoch
        self._offset = offset if epoch is not None else 0

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._resumed_epoch:
            # The callbacks saw this epoch begin; only ours restores.
            self._own[0].on_epoch_begin(epoch, logs)
            return
        super().on_epoch_begin(epoch, logs)

    def resume_validation_at(self, offset: int) -> None:
        """Makes the next `evaluate` call go on from batch `offset`."""
        self._validation_offset = offset

    def on_test_begin(self, logs=None):
        if getattr(self, "_validation_offset", 0):
            self._on_begin()  # Keras' count of open begin/end blocks.
            self._own[0].on_test_begin(logs)  # The others saw it begin.
            return
        super().on_test_begin(logs)

    def on_test_batch_begin(self, batch, logs=None):
        offset = getattr(self, "_validation_offset", 0)
        super().on_test_batch_begin(batch + offset, logs)

    def on_test_batch_end(self, batch, logs=None):
        offset = getattr(self, "_validation_offset", 0)
        super().on_test_batch_end(batch + offset, logs)

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch + self._offset, logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch + self._offset, logs)

    def end_call(self) -> None:
        """Drops what one `model.fit` call added."""
        # Keras may run `on_train_batch_end` in a thread pool: let the
        # call's hooks finish before anything is restored.
        flush = getattr(self, "_flush_futures", None)
        if flush is not None:
            flush()
        own = {id(c) for c in self._own}
        self.callbacks = [c for c in self.callbacks if id(c) in own]
        # The dropped callbacks' ids may be reused by new objects.
        self._started &= own
        self._resumed_epoch, self._offset = None, 0
        self._validation_offset = 0

    def abandon_attempt(self) -> None:
        """Forgets what the failed attempt left behind."""
        self.end_call()
        # A failed validation opened a test block that never closed; only
        # the training block is open.
        if hasattr(self, "_in_begin_end_block_count"):
            self._in_begin_end_block_count = 1


class _OutputCollector(keras.callbacks.Callback):
    """Keeps each predicted batch, to survive a failure later on."""

    def __init__(self):
        super().__init__()
        self.outputs = []
        self.ended = False

    def on_predict_begin(self, logs=None):
        self.ended = False

    def on_predict_batch_end(self, batch, logs=None):
        self.outputs.append(logs["outputs"])

    def on_predict_end(self, logs=None):
        self.ended = True


def _search_max_batch_size(
    model, source, start, max_batch_size, steps, headroom
) -> int:
    """`find_max_batch_size` on checked arguments."""
    samples = source.num_samples
    largest = min(max_batch_size, samples) if samples else max_batch_size
    multiple = _batch_floor(model, 1)
    start = max(multiple, min(start, largest))
    trial = _Trial(model, source, steps, headroom)
    try:
        good = bad = None
        size = start
        while good is None:  # Halve down until something fits.
            smallest = size // 2 < multiple
            if trial.fits(size, last_chance=smallest):
                good = size
            elif smallest:  # It trains, only without the headroom.
                good = size
                logging.warning(
                    "tfmemsafe.find_max_batch_size: even batch %d leaves "
                    "less than %.0f%% of the memory free. %s",
                    size,
                    100 * headroom,
                    _messages.OOM_ADVICE,
                )
            else:
                bad, size = size, size // 2
        while bad is None and good < largest:  # Grow.
            size = min(good * 2, largest)
            if trial.fits(size):
                good = size
            else:
                bad = size
        while bad is not None and bad - good > max(multiple, good // 8):
            size = _round_down((good + bad) // 2, multiple, good)
            if trial.fits(size):
                good = size
            else:
                bad = size
    finally:
        trial.close()
    logging.info(
        "tfmemsafe.find_max_batch_size: %d (tried %s).",
        good,
        _messages.format_sizes(trial.tried),
    )
    return good


class _Trial:
    """Trains a few steps at a batch size and says whether it fitted."""

    def __init__(self, model, source, steps, headroom):
        self.model = model
        self.source = source
        self.steps = steps
        self.headroom = headroom
        self.tried = []
        _ensure_built(model, source)
        self.snapshot = _Snapshot(model)
        self.history = getattr(model, "history", None)
        with model.distribute_strategy.scope():
            self.devices = memory.default_devices()
        self.limits = {
            device: memory.memory_info(device).limit_bytes
            for device in self.devices
        }
        self.warned = False

    def fits(self, batch_size: int, last_chance: bool = False) -> bool:
        """Whether `batch_size` trains and leaves the headroom free.

        Raises OutOfMemoryError if it runs out and it was the last chance.
        """
        self.tried.append(batch_size)
        for device in self.devices:
            memory.reset_peak_memory(device)
        try:
            self.model.fit(
                **self.source.trial_arguments(batch_size, self.steps),
                epochs=1,
                verbose=0,
            )
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            if last_chance:
                raise OutOfMemoryError(
                    f"Could not fit a training batch of {batch_size} after "
                    f"trying {_messages.format_sizes(self.tried)}. "
                    f"{_messages.OOM_ADVICE}",
                    self.tried,
                ) from err
            logging.info(
                "tfmemsafe.find_max_batch_size: batch %d ran out of memory.",
                batch_size,
            )
            return False
        finally:
            self.snapshot.restore()
            _release(self.model)
        return self._peak_leaves_headroom(batch_size)

    def _peak_leaves_headroom(self, batch_size) -> bool:
        fractions = []
        for device in self.devices:
            peak = memory.memory_info(device, include_limit=False).peak_bytes
            limit = self.limits[device]
            # A peak of 0 means the device keeps no statistics.
            if peak and limit:
                fractions.append(peak / limit)
        if not fractions:
            if not self.warned:
                self.warned = True
                logging.warning(
                    "tfmemsafe.find_max_batch_size: no memory statistics on "
                    "%s; only out-of-memory errors and `max_batch_size` "
                    "bound the search.",
                    ", ".join(self.devices),
                )
            return True
        logging.info(
            "tfmemsafe.find_max_batch_size: batch %d peaked at %.0f%% of "
            "the memory limit.",
            batch_size,
            100 * max(fractions),
        )
        return max(fractions) <= 1.0 - self.headroom

    def close(self) -> None:
        self.snapshot.restore()
        self.model.history = self.history
        _release(self.model)


def _ensure_built(model, source) -> None:
    """Builds the model, so that all its variables exist to be saved."""
    if model.built:
        return
    if source.kind == "arrays":
        x = keras.tree.map_structure(lambda a: a[:1], source.data[0])
    else:
        batch = next(iter(source.dataset(1).take(1)))
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    model(x, training=False)


def _release(model) -> None:
    """Drops what a failed attempt may hold, so its memory can be reused."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None
    model._eval_epoch_iterator = None  # The cached validation iterator.
    gc.collect()


def _accumulation_steps(model) -> int | None:
    steps = getattr(model, "accumulation_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    return None


def _gradient_accumulators(model) -> list:
    return [
        value
        for value in vars(model).values()
        if isinstance(value, accumulation.GradientAccumulator)
    ]


def _optimizers(model) -> list:
    """The compiled optimizer and those the model holds as attributes."""
    found = [model.optimizer, *vars(model).values()]
    optimizers = [o for o in found if isinstance(o, keras.optimizers.Optimizer)]
    return list({id(o): o for o in optimizers}.values())


def _carry_partial_window(model, ratio: float) -> None:
    """Keeps an `AccumulatingModel`'s partial window for the resumed call.

    Its micro-batches are counted again in units of the new, smaller
    ones, so that the window is applied after the same samples.
    """
    carry = getattr(model, "_carry_partial_window", None)
    if carry is not None:
        carry(ratio)


def _forget_epoch(history, epoch: int, keys) -> None:
    """Drops `epoch` from `history` if it recorded it before failing."""
    if getattr(history, "epoch", None) and history.epoch[-1] >= epoch:
        history.epoch.pop()
        for key in keys:
            if history.history.get(key):
                history.history[key].pop()


def _batch_floor(model, min_batch_size: int) -> int:
    """The smallest global batch: at least one sample per replica."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    return max(min_batch_size, replicas)


def _round_down(size: int, multiple: int, good: int) -> int:
    """Rounds to a multiple of 8 (or of the replicas) above `good`."""
    for step in (8, multiple):
        rounded = size - size % step
        if rounded > good and rounded % multiple == 0:
            return rounded
    return size


def _scaled(steps: int | None, halving: _Halving) -> int | None:
    """Steps that cover the same samples at the halved batch size."""
    if steps is None:
        return None
    return math.ceil(steps * halving.ratio)


def _batching_of(dataset) -> tuple[bool, int | None]:
    """Whether a dataset's pipeline batches, and the batch size if known."""
    node = dataset
    while node is not None:
        name = type(node).__name__
        if name in _BATCHING:
            size = getattr(node, "_batch_size", None)
            try:
                return True, int(size) if size is not None else None
            except TypeError:
                return True, None
        if name in _UNBATCHING:
            return False, None
        inputs = getattr(node, "_datasets", None)  # zip and similar
        if inputs:
            found = [_batching_of(d) for d in tf.nest.flatten(inputs)]
            sizes = {size for _, size in found}
            batched = all(b for b, _ in found)
            return batched, sizes.pop() if batched and len(sizes) == 1 else None
        node = getattr(node, "_input_dataset", None)
    return False, None


def _rows_of_batched(dataset) -> int | None:
    """The samples of a batched dataset, when its pipeline tells them.

    They are the length of what its `batch` batches, if that is known and
    the batches count matches it (no `filter` after the batching, say).
    """
    batches = int(dataset.cardinality())
    for node in _dataset_nodes(dataset):
        if type(node).__name__ != "_BatchDataset":
            continue
        rows = int(node._input_dataset.cardinality())  # noqa: SLF001
        size = int(node._batch_size)  # noqa: SLF001
        drop = bool(node._drop_remainder)  # noqa: SLF001
        if rows < 0 or drop:
            return None
        return rows if math.ceil(rows / size) == batches else None
    return None


def _is_deterministic(dataset) -> bool:
    """Whether a dataset's order is the same at each new iteration."""
    if dataset.options().deterministic is False:
        return False
    # A shuffle that reshuffles gives a new order at each iteration.
    return not any(
        getattr(node, "_reshuffle_each_iteration", True)
        for node in _dataset_nodes(dataset)
        if type(node).__name__ == "_ShuffleDataset"
    )


def _shuffle_seeds(dataset) -> list:
    return [
        (int(node._seed), int(node._seed2))  # noqa: SLF001
        for node in _dataset_nodes(dataset)
        if type(node).__name__ == "_ShuffleDataset"
    ]


def _dataset_nodes(dataset):
    """The transformations of a pipeline, from the last to the sources."""
    # tf.data has no public graph walk: `_input_dataset` and `_datasets`
    # are the attributes `_batching_of` reads too.
    pending = [dataset]
    while pending:
        node = pending.pop()
        yield node
        inputs = getattr(node, "_datasets", None)
        if inputs:
            pending.extend(tf.nest.flatten(inputs))
        parent = getattr(node, "_input_dataset", None)
        if parent is not None:
            pending.append(parent)


def _is_arrays(x) -> bool:
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)


def _is_labelled_arrays(data) -> bool:
    return (
        isinstance(data, (tuple, list))
        and len(data) in (2, 3)
        and _is_arrays(data[0])
        and all(part is None or _is_arrays(part) for part in data[1:])
    )


def _num_rows(structure) -> int:
    return int(keras.tree.flatten(structure)[0].shape[0])


def _concatenate(batches: list):
    return keras.tree.map_structure(
        lambda *parts: np.concatenate(parts, axis=0), *batches
    )


def _check_limits(min_batch_size, max_retries) -> None:
    _checks.integer("min_batch_size", min_batch_size, 1)
    if max_retries is not None:
        _checks.integer("max_retries", max_retries, 0)
