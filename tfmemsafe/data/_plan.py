"""How `memory_buckets` sizes each bucket's batch: the memory model it
plans from (measured on the data's own examples, or given), what else is
in use, and the largest batch at each bucket's length that leaves the
headroom free, raised where a few real steps held more than predicted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math

import keras
import numpy as np
from absl import logging

from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._messages import mib
from tfmemsafe._sources import source_for
from tfmemsafe.data import _lengths
from tfmemsafe.data import _workers
from tfmemsafe.errors import MemoryEstimateError

# The share of the free memory the probes may take (`estimate_source`):
# over twice `estimate_memory`'s, so that the largest probe is about half
# the size a bucket gets.
_PROBE_BUDGET = 0.45


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How a bucket's batch is chosen from a memory model."""

    cap: int  # `max_batch_size`, a multiple of `multiple`.
    multiple: int
    headroom: float
    max_tokens: int | None = None
    verbose: object = 0  # Of the probes' progress bar, as `model.fit`'s.

    def size_at(self, estimate, held: int, length: int) -> int:
        """The largest batch at `length` that leaves the headroom free
        with `held` in use, by `estimate`."""
        size = estimate.max_batch_size(
            _usable_limit(estimate, held, self.headroom),
            headroom=self.headroom,
            multiple=self.multiple,
            length=length,
        )
        if self.max_tokens is not None:
            tokens = self.max_tokens // length
            size = min(size, tokens - tokens % self.multiple)
        return min(size, self.cap)


def check_estimate(estimate) -> None:
    if not isinstance(estimate, estimate_lib.MemoryEstimate):
        raise TypeError(
            "`estimate` must be a tfmemsafe.MemoryEstimate or None. "
            f"Received: estimate={estimate!r:.80}"
        )
    if not estimate.length_coefficients:
        raise ValueError(
            "`estimate` must be made with `lengths` (a second dimension): "
            "tfmemsafe.estimate_memory(model, data, lengths=[...]). "
            "Received an estimate without one."
        )


def planned(model, dataset, lengths, padded, counts, estimate, sizing):
    """This worker's memory model, what else is in use, and each bucket's
    largest batch by them.

    Without `estimate`, one is measured on the data's own examples,
    resized to the length of the bucket holding the median example, and
    probed also at other buckets' lengths; then each bucket's batch is
    trained for a few steps and the estimate raised where a step held
    more than predicted, so that no size is above what a measurement says
    fits; and none is above the most examples a bucket holds, the
    largest batch probed. Under a multi-worker strategy it is measured on
    a local copy of the model and made one replica's of the job (see
    `_workers`), as a given `estimate` (one device's) is.
    """
    strategy = model.distribute_strategy
    workers = distribute.is_multi_worker(strategy)
    replicas = strategy.num_replicas_in_sync if workers else 1
    if estimate is not None:
        estimate = _workers.global_estimate(_without_data(estimate), replicas)
        held = estimate_lib.held_bytes(estimate.device, estimate.state_bytes)
        return (
            estimate,
            held,
            [sizing.size_at(estimate, held, n) for n in padded],
        )
    _check_every_input_varies(dataset)
    # No batch of this data holds more than the most examples a bucket
    # holds (a replica's share of it, on several workers): no larger one
    # is measured, or given.
    most = min(
        sizing.cap, _lengths.round_up(max(counts) * replicas, sizing.multiple)
    )
    median = float(np.median(lengths))
    base = next(length for length in padded if length >= median)
    copying = _workers.local_copy(model) if workers else None
    with copying or contextlib.nullcontext(model) as measured:
        source = source_for(
            _lengths.resized(dataset, base),
            "dataset",
            labelled=True,
            strategy=measured.distribute_strategy,
        )
        first = estimate_lib.estimate_source(
            measured,
            source,
            lengths=_probe_lengths(padded, base),
            largest=max(-(-most // replicas), estimate_lib.FEWEST_PROBED),
            probe_budget=_PROBE_BUDGET,
            verbose=sizing.verbose,
        )
        first = _workers.global_estimate(first, replicas)
        # What else is in use than the model (and its copy, which is
        # deleted before training; the model's optimizer may not be built
        # yet), read once for every size.
        state = first.state_bytes
        if copying:
            state += estimate_lib.state_bytes(model)
        held = estimate_lib.held_bytes(first.device, state)
        sizes = [sizing.size_at(first, held, n) for n in padded]
        estimate = first
        if all(sizes):
            multiple = sizing.multiple
            batches = [
                (max(multiple, min(size, count) // multiple * multiple), n)
                for size, count, n in zip(sizes, counts, padded, strict=True)
            ]
            estimate = _measured(measured, source, first, batches, replicas)
    # The copy's memory goes now, not whenever the garbage is collected
    # next: a Keras model is in reference cycles.
    measured = source = None
    if copying:
        gc.collect()
    # Never larger than before the measurements: one at a length may need
    # less raising there than its neighbours' did before.
    sizes = [
        min(
            sizing.size_at(first, held, n),
            sizing.size_at(estimate, held, n),
            most,
        )
        for n in padded
    ]
    return estimate, held, sizes


def _without_data(estimate):
    """`estimate` without the arrays it was made on (`data_bytes`, in its
    fixed part and every reading): a bucketed pipeline does not hold them,
    and what is in memory now is counted as held beside the line."""
    data = estimate.data_bytes
    if not data:
        return estimate
    return dataclasses.replace(
        estimate,
        fixed_bytes=estimate.fixed_bytes - data,
        measurements=tuple((b, p - data) for b, p in estimate.measurements),
        length_measurements=tuple(
            (b, n, p - data) for b, n, p in estimate.length_measurements
        ),
        data_bytes=0,
    )


def _probe_lengths(padded, base) -> list:
    """The other lengths to probe than `base` (the median example's
    bucket's, the probes' data's): the shortest and longest buckets', and
    midway (geometrically) between them and `base`: five lengths for at
    most three terms, so that no one length's reading sets the
    polynomial. Ints >= 1 other than `base`, sorted, as `estimate_source`
    wants them."""
    others = {padded[0], padded[-1]}
    for end in (padded[0], padded[-1]):
        middle = _lengths.round_up(int(round(math.sqrt(end * base))))
        others.add(min(max(middle, padded[0]), padded[-1]))
    others = sorted(others - {base})
    if not others:  # One bucket: any other length gives the slope in it.
        others = [max(base // 2, 1)]
    return others


# Steps each bucket's batch is measured for; the highest counts.
_MEASURED_STEPS = 3


def _measured(model, source, estimate, batches, replicas=1):
    """`estimate` with each `(batch_size, length)` of `batches` measured.

    One `model.fit` trains `_MEASURED_STEPS` steps of each, the examples
    resized as the probes resize them (one trace: the batches differ only
    in their shape). The highest step of each is added to the estimate's
    `length_measurements`, which raises the prediction where it held
    more (`MemoryEstimate.per_sample_bytes_at`). A batch that runs out
    counts as the whole limit, and the steps go on with the next. The
    model is left as it was. `model` may be one of `replicas` devices'
    copy (`_workers.local_copy`): it trains each global batch's share.
    """
    batches = [(max(size // replicas, 1), length) for size, length in batches]
    devices = [estimate.device]
    probe = estimate_lib.Probe(
        model, source, devices, limits={estimate.device: estimate.limit_bytes}
    )
    triples = []
    try:
        while len(triples) < len(batches):
            remaining = batches[len(triples) :]
            data = None
            for size, length in remaining:
                part = estimate_lib.resized_arguments(
                    source, size, length, _MEASURED_STEPS
                )["x"]
                data = part if data is None else data.concatenate(part)
            peaks, error = probe.step_peaks(
                remaining[0][0], {"x": data, "shuffle": False}
            )
            steps = peaks[estimate.device]
            for (size, length), start in zip(
                remaining,
                range(0, len(steps) - _MEASURED_STEPS + 1, _MEASURED_STEPS),
                strict=False,
            ):
                highest = max(steps[start : start + _MEASURED_STEPS])
                triples.append((size * replicas, length, highest))
            if error is not None:
                # Its frames (and its context's) hold the failed step's
                # tensors.
                while error is not None:
                    error.__traceback__ = None
                    error = error.__cause__ or error.__context__
                size, length = batches[len(triples)]
                triples.append((size * replicas, length, estimate.limit_bytes))
            elif len(triples) < len(batches):
                raise MemoryEstimateError(
                    "Could not measure the buckets' batches: "
                    f"{estimate.device} reported no peak memory."
                )
    finally:
        probe.close()
    for size, length, peak in triples:
        logging.vlog(
            1,
            "tfmemsafe.data.memory_buckets: batch %d at length %d peaked "
            "at %s (predicted %s).",
            size,
            length,
            mib(peak),
            mib(estimate.peak_bytes(size, length)),
        )
    return dataclasses.replace(
        estimate,
        length_measurements=estimate.length_measurements + tuple(triples),
    )


def _usable_limit(estimate, held: int, headroom: float) -> int:
    """The limit that leaves `headroom` of the device's free with `held`
    in use: `fit`'s rule (`memory.fits_within` of the peak and what is
    held), as a limit for `MemoryEstimate.max_batch_size`."""
    if estimate.limit_bytes is None:
        raise ValueError(
            f"The memory limit of {estimate.device} is unknown, so no batch "
            "size can be chosen by memory. Pass a `tfmemsafe."
            "MemoryEstimate` whose device has a known limit."
        )
    return max(int(estimate.limit_bytes - held / (1 - headroom)), 1)


def _check_every_input_varies(dataset) -> None:
    """The probes resize every input with a second axis of the data's
    length; an input that does not vary could be resized with them."""
    spec = dataset.element_spec
    inputs = spec[0] if isinstance(spec, tuple) else spec
    fixed = [
        leaf
        for leaf in keras.tree.flatten(inputs)
        if leaf.shape.rank and leaf.shape[0] is not None
    ]
    if fixed:
        raise ValueError(
            "`memory_buckets` can estimate memory only for examples whose "
            "inputs all vary in length (along their first axis): the "
            "memory model resizes them all. Pass an `estimate` made with "
            "`tfmemsafe.estimate_memory(..., lengths=...)`. Received "
            f"inputs of fixed shape too: {fixed}"
        )


def raise_too_long(longest: int, estimate, held, sizing):
    """Says that the job's longest example fits in no batch."""
    multiple, headroom = sizing.multiple, sizing.headroom

    def fits(length):
        return sizing.size_at(estimate, held, length) >= multiple

    fits_alone = estimate_lib.largest_fitting(fits, 1) if fits(1) else 0
    raise ValueError(
        f"`dataset` holds an example of length {longest}, longer than any "
        f"predicted to fit in a batch of {multiple} with "
        f"{100 * headroom:.0f}% of the {mib(estimate.limit_bytes)} of "
        f"{estimate.device} free: the longest that fits is {fits_alone}. "
        "Cut or leave out the longest examples (`dataset.filter`)."
    )
