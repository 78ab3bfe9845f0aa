"""`tfmemsafe.fit`: its arguments, checked, and the start of a run.

`fit` checks what it is given into a `FitSettings`; `run` settles the
size to start at (a stopped job's stored size, or the pre-flight check's)
and hands the run to a `_runner.FitRun`. docs/architecture.md shows the
rooms a decision passes through.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import data as data_lib
from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe._model_state import optimizers_of
from tfmemsafe._sources import Arrays
from tfmemsafe._sources import BucketedExamples
from tfmemsafe._sources import UnbatchedDataset
from tfmemsafe._sources import source_for
from tfmemsafe._step_guard import StepGuard
from tfmemsafe.history import FitHistory
from tfmemsafe.history import OOMEvent
from tfmemsafe.history import fit_history_of
from tfmemsafe.recovery import _backup
from tfmemsafe.recovery._batch_search import find_max_batch_size
from tfmemsafe.recovery._on_oom import fit_in_step
from tfmemsafe.recovery._on_oom import in_step_only
from tfmemsafe.recovery._on_oom import is_iterable_only
from tfmemsafe.recovery._planner import SizePlanner
from tfmemsafe.recovery._policy import TRAINING
from tfmemsafe.recovery._policy import VALIDATION
from tfmemsafe.recovery._policy import SizePolicy
from tfmemsafe.recovery._policy import accumulation_steps_of
from tfmemsafe.recovery._runner import FitRun
from tfmemsafe.recovery._settings import FitSettings


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
) -> FitHistory:
    """Trains a compiled model as `model.fit` does, surviving running out
    of memory.

    Takes `model.fit`'s arguments, in `model.fit`'s order, and the kinds
    of data it takes. How it recovers depends on the data:

    - A `keras.utils.PyDataset`, a Python generator or iterator, or any
      data with `steps_per_epoch`: `model.fit` with
      `tfmemsafe.SplitBatchOnOOM` in its callbacks. A batch that runs out
      is trained again, in the same step, as micro-batches whose
      gradients make one update; the batch size, the data pipeline and
      the epoch are untouched (see `SplitBatchOnOOM`). The arguments
      about shrinking (`min_batch_size`, `keep_effective_batch_size`,
      `max_retries`, `preflight`, `memory_estimate`) do not apply. On a
      multi-worker job, `steps_per_epoch` shrinks instead, and a
      `PyDataset` or generator is refused.
    - Arrays (`x` and `y`, or a tuple `(x, y[, sample_weight])` as `x`),
      a `tf.data.Dataset`, or a callable `batch_size -> tf.data.Dataset`:
      the batch size shrinks, as below.

    When a step, or the validation at the end of an epoch, raises an
    out-of-memory error (`tfmemsafe.is_oom_error`) on data of the second
    kind, it:

    1. logs one line: the epoch, the step, the batch size before and after
       and the accumulation steps (see 3 for the size after);
    2. frees what it can: the failed iterator and Python garbage (the
       traced train, test and predict functions stay, and trace the new
       shapes as they come);
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

    On examples of varying length batched by `batch_size="auto"` (length
    buckets, docs/variable-length.md), a batch that runs out is instead
    read again and trained alone as 2 (then 4, 8...) micro-batches whose
    gradients make one update, and the epoch goes on at the next batch,
    every bucket at its size (an `OOMEvent` with `split_into`), where the
    data gives the same batches again and the model trains with Keras'
    (or `AccumulatingModel`'s) own `train_step`, on one device, under a
    `MirroredStrategy`, or under a `MultiWorkerMirroredStrategy`, where
    every worker splits that batch the same way (each step's update
    waits until every worker has said whether its part ran out).

    After a shrink, when the memory that made the batch run out is freed
    (something else held it for a while), the batch grows back to the
    size it had, halving `accumulation_steps` again, once
    `grow_back_after` steps have trained cleanly and the memory estimate
    predicts that size fits beside what is held now: one log line and a
    `GrowBackEvent` in `history.grow_back_events` (length buckets grow
    back as an epoch begins). A size that runs out again in the same
    epoch is not tried again in that epoch.

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
            first bucket's, an out-of-memory error halves every bucket's
            and the epoch begins again, and a variable-length
            `validation_data` is batched by the same buckets. `None` means
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
        grow_back_after: int or `None`. How many training steps must
            train without an error after a shrink before the batch may
            grow back to a size it had, when the memory estimate predicts
            that size fits again (never, for a size that has run out
            twice in the epoch). `None` never grows back. It needs the
            memory estimate, and is off on a multi-worker job and for
            examples batched by length buckets. Defaults to 100.
        split_batch_norm: bool. For the in-step split: whether a model
            whose `BatchNormalization` trains is split all the same (see
            `SplitBatchOnOOM`). Defaults to `True`: each micro-batch is
            normalized by its own statistics, as each smaller batch is
            when the batch shrinks.

    Returns:
        A `tfmemsafe.FitHistory`: a `keras.callbacks.History` with one
        entry per completed epoch across all attempts, plus `oom_events`
        (a list of `OOMEvent`), `grow_back_events` (a list of
        `GrowBackEvent`) and `batch_size` (the training batch size at the
        end). A `History` passed in `callbacks` is the one returned,
        made a `FitHistory` in place.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up. The model is
            then put back in the state of the last completed epoch (or of
            the start), which the message names. The original error is
            chained as `__cause__`.
        TypeError: If `x` or `validation_data` is of no accepted kind.
        ValueError: If an argument is out of range.

    Any error that is not an out-of-memory error, and `KeyboardInterrupt`,
    propagates at once, unchanged.

    Example:
    >>> history = tfmemsafe.fit(model, x, y, batch_size=1024, epochs=3)
    >>> [event.batch_size_after for event in history.oom_events]
    [512]
    """
    _checks.compiled_model(model, "fit")
    _checks.integer("epochs", epochs, 1)
    _checks.retry_limits(min_batch_size, max_retries)
    callbacks = _checks.callbacks(callbacks)
    model_fit_arguments = dict(
        batch_size=batch_size,
        epochs=epochs,
        verbose=verbose,
        validation_split=validation_split,
        validation_data=validation_data,
        shuffle=shuffle,
        class_weight=class_weight,
        initial_epoch=initial_epoch,
        steps_per_epoch=steps_per_epoch,
        validation_steps=validation_steps,
        validation_batch_size=validation_batch_size,
        validation_freq=validation_freq,
    )
    multi_worker = distribute.is_multi_worker(model.distribute_strategy)
    if multi_worker and is_iterable_only(x):
        raise ValueError(
            "On a multi-worker job `tfmemsafe.fit` recovers by agreeing on "
            "a smaller batch, which needs data it can batch again (arrays, "
            "a tf.data.Dataset or a callable). Received: x of type "
            f"{type(x).__name__}"
        )
    if in_step_only(x, steps_per_epoch) and not multi_worker:
        if batch_size == "auto" and not is_iterable_only(x):
            batch_size = find_max_batch_size(
                model, x if y is None else (x, y), memory_estimate=True
            )
            logging.info(
                "tfmemsafe.fit: batch_size='auto' chose %d.", batch_size
            )
            model_fit_arguments["batch_size"] = batch_size
        return fit_in_step(
            model,
            x,
            y,
            sample_weight,
            callbacks,
            grow_back_after=grow_back_after,
            split_batch_norm=split_batch_norm,
            **model_fit_arguments,
        )
    data = x
    if y is not None or sample_weight is not None:
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
        data = parts
    # What `model.fit` defaults to is left to it.
    defaults = dict(
        validation_split=0.0,
        shuffle=True,
        class_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
    )
    fit_kwargs = {
        name: model_fit_arguments[name]
        for name, default in defaults.items()
        if model_fit_arguments[name] != default
    }
    strategy = model.distribute_strategy
    train_source = source_for(data, "x", labelled=True, strategy=strategy)
    validation_source = None
    if validation_data is not None:
        validation_source = source_for(
            validation_data, "validation_data", labelled=True, strategy=strategy
        )
    preflight = _checks.boolean("preflight", preflight)
    memory_estimate = _checks.boolean("memory_estimate", memory_estimate)
    if grow_back_after is not None:
        _checks.integer("grow_back_after", grow_back_after)
    if batch_size == "auto" and _varies_in_length(train_source):
        train_source, validation_source = _bucketed(
            model, train_source, validation_source, memory_estimate
        )
        batch_size = train_source.batch_size
        # The plan is the estimate; one of bucketed batches would mix
        # lengths in one line. An error halves every bucket.
        preflight = memory_estimate = False
    elif batch_size == "auto":
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
        grow_back_after=grow_back_after,
        verbose=verbose,
        other_arguments=other_arguments,
    )
    if settings.validation_batch_size is not None:
        _checks.integer("validation_batch_size", settings.validation_batch_size)
    _checks.start_sizes(
        min_batch_size,
        batch_size=settings.batch_size,
        validation_batch_size=settings.validation_batch_size,
    )
    if not model.built:
        # The epoch snapshot builds the optimizer: the model's variables
        # must exist by then (a subclassed model makes them in its call).
        model(train_source.sample_inputs(), training=False)
    return run(model, settings, callbacks)


def run(model, settings: FitSettings, callbacks: list) -> FitHistory:
    """Trains as `settings` ask; the body of `tfmemsafe.fit`.

    Before anything trains under the step guard, it settles the size to
    start at: a stopped job's stored size, or the pre-flight check's.
    """
    # The allocator laid out as the estimates measure it.
    memory.reserve_one_region()
    other_arguments = dict(settings.other_arguments)
    train_source, validation_source = _split_for_validation(
        settings, other_arguments
    )
    sizes = {TRAINING: settings.batch_size}
    if validation_source is not None:
        sizes[VALIDATION] = (
            settings.validation_batch_size or validation_source.batch_size
        )
    policy = SizePolicy(
        model,
        sizes,
        min_batch_size=settings.min_batch_size,
        max_retries=settings.max_retries,
        keep_effective_batch_size=settings.keep_effective_batch_size,
    )
    planner = SizePlanner(
        model, "tfmemsafe.fit", memory_estimate=settings.memory_estimate
    )
    # Read now, not after an error: a callable's pipeline is built to
    # read it, and nothing may allocate while memory is full.
    for source in (train_source, validation_source):
        if source is not None:
            source.sample_signature()
    history = fit_history_of(callbacks)
    backup = _backup.Decisions(
        callbacks, planned=isinstance(train_source, BucketedExamples)
    )
    stored = backup.load(policy.requested(TRAINING))
    if stored is not None:
        tried, steps, path = stored
        decision = policy.restore(tried, steps)
        logging.warning(
            "tfmemsafe.fit: resuming at %s, as stored in %s after running "
            "out of memory.",
            decision.describe(),
            path,
        )
    elif settings.preflight and not distribute.is_multi_worker(
        model.distribute_strategy
    ):
        decision = policy.preflight(planner, train_source)
        if decision is not None:
            logging.warning(
                "tfmemsafe.fit: pre-flight check: %s.", decision.describe()
            )
            history.oom_events.append(
                OOMEvent(
                    epoch=settings.initial_epoch,
                    step=0,
                    phase="preflight",
                    batch_size_before=decision.batch_size_before,
                    batch_size_after=decision.batch_size_after,
                    accumulation_steps=decision.accumulation_steps_after,
                    error=decision.predicted,
                    resumed_at_step=0,
                )
            )
    guard = StepGuard(
        model, optimizers_of(model), gradient_accumulators_of(model)
    )
    try:
        return FitRun(
            model,
            settings,
            train_source=train_source,
            validation_source=validation_source,
            other_arguments=other_arguments,
            policy=policy,
            planner=planner,
            backup=backup,
            guard=guard,
            history=history,
            callbacks=callbacks,
        ).train()
    finally:
        guard.close()


def _varies_in_length(source) -> bool:
    return isinstance(source, UnbatchedDataset) and source.varies_in_length()


def _bucketed(model, train_source, validation_source, memory_estimate):
    """The training (and validation) examples in memory buckets."""
    if not memory_estimate:
        raise ValueError(
            "`batch_size='auto'` on examples of varying length batches them "
            "by predicted memory, which needs the memory estimate. Pass "
            "memory_estimate=True, or batch them yourself. Received: "
            "memory_estimate=False"
        )
    # Windows that close at a number of samples (tokens) take no batch
    # past it, so that an update stays under twice it.
    buckets = data_lib.memory_buckets(
        train_source.data,
        model,
        **_capped_by_update_size(model),
    )
    logging.info("tfmemsafe.fit: batch_size='auto' chose:\n%s", buckets)
    steps = accumulation_steps_of(model)
    sizes = buckets.bucket_batch_sizes[:-1]
    if steps and steps > 1 and min(sizes) != max(sizes):
        logging.warning(
            "tfmemsafe.fit: accumulation_steps=%d counts batches, and the "
            "buckets' batches hold %d to %d samples: updates of %d to %d "
            "samples. For updates of one size, build the model with "
            "`samples_per_update` (or `tokens_per_update`) instead.",
            steps,
            min(sizes),
            max(sizes),
            steps * min(sizes),
            steps * max(sizes),
        )
    train = BucketedExamples(train_source.data, "data", buckets, counted=True)
    train.one_worker = train_source.one_worker
    if _varies_in_length(validation_source):
        validation = BucketedExamples(
            validation_source.data, "validation_data", buckets, counted=False
        )
        validation.one_worker = validation_source.one_worker
        validation_source = validation
    return train, validation_source


def _capped_by_update_size(model) -> dict:
    """`memory_buckets`' caps for a model whose windows close by size."""
    samples = getattr(model, "samples_per_update", None)
    tokens = getattr(model, "tokens_per_update", None)
    if samples:
        return {"max_batch_size": samples}
    if tokens:
        return {"max_tokens": tokens}
    return {}


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
