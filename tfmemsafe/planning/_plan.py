"""`tfmemsafe.plan`: the fastest way to train a batch in the memory there is.

For the model as it is, and then the model with its blocks recomputed
(with `checkpointing="auto"`, at fewer micro-batches than the first
trained at: at as many, recomputing only adds work), the memory model
predicts the peak of the step at the whole batch and at halvings of it
as micro-batches (the static bound first, probes only where the bound
does not settle it); the fewest micro-batches predicted to fit, and
twice as many, are then trained for a few steps on the model's own
variables, which are put back exactly afterwards. Of those
that trained without running out of memory, the simplest within 5% of
the fastest is chosen. What trained is a fact: a candidate that ran out
while measured is not chosen, whatever was predicted. On a multi-worker
job every worker plans its share of the batch and they agree on one plan
(`_workers`).
"""

from __future__ import annotations

import functools
import time

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe import recovery
from tfmemsafe._keras_data import check_x_and_y
from tfmemsafe._keras_data import is_iterable_only
from tfmemsafe._keras_data import unpacked
from tfmemsafe._sources import source_for
from tfmemsafe.planning import _workers
from tfmemsafe.planning._candidates import chosen
from tfmemsafe.planning._candidates import limit_of
from tfmemsafe.planning._candidates import predicted
from tfmemsafe.planning._measure import measure
from tfmemsafe.planning._measure import measured
from tfmemsafe.planning._memory_plan import MemoryPlan
from tfmemsafe.planning._variants import checkpointed

_WHOLE_WITHOUT_RECOMPUTATION = (
    "checkpointing: the whole batch trained without it, and recomputing "
    "adds a forward pass to the same step (checkpointing=True measures it)"
)

_NO_RECOMPUTATION_ON_WORKERS = (
    "checkpointing: not considered for a multi-worker job (each worker "
    "measures a copy of the model; wrap its blocks in tfmemsafe.Checkpointed "
    "yourself, and plan that model)"
)


def plan(
    model: keras.Model,
    x=None,
    y=None,
    batch_size: int | None = None,
    *,
    memory_limit: int | None = None,
    checkpointing: bool | str = "auto",
    split_batch_norm: bool = False,
    steps: int = 3,
    verbose="auto",
) -> MemoryPlan:
    """Chooses how to train a batch within memory, by measurement.

    Considers training each batch of `batch_size` whole or as k
    micro-batches of one update (`tfmemsafe.SplitBatchOnOOM`), with the
    model as it is and with its blocks recomputed in the backward pass
    (`tfmemsafe.Checkpointed`: a `keras.Sequential` in about sqrt(n)
    segments of its layers, a functional model's nested models and layers
    of your own class; a model of another class is not rebuilt).
    For each it predicts the step's peak (`tfmemsafe.estimate_memory`,
    or the traced step's upper bound where that fits already). The
    fewest micro-batches predicted to fit are trained for `steps` steps
    (after one that traces), with their median step time and peak
    measured; twice as many only where those ran out of memory or took
    more than 90% of the limit. More micro-batches are not tried: they
    need less memory still, and every micro-batch adds a step's fixed
    cost. The checkpointed model comes second, and with
    `checkpointing="auto"` only at fewer micro-batches than the model as
    it is trained at (not at all where that trained whole): at as many,
    recomputing only adds a forward pass to each. Of those that trained,
    the simplest (the model as it is before
    the checkpointed one, then the fewest micro-batches) within 5% of the
    fastest is chosen: closer times are one speed on a machine whose load
    moves them.

    The model is left exactly as it was found: its weights, optimizer
    state, metrics and random-seed state are put back after each
    measurement. The choice depends only on the measurements: the same
    measurements give the same plan.

    Under a `MultiWorkerMirroredStrategy`, call it on every worker with
    the same arguments, outside `strategy.scope()`: each worker measures
    its replicas' share of the batch (`per_replica` rows) on a copy of the
    model,
    the workers agree on each candidate (the highest prediction, fitting
    and trained where it did on every worker, the slowest step time), and
    every worker gets the same plan, of micro-batches only.

    The dtype policy is not a candidate: `tfmemsafe.configure` sets mixed
    precision at import where the GPU computes faster in it, and the plan
    says which policy the model computes in.

    Args:
        model: A compiled `keras.Model`.
        x: The training data, as `tfmemsafe.fit` takes it, but not a
            `keras.utils.PyDataset`, generator or iterator (the plan reads
            batches ahead of training). A few batches are read.
        y: The targets, with arrays or tensors as `x`.
        batch_size: int or `None`. The batch to train (at most the
            samples in `x`, where they are known: `model.fit` trains no
            larger batch). Defaults to the batch size of a batched
            dataset, else 32.
        memory_limit: int or `None`. Bytes to plan within, at most the
            device's. Defaults to `None`: the device's limit.
        checkpointing: bool or `"auto"`. Whether to consider recomputing
            the model's blocks; `"auto"` considers it where the model can
            be rebuilt and where it can be faster (above), and says why
            not elsewhere; `True` considers it at every micro-batch count
            the model as it is was considered at. Defaults to `"auto"`.
        split_batch_norm: bool. As `tfmemsafe.SplitBatchOnOOM`'s: whether
            micro-batches may be considered for a model whose
            `BatchNormalization` layers train (each micro-batch is then
            normalized by its own statistics). Where a model's batches
            cannot be split exactly (that, a loss that does not average
            over the batch, ...), only whole batches are considered, and
            the plan says why. Defaults to `False`.
        steps: int. Timed steps per measured candidate (their median
            is its step time). Defaults to `3`.
        verbose: `"auto"`, 0 or 1. A progress bar of the planning stages
            with 1 (and `"auto"`). Defaults to `"auto"`.

    Returns:
        A `MemoryPlan`.

    Raises:
        TypeError: If `model`, `x` or `y` is of the wrong kind.
        ValueError: If an argument is out of range, `y` is given beside
            a dataset or callable `x` (which brings its own targets), or
            `checkpointing=True` and the model cannot be checkpointed (or
            the job runs on several workers).
        RuntimeError: On a multi-worker job, if another worker's planning
            raised.

    Example:
    >>> plan = tfmemsafe.plan(model, x, y, batch_size=512)
    >>> print(plan)
    >>> history = tfmemsafe.fit(model, x, y, batch_size=512, plan=plan)
    """
    started = time.perf_counter()
    _checks.compiled_model(model, "plan")
    steps = _checks.integer("steps", steps, 1)
    _checks.one_of("checkpointing", checkpointing, (True, False, "auto"))
    _checks.verbose(verbose)
    check_x_and_y(x, y)
    if is_iterable_only(x):
        raise ValueError(
            "`x` must be data tfmemsafe.plan can read ahead: arrays, a "
            "tf.data.Dataset or a callable. Received: x of type "
            f"{type(x).__name__}"
        )
    strategy = model.distribute_strategy
    x, y, _ = unpacked(x, y)
    data = x if y is None else (x, y)
    source = source_for(data, "x", labelled=True, strategy=strategy)
    rows = source.resolve_batch_size(batch_size)
    samples = source.num_samples
    if samples:  # The largest batch `model.fit` trains.
        rows = min(rows, samples)
    split_batch_norm = _checks.boolean("split_batch_norm", split_batch_norm)
    not_tried = [_precision(model)]
    if distribute.is_multi_worker(strategy):
        if checkpointing is True:
            raise ValueError(
                "tfmemsafe.plan does not consider recomputation for a "
                "multi-worker job: pass checkpointing='auto' or False, and "
                "wrap the model's blocks in tfmemsafe.Checkpointed yourself "
                "to plan that model. Received: checkpointing=True"
            )
        not_tried.append(
            _NO_RECOMPUTATION_ON_WORKERS
            if checkpointing
            else "checkpointing: turned off (checkpointing=False)"
        )
        checkpointed_model = None
        candidates, per_replica, device, limit, refusal = (
            _workers.planned_by_every_worker(
                model,
                data,
                rows,
                memory_limit,
                lambda: _refusal(model, source, split_batch_norm),
                split_batch_norm,
                steps,
                _progress(1, verbose),
            )
        )
    else:
        per_replica = None
        refusal = _refusal(model, source, split_batch_norm)
        checkpointed_model, candidates, device, limit = _planned_here(
            model,
            source,
            rows,
            memory_limit,
            checkpointing,
            refusal is None,
            split_batch_norm,
            steps,
            verbose,
            not_tried,
        )
    if refusal is not None:
        not_tried.insert(1, f"micro-batches: {refusal}")
    made = MemoryPlan(
        model,
        checkpointed_model,
        batch_size=rows,
        device=device,
        limit_bytes=limit,
        candidates=candidates,
        chosen=chosen(candidates),
        not_tried=not_tried,
        seconds=time.perf_counter() - started,
        split_batch_norm=split_batch_norm,
        per_replica=per_replica,
    )
    logging.info("tfmemsafe.plan:\n%s", made)
    return made


def _refusal(model, source, split_batch_norm) -> str | None:
    """Why the batches cannot be split exactly, or `None` (the model
    built first, so that its layers and variables exist)."""
    batch = (source.sample_inputs(),)
    if not model.built:
        with model.distribute_strategy.scope():
            model(batch[0], training=False)
    return recovery.split_refusal(
        model, batch, split_batch_norm=split_batch_norm, from_the_start=True
    )


def _planned_here(
    model,
    source,
    rows,
    memory_limit,
    checkpointing,
    split,
    split_batch_norm,
    steps,
    verbose,
    not_tried,
):
    """`(checkpointed_model, candidates, device, limit)` on this machine:
    the model as it is and, where it can be rebuilt, with its blocks
    recomputed; what is not considered is added to `not_tried`."""
    devices = estimate_lib.devices_of(model)
    limit = limit_of(memory_limit, devices)
    models = [model]
    if checkpointing:
        variant, why = checkpointed(model)
        if variant is not None:
            models.append(variant)
        elif checkpointing == "auto":
            not_tried.append(f"checkpointing: {why}")
        else:
            raise ValueError(
                "`checkpointing=True`, and this model cannot be checkpointed "
                f"by tfmemsafe.plan: {why}."
            )
    else:
        not_tried.append("checkpointing: turned off (checkpointing=False)")
    progress = _progress(len(models), verbose)
    candidates = []
    for stage, planned in enumerate(models):
        fewer_than = None
        if stage and checkpointing == "auto":
            fewer_than = _fewest_trained(candidates)
            if fewer_than == 1:
                not_tried.append(_WHOLE_WITHOUT_RECOMPUTATION)
                break
            if fewer_than is not None:
                not_tried.append(_recomputed_at_as_many(fewer_than))
        these = predicted(
            planned,
            model,
            source,
            rows,
            limit,
            split=split,
            fewer_than=fewer_than,
        )
        progress.update(2 * stage + 1)
        candidates += measured(
            these,
            functools.partial(
                measure,
                planned,
                source=source,
                rows=rows,
                steps=steps,
                devices=devices,
                limit=limit,
                split_batch_norm=split_batch_norm,
            ),
        )
        progress.update(2 * stage + 2)
    progress.update(progress.target)
    recomputes = any(c.checkpointing for c in candidates)
    checkpointed_model = models[1] if recomputes else None
    return checkpointed_model, candidates, devices[0], limit


def _fewest_trained(candidates) -> int | None:
    """The fewest micro-batches of a candidate that trained, or `None`."""
    return min(
        (c.micro_batches for c in candidates if c.trained),
        default=None,
    )


def _recomputed_at_as_many(count: int) -> str:
    return (
        f"checkpointing at {count} micro-batches or more: the model as it is "
        f"trained at {count}, and recomputing adds a forward pass to each "
        "(checkpointing=True measures them)"
    )


def _progress(models: int, verbose) -> keras.utils.Progbar:
    """A bar of the stages: each model's prediction and measurement."""
    return keras.utils.Progbar(
        2 * models, verbose=0 if verbose == 0 else 1, unit_name="stage"
    )


def to_follow(
    plan_or_auto, model, data, rows: int, split_batch_norm, verbose
) -> MemoryPlan:
    """The `MemoryPlan` a `tfmemsafe.fit` of batches of `rows` follows:
    the one it was given, checked, or one made now for `"auto"`."""
    if plan_or_auto == "auto":
        return plan(
            model,
            data,
            batch_size=rows,
            split_batch_norm=split_batch_norm,
            verbose=0 if verbose == 0 else 1,
        )
    if not isinstance(plan_or_auto, MemoryPlan):
        raise TypeError(
            "`plan` must be None, 'auto' or a tfmemsafe.MemoryPlan. "
            f"Received: plan={plan_or_auto!r:.80}"
        )
    if plan_or_auto.batch_size != rows:
        raise ValueError(
            f"`plan` was made for batches of {plan_or_auto.batch_size}, and "
            f"this fit trains batches of {rows}. Make the plan with "
            f"batch_size={rows}."
        )
    return plan_or_auto


def _precision(model) -> str:
    return (
        "other precisions: the model computes in its dtype policy "
        f"'{model.dtype_policy.name}' (tfmemsafe.configure chooses mixed "
        "precision at import where the GPU computes faster in it)"
    )
