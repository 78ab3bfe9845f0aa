"""How the workers of a multi-worker job agree on one plan of buckets.

Under `MultiWorkerMirroredStrategy` every step sums the gradients of all
workers, so every worker must take the same steps: its batches are its
share of the same global batches. `memory_buckets` therefore plans from
figures every worker shares, exchanged with the strategy's own
all-reduce (`Strategy.reduce`, eagerly):

- the lengths: the shortest and the longest example of any worker set the
  default boundaries, and a bucket is kept where any worker has an
  example;
- the memory: each worker measures its own device, on a copy of the model
  outside the strategy, and each bucket takes the smallest batch any
  worker predicts to fit. A probe of the model itself would run the job's
  collectives, and workers whose probes differed (each reads its own
  free memory) would wait for each other for ever.

A worker that fails while planning says so in the next exchange, so that
every worker raises instead of waiting for it.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from tfmemsafe import _agreement
from tfmemsafe.data import _lengths

_CALLER = "`memory_buckets`"


def exchanged(strategy, plan, width: int):
    """`_agreement.exchanged` for `memory_buckets`."""
    return _agreement.exchanged(strategy, plan, width, _CALLER)


def agreed_buckets(strategy, lengths, bucket_boundaries):
    """The boundaries and counts every worker plans with.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        lengths: This worker's example lengths, or a callable returning
            them (it may raise; every worker then raises).
        bucket_boundaries: The user's, unchecked, or `None`.

    Returns:
        `(boundaries, counts, lengths, longest)`: the boundaries of the
        buckets any worker has examples in, each bucket's largest count on
        a worker, this worker's lengths, and the longest example of any.
    """
    mine = {}

    def extremes():
        mine["lengths"] = lengths() if callable(lengths) else lengths
        return [-mine["lengths"].min(), mine["lengths"].max()]

    table = exchanged(strategy, extremes, 2).max(axis=0)
    extreme = np.array([-table[0], table[1]], np.int64)
    if bucket_boundaries is None:
        candidates = _lengths.candidate_boundaries(extreme)
    else:
        candidates = _lengths.checked_boundaries(bucket_boundaries, extreme)

    def counts():
        return _lengths.bucket_counts(candidates, mine["lengths"])

    most = exchanged(strategy, counts, len(candidates)).max(axis=0)
    kept = [(b, int(c)) for b, c in zip(candidates, most, strict=True) if c]
    boundaries, counts = [b for b, _ in kept], [c for _, c in kept]
    return boundaries, counts, mine["lengths"], int(extreme[1])


def agreed_sizes(strategy, sizes, width: int) -> list[int]:
    """Each of `width` buckets' smallest batch size over the workers.

    `sizes()` returns this worker's; if it raises, every worker raises.
    """
    return [int(s) for s in exchanged(strategy, sizes, width).min(axis=0)]


def local_copy(model: keras.Model):
    """`_agreement.local_copy` for `memory_buckets`."""
    return _agreement.local_copy(
        model,
        _CALLER,
        remedy=", or pass an `estimate` of one device's step, made with "
        "`tfmemsafe.estimate_memory(..., lengths=...)` on a model outside "
        "the strategy",
    )


def global_estimate(estimate, replicas: int):
    """A one-device estimate as one of `replicas` devices' in a job.

    Each replica trains `1 / replicas` of a global batch, so the
    per-sample figures divide and the measured batch sizes multiply
    (a `MemoryEstimate`'s batch sizes are global).
    """
    if replicas == 1:
        return estimate
    return dataclasses.replace(
        estimate,
        per_sample_bytes=estimate.per_sample_bytes / replicas,
        largest_tensor_bytes=estimate.largest_tensor_bytes / replicas,
        largest_tensor_lengths=tuple(
            (length, each / replicas)
            for length, each in estimate.largest_tensor_lengths
        ),
        measurements=tuple(
            (size * replicas, peak) for size, peak in estimate.measurements
        ),
        length_measurements=tuple(
            (size * replicas, length, peak)
            for size, length, peak in estimate.length_measurements
        ),
    )
