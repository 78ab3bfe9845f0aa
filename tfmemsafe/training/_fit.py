"""`tfmemsafe.fit`: `model.fit` with `SplitBatchOnOOM`, and what needs
more than one batch's view: the pre-flight estimate (the micro-batches to
start at), `batch_size="auto"` (a size searched for, or length buckets),
and the run's events in one `FitHistory`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe import planning
from tfmemsafe import recovery
from tfmemsafe._keras_data import chained_cause
from tfmemsafe._keras_data import check_kind
from tfmemsafe._keras_data import check_x_and_y
from tfmemsafe._keras_data import is_iterable_only
from tfmemsafe._keras_data import keras_data
from tfmemsafe._keras_data import samples_of
from tfmemsafe._keras_data import unpacked
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe._sources import source_for
from tfmemsafe.accumulation import accumulation_steps_of
from tfmemsafe.history import FitHistory
from tfmemsafe.history import OOMEvent
from tfmemsafe.history import fit_history_of
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery import SplitBatchOnOOM
from tfmemsafe.training._auto_batch import auto_batch


def fit(
    model: keras.Model,
    x=None,
    y=None,
    batch_size: int | str | None = None,
    epochs: int = 1,
    verbose="auto",
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    validation_split: float = 0.0,
    validation_data=None,
    shuffle: bool = True,
    class_weight=None,
    sample_weight=None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
    *,
    min_batch_size: int = 1,
    keep_effective_batch_size: bool = True,
    max_retries: int | None = None,
    preflight: bool = True,
    memory_estimate: bool = True,
    grow_back_after: int | None = 100,
    split_batch_norm: bool = True,
    plan: str | planning.MemoryPlan | None = None,
) -> FitHistory:
    """Trains a compiled model as `model.fit` does, surviving running out
    of memory.

    Takes `model.fit`'s arguments, in `model.fit`'s order, and every kind
    of data it takes: arrays or tensors (with `y`), a `tf.data.Dataset`, a
    `keras.utils.PyDataset`, a Python generator or iterator; and two forms
    of its own: a tuple `(x, y[, sample_weight])` as `x`, and a callable
    `batch_size -> tf.data.Dataset`. It is `model.fit` with
    `tfmemsafe.SplitBatchOnOOM` in its callbacks: a batch that runs out
    of memory (`tfmemsafe.is_oom_error`) is trained again, in the same
    step, as micro-batches whose gradients make one update, so the batch
    size, the data pipeline and the epoch are untouched, and nothing is
    replayed or skipped (see `SplitBatchOnOOM` and docs/oom-recovery.md).

    What it adds needs more than one batch's view:

    - Before the first step (`preflight=True`), it estimates the training
      step's memory (`tfmemsafe.estimate_memory`); when the batch asked
      for is predicted not to fit, training starts split into the largest
      micro-batches (halvings of the batch) predicted to fit, with no
      error: one log line, and an `OOMEvent` with `phase="preflight"`.
      Where the device keeps no memory statistics or its limit is
      unknown, on a multi-worker job, and for a `PyDataset` or generator
      (which it cannot read ahead of Keras), there is no estimate.
    - `batch_size="auto"` searches for the largest batch that fits
      (`tfmemsafe.find_max_batch_size`); on an unbatched dataset whose
      inputs vary in length, it batches by length buckets, each at the
      size the memory model predicts to fit (`tfmemsafe.data`), planned
      on the training and validation examples together.
    - `plan="auto"` (or a `tfmemsafe.MemoryPlan`) trains the batch as the
      planner chose by measurement: in micro-batches, with the model's
      blocks recomputed, or as it is (`tfmemsafe.plan`). Batches that
      still run out are split further, in the step, and logged.
    - The events of the run in one `FitHistory`.

    The same callback objects see one `model.fit`: each batch once, in
    order, with the epoch's true step count.

    Args:
        model: A compiled `keras.Model`.
        x: The training data: arrays or tensors (with `y`), a tuple
            `(x, y)` or `(x, y, sample_weight)` of arrays, a callable
            `batch_size -> tf.data.Dataset` (your pipeline, rebuilt at each
            new batch size), an unbatched `tf.data.Dataset` (batched and
            prefetched here), a batched `tf.data.Dataset` (rebatched), a
            `keras.utils.PyDataset`, or a generator or iterator of
            batches.
        y: The targets, with arrays or tensors as `x`.
        batch_size: int, `"auto"` or `None`. The (global) batch size to
            start at. `"auto"` uses `find_max_batch_size` (and no
            pre-flight check: its size was tried); for an unbatched
            dataset whose inputs vary in length, it batches by length
            buckets, each at the size the memory model predicts to fit
            (`tfmemsafe.data.memory_buckets`): the batch size is then the
            first bucket's, a batch that runs out is split in its step as
            any other, and a variable-length `validation_data` is batched
            by the same buckets. `None` means
            the batch size of a batched dataset, else 32; a callable
            needs one.
        epochs: int. The number of epochs; with `initial_epoch`, the
            epoch to stop at, as in `model.fit`. Defaults to 1.
        verbose: `"auto"`, 0, 1 or 2, as in `model.fit`.
        callbacks: list of `keras.callbacks.Callback`. Passed to every
            attempt, `tfmemsafe.MemoryMonitor`s first so that the callbacks
            after them see `memory_peak_mb` in the epoch logs.
        validation_split, validation_data, shuffle, class_weight,
        sample_weight, initial_epoch, steps_per_epoch, validation_steps,
        validation_batch_size, validation_freq: As in `model.fit`;
            `validation_data` may also be of any kind `x` accepts.
        min_batch_size: int. The fewest rows of a micro-batch; a
            micro-batch that small that runs out raises. Defaults to 1.
        keep_effective_batch_size: bool. Kept so that calls written for
            earlier versions run: the batch, and so each update, is now
            always kept. `False` only logs a warning. Defaults to `True`.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        preflight: bool. Whether to estimate the training step's memory
            before the first step and start split into micro-batches
            predicted to fit. Defaults to `True`; it costs a few short
            training steps at small batch sizes (docs/benchmarks.md), and
            does nothing where no estimate can be made.
        memory_estimate: bool. Whether `fit` may estimate memory at all
            (the pre-flight check and `batch_size="auto"`). Estimating
            runs the model's steps at small batches and puts back every
            variable the model tracks; turn it off for a model whose
            calls have effects outside its variables. Defaults to `True`.
        grow_back_after: int or `None`. How many training steps must
            train without an error before split micro-batches double,
            unless the measured peak predicts the double does not fit
            beside what is held now; a grow-back to a size that ran out
            beside as much memory doubles it (see `SplitBatchOnOOM`).
            `None` never grows back.
            Defaults to 100.
        split_batch_norm: bool. Whether a model whose `BatchNormalization`
            trains is split all the same (see `SplitBatchOnOOM`).
            Defaults to `True`: each micro-batch is normalized by its own
            statistics.
        plan: `None`, `"auto"` or a `tfmemsafe.MemoryPlan`. `"auto"` plans
            the batch now (`tfmemsafe.plan`, with no pre-flight check
            after it); a plan made for this model and batch size is
            followed as it is. Callbacks then see the model the plan
            trains (`MemoryPlan.apply`), which shares every variable with
            `model`. Defaults to `None`: no plan.

    Returns:
        A `tfmemsafe.FitHistory`: the `keras.callbacks.History` of the
        run, plus `oom_events` (a list of `OOMEvent`), `grow_back_events`
        (a list of `GrowBackEvent`) and `batch_size` (the training batch
        size, where the data says it: at most the samples trained on). A
        `History` passed in `callbacks` is the one returned, made a
        `FitHistory` in place.

    Raises:
        OutOfMemoryError: If a micro-batch of `min_batch_size` rows runs
            out, `max_retries` is used up, a batch that runs out cannot be
            split exactly (docs/oom-recovery.md), or the optimizer's
            update itself runs out. The model is as before that batch,
            except after an update that ran out, which the message says.
            The original error is chained as `__cause__`.
        TypeError: If `x` or `validation_data` is of no accepted kind.
        ValueError: If an argument is out of range.

    Any error that is not an out-of-memory error, and `KeyboardInterrupt`,
    propagates at once, unchanged.

    Example:
    >>> history = tfmemsafe.fit(model, x, y, batch_size=1024, epochs=3)
    >>> [event.split_into for event in history.oom_events]
    [8]
    """
    _checks.compiled_model(model, "fit")
    epochs = _checks.integer("epochs", epochs, 1)
    _checks.retry_limits(min_batch_size, max_retries)
    callbacks = monitors_first(_checks.callbacks(callbacks))
    preflight = _checks.boolean("preflight", preflight)
    memory_estimate = _checks.boolean("memory_estimate", memory_estimate)
    if not _checks.boolean(
        "keep_effective_batch_size", keep_effective_batch_size
    ):
        logging.warning(
            "tfmemsafe.fit: `keep_effective_batch_size=False` has no effect: "
            "a batch that runs out is split into micro-batches of one "
            "update, so the batch is always kept."
        )
    if plan is not None and batch_size == "auto":
        raise ValueError(
            "`plan` plans the batch size asked for; pass an integer "
            "`batch_size`. Received: batch_size='auto'"
        )
    if x is None:
        raise ValueError(
            "`x` is required: the training data, in any form `model.fit` "
            "takes. Received: x=None"
        )
    if batch_size is not None and not (
        batch_size == "auto" or _checks.is_integer(batch_size)
    ):
        raise ValueError(
            "`batch_size` must be an integer >= 1, 'auto' or None. "
            f"Received: batch_size={batch_size!r}"
        )
    if batch_size is not None and batch_size != "auto":
        batch_size = int(batch_size)
    if validation_batch_size is not None:
        validation_batch_size = _checks.integer(
            "validation_batch_size", validation_batch_size
        )
    _checks.start_sizes(
        min_batch_size,
        batch_size=None if batch_size == "auto" else batch_size,
        validation_batch_size=validation_batch_size,
    )
    split = SplitBatchOnOOM(
        grow_back_after,
        split_batch_norm,
        min_micro_batch_size=min_batch_size,
        max_retries=max_retries,
    )
    check_x_and_y(x, y)
    check_kind(validation_data, "validation_data")
    x, y, sample_weight = unpacked(x, y, sample_weight)
    strategy = model.distribute_strategy
    history = fit_history_of(callbacks)
    # Keras splits off `validation_split` only without `validation_data`.
    split_off = validation_split if validation_data is None else 0.0
    if batch_size == "auto":
        x, validation_data, batch_size = auto_batch(
            model,
            x,
            y,
            validation_data,
            split_off,
            memory_estimate,
            verbose,
        )
        preflight = False  # Its size, or its buckets, were measured.
    if validation_data is not None:
        vx, vy, vw = unpacked(validation_data)
        vx, validation_batch_size, _ = keras_data(
            vx, validation_batch_size or batch_size, strategy, "validation_data"
        )
        validation_data = (
            vx
            if vy is None
            else tuple(p for p in (vx, vy, vw) if p is not None)
        )
    data = x if y is None else (x, y)
    samples = samples_of(data, split_off)
    x, keras_batch_size, rows = keras_data(x, batch_size, strategy)
    if rows is not None and samples:
        rows = min(rows, samples)  # The largest batch Keras trains.
    trained = model
    if plan is not None:
        plan = planning.to_follow(
            plan, model, data, rows, split_batch_norm, verbose
        )
        trained = plan.apply(model)
        split.micro_batch_size = plan.micro_batch_size
        preflight = False  # The plan measured its sizes.
        logging.info(
            "tfmemsafe.fit: batches of %d train as %s, as planned.",
            rows,
            plan.chosen.name,
        )
    # The allocator laid out as the estimates measure it.
    memory.reserve_one_region()
    if (
        preflight
        and memory_estimate
        and rows is not None
        and not distribute.is_multi_worker(strategy)
        and not is_iterable_only(data)
    ):
        split.micro_batch_size = _preflight(
            model, data, rows, split, history, initial_epoch, verbose
        )
    if history not in callbacks:
        # Last, where Keras puts its own: it records the logs every other
        # callback adds to (a monitor's memory, a scheduler's rate).
        callbacks = [*callbacks, history]
    if isinstance(x, tf.data.Dataset):
        shuffle = False  # Keras ignores it here, and warns at its default.
    # Without the batch Keras reads and drops under a strategy: see
    # docs/oom-recovery.md.
    with without_sample_batch(trained), chained_cause():
        trained.fit(
            x,
            y,
            batch_size=keras_batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=[*callbacks, split],
            validation_split=validation_split,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )
    history.oom_events.extend(split.oom_events)
    history.grow_back_events.extend(split.grow_back_events)
    history.batch_size = rows
    return history


def _preflight(model, data, rows, split, history, epoch, verbose):
    """The micro-batch rows the estimate predicts to fit when a batch of
    `rows` does not (halvings of it, down to the `split` callback's
    floor), else `None`; one log line and an `OOMEvent` with
    `phase="preflight"` when it splits. A model whose batches cannot be
    split exactly is not split."""
    floor = split.min_micro_batch_size
    source = source_for(
        data, "x", labelled=True, strategy=model.distribute_strategy
    )
    planner = planning.SizePlanner(
        model, "tfmemsafe.fit", memory_estimate=True, verbose=verbose
    )
    halvings, predicted = planner.halvings(
        "training", source, rows, floor, largest_probe=max(1, rows // 2)
    )
    if not halvings:
        return None
    refusal = recovery.split_refusal(
        model,
        (source.sample_inputs(),),
        "train",
        split.split_batch_norm,
        from_the_start=True,
    )
    if refusal is not None:
        logging.warning(
            "tfmemsafe.fit: pre-flight check: batches of %d are predicted "
            "not to fit (%s), and are not split: %s; %s.",
            rows,
            predicted,
            refusal,
            recovery.after_an_oom(refusal),
        )
        return None
    micro = max(floor, rows >> halvings)
    pieces = math.ceil(rows / micro)
    logging.warning(
        "tfmemsafe.fit: pre-flight check: batches of %d train as %d "
        "micro-batches of %d (%s).",
        rows,
        pieces,
        micro,
        predicted,
    )
    history.oom_events.append(
        OOMEvent(
            epoch=epoch,
            step=0,
            phase="preflight",
            batch_size_before=rows,
            batch_size_after=rows,
            accumulation_steps=accumulation_steps_of(model),
            error=predicted,
            resumed_at_step=0,
            split_into=pieces,
        )
    )
    return micro
