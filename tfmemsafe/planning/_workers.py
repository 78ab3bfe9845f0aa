"""How the workers of a multi-worker job make one plan: `agreed`.

Under `MultiWorkerMirroredStrategy` each worker trains its share of every
global batch, and every worker must split its share alike. So each worker
measures its own device, on a copy of the model outside the strategy
(`_agreement.local_copy`: a probe of the model itself would run the job's
collectives) at its share of the batch, and the workers choose from
figures they all hold, exchanged with the strategy's own all-reduce
(`_agreement.exchanged`):

- every split of the share, from the whole share to micro-batches of one
  row, is predicted on every worker; the job's prediction is the highest,
  and a split fits the job where it fits every worker;
- the fewest micro-batches that fit the job are trained on every worker,
  and twice as many where that did not train on every worker; one
  trained where it trained on every worker, its step time the slowest
  worker's and its peak the highest;
- the same rule then chooses from the same figures on every worker.

A worker whose planning raises says so in the next exchange, and every
worker raises instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc

import numpy as np

from tfmemsafe import _agreement
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._sources import source_for
from tfmemsafe.planning._candidates import FITTING_PER_MODEL
from tfmemsafe.planning._candidates import limit_of
from tfmemsafe.planning._candidates import predicted
from tfmemsafe.planning._measure import measure
from tfmemsafe.planning._measure import measured
from tfmemsafe.planning._memory_plan import STATIC_BOUND
from tfmemsafe.planning._memory_plan import Candidate

_CALLER = "tfmemsafe.plan"


def planned_by_every_worker(
    model, data, rows, memory_limit, refusal, split_batch_norm, steps, progress
):
    """`(candidates, share, device, limit, refusal)` of a multi-worker
    job's batches of `rows`, the same on every worker: each measures its
    share of the batch (`share` rows) on a copy of the model outside the
    strategy. `refusal()` says why the batches cannot be split, if so."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    share = -(-rows // replicas)
    candidates, device, limit, why = _planned_on_a_copy(
        model,
        data,
        share,
        memory_limit,
        refusal,
        split_batch_norm,
        steps,
        progress,
    )
    # The copy's memory goes before the run (a Keras model is in
    # reference cycles).
    gc.collect()
    # Micro-batches of the global batch, as `SplitBatchOnOOM` takes them.
    candidates = [
        dataclasses.replace(c, micro_batch_size=c.micro_batch_size * replicas)
        for c in candidates
    ]
    return candidates, share, device, limit, why


def _planned_on_a_copy(
    model, data, share, memory_limit, refusal, split_batch_norm, steps, progress
):
    strategy = model.distribute_strategy
    with contextlib.ExitStack() as stack:
        ready = {}

        def prepare():
            # Inside an exchange: a worker that cannot start planning (the
            # model's first call, its copy) says so to the others.
            ready["refusal"] = refusal()
            ready["copy"] = stack.enter_context(
                _agreement.local_copy(model, _CALLER)
            )
            ready["source"] = source_for(
                data,
                "x",
                labelled=True,
                strategy=ready["copy"].distribute_strategy,
            )
            ready["devices"] = estimate_lib.devices_of(ready["copy"])
            ready["limit"] = limit_of(memory_limit, ready["devices"])
            return []

        _agreement.exchanged(strategy, prepare, 0, _CALLER)
        copy, source = ready["copy"], ready["source"]
        devices, limit = ready["devices"], ready["limit"]
        split = ready["refusal"] is None
        candidates = agreed_predictions(
            strategy,
            lambda: predicted(copy, copy, source, share, limit, split, True),
            share.bit_length() if split else 1,
        )
        progress.update(1)
        candidates = agreed_measurements(
            strategy,
            functools.partial(
                measure,
                copy,
                source=source,
                rows=share,
                steps=steps,
                devices=devices,
                limit=limit,
                split_batch_norm=split_batch_norm,
            ),
            candidates,
        )
        progress.update(2)
        return candidates, devices[0], limit, ready["refusal"]


def agreed_predictions(strategy, predict, splits: int) -> list[Candidate]:
    """`predict()`'s candidates, the same on every worker.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        predict: Returns this worker's candidates: `splits` of them, one
            per halving of its share, or one without a prediction.
        splits: int. How many halvings every worker predicts.

    Returns:
        The candidates up to the second that fits the job, each with the
        highest prediction of any worker, fitting where it fits on every
        worker; or the whole share alone, without a prediction, where a
        worker could not predict.
    """
    mine = {}

    def figures():
        mine["candidates"] = candidates = predict()
        if len(candidates) != splits or any(
            c.predicted_peak_bytes is None for c in candidates
        ):
            return np.full(3 * splits, np.nan)
        return [
            value
            for c in candidates
            for value in (
                c.predicted_peak_bytes,
                c.fits,
                c.predicted_by == STATIC_BOUND,
            )
        ]

    table = _agreement.exchanged(strategy, figures, 3 * splits, _CALLER)
    candidates = mine["candidates"]
    if np.isnan(table).any():
        first = candidates[0]
        why = (
            first.predicted_by
            if first.predicted_peak_bytes is None
            else "another worker could not predict its step's peak"
        )
        return [Candidate(1, first.micro_batch_size, False, None, why, None)]
    agreed, fitting = [], 0
    for index, candidate in enumerate(candidates):
        peaks, fit, bound = table[:, 3 * index : 3 * index + 3].T
        fits = bool(fit.min())
        agreed.append(
            dataclasses.replace(
                candidate,
                predicted_peak_bytes=int(peaks.max()),
                predicted_by=STATIC_BOUND if bound.all() else "estimate",
                fits=fits,
            )
        )
        fitting += fits
        if fitting == FITTING_PER_MODEL:
            break
    return agreed


def agreed_measurements(strategy, measure_one, candidates) -> list[Candidate]:
    """`candidates` measured as `measured` does, the same on every worker:
    one exchange per candidate measured, of this worker's `measure_one`;
    the slowest worker's step time and the highest peak, and a candidate
    that did not train (or went over the limit) on any worker not
    trained."""
    return measured(
        candidates, functools.partial(_agreed, strategy, measure_one)
    )


def _agreed(strategy, measure_one, candidate) -> Candidate:
    """`measure_one(candidate)` on every worker, as one candidate."""
    seconds, peaks = _agreement.exchanged(
        strategy,
        functools.partial(_figures, measure_one, candidate),
        2,
        _CALLER,
    ).T
    peak = None if np.isnan(peaks).any() else int(peaks.max())
    if np.isnan(seconds).any():
        return dataclasses.replace(
            candidate,
            measured_peak_bytes=peak,
            note="did not train within the limit on every worker",
        )
    return dataclasses.replace(
        candidate,
        measured_peak_bytes=peak,
        step_seconds=float(seconds.max()),
    )


def _figures(measure_one, candidate) -> list:
    """This worker's step time and peak of `candidate`, NaN where none."""
    done = measure_one(candidate)
    return [
        np.nan if value is None else value
        for value in (done.step_seconds, done.measured_peak_bytes)
    ]
