"""The second dimension: a sample's length (a sequence's, an image side).

The probes at other lengths train on the user's own samples made longer
or shorter along axis 1: each tensor whose axis 1 has the data's length
(the inputs, and sequence targets) is repeated along it and cut to the
length asked for, so token ids stay token ids and nothing is padding.
The per-sample cost at each length is the slope between two batch sizes
there (what the batch adds, free of the floor), fitted by non-negative
least squares to the powers of the length that the traced forward pass
holds (`_graph.length_powers`).
"""

from __future__ import annotations

import itertools
import math

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _arrays
from tfmemsafe import _pipelines
from tfmemsafe import _sources
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.estimate import _graph
from tfmemsafe.estimate import _probe

# A length's second probe is at most this many times its first.
_LENGTH_PROBE_SPAN = 4
# What a length adds to the fixed part is extrapolated by the length's
# steepest power (16 times at four times the length, for a transformer's
# quadratic), so one low reading of the second probe can multiply the
# prediction at a long length many times over. A pair of probes that
# makes it more than this share of the first's growth is read again.
_CONFIRMED_EXCESS = 0.05


def base_length(source) -> int | None:
    """Axis 1 of the first input, for data whose inputs have one."""
    inputs = source.sample_inputs()
    for leaf in keras.tree.flatten(inputs):
        if len(leaf.shape) >= 2 and leaf.shape[1] is not None:
            return int(leaf.shape[1])
    return None


def resized_arguments(source, batch_size: int, length: int, steps: int):
    """`model.fit` arguments for `steps` batches at `length`."""
    base = base_length(source)

    def resize(tensor):
        if len(tensor.shape) < 2 or tensor.shape[1] != base:
            return tensor
        times = -(-length // base)
        multiples = [1, times] + [1] * (len(tensor.shape) - 2)
        return tf.tile(tensor, multiples)[:, :length]

    def resized(batch):
        return tf.nest.map_structure(resize, batch)

    return {"x": _batches(source, batch_size, steps, resized), "shuffle": False}


def _batches(source, batch_size: int, steps: int, resized):
    """`steps` batches of `source` at `batch_size`, each through `resized`."""
    if isinstance(source, _sources.Arrays):
        tensors = source.tensors()
        if tensors:
            # The run's tensors, batched and resized in the run's own
            # parallel gather, before its prefetch (whose buffers then
            # hold batches at `length`, as the run's would).
            return _arrays.cycled(
                tensors,
                batch_size,
                steps,
                one_worker=source.one_worker,
                then=resized,
            )
        # Sparse or other arrays that Keras slices itself, as they are,
        # without tf.data's rewrites (which copy what a pipeline holds).
        parts = (source.x, source.y, source.sample_weight)
        parts = tuple(part for part in parts if part is not None)
        dataset = tf.data.Dataset.from_tensor_slices(parts)
        dataset = dataset.repeat().batch(batch_size, drop_remainder=True)
        dataset = _pipelines.without_rewrites(
            dataset, one_worker=source.one_worker
        )
    else:
        dataset = source.dataset(batch_size, repeat=True)
    return dataset.map(lambda *batch: resized(batch)).take(steps)


def fit_powers(lengths, slopes, powers, relative=True) -> tuple[float, ...]:
    """Non-negative `c` with `slope(l) ~ sum(c[k] l^k for k in powers)`.

    Every subset of the terms is fitted by least squares of the relative
    errors, and the best fit with no negative coefficient wins: a negative
    term would make a longer sample cheaper. Relative, so that the
    longest length's slope (a transformer's, at 512, sixty times the one
    at 8) does not set the fit alone: fitted on absolute errors, the
    slope at 8 came out a third short. With `relative=False`, of the
    absolute errors (for values that are 0 at some lengths). Coefficients
    are per power 0, 1 (and 2).
    """
    lengths = np.asarray(lengths, float)
    slopes = np.asarray(slopes, float)
    if relative and np.count_nonzero(slopes > 0) >= 2:
        # A length whose probes sat on the floor measured no slope: its
        # zero says nothing about the polynomial, and as a relative error
        # it would flatten it.
        lengths, slopes = lengths[slopes > 0], slopes[slopes > 0]
    weights = np.ones_like(slopes)
    if relative:
        floor = 1e-3 * max(float(slopes.max()), 1e-9)
        weights = 1 / np.maximum(slopes, floor)
    target = slopes * weights
    best, best_error = None, np.inf
    for count in range(1, len(powers) + 1):
        for subset in itertools.combinations(powers, count):
            if count > len(lengths):
                continue
            matrix = np.stack([lengths**p for p in subset], axis=1)
            matrix = matrix * weights[:, None]
            solution, *_ = np.linalg.lstsq(matrix, target, rcond=None)
            if np.any(solution < 0):
                continue
            error = float(np.sum((matrix @ solution - target) ** 2))
            if error < best_error - 1e-9 * np.sum(target**2):
                coefficients = dict(zip(subset, solution, strict=True))
                best = tuple(coefficients.get(p, 0.0) for p in range(3))
                best_error = error
    if best is None:  # Slopes that fall with the length: the mean.
        best = (float(np.mean(slopes)), 0.0, 0.0)
    return tuple(float(c) for c in best)


def polynomial(coefficients, length) -> float:
    """`c0 + c1 l + c2 l^2` at `length`."""
    return sum(c * length**power for power, c in enumerate(coefficients))


def largest_at_lengths(model, source, lengths, split):
    """`(length, bytes)`: the traced step's largest tensor per sample (of
    the global batch, on one replica device) at each of `lengths`."""
    pairs = []
    for length in lengths:
        traced = _graph.per_sample_bytes(model, source.sample_inputs(), length)
        if traced is not None:
            pairs.append((int(length), traced.largest / split))
    return tuple(pairs)


def measure_lengths(
    probe, model, source, lengths, measurements, line, free, largest=None
):
    """The per-sample and fixed parts' polynomials in the length.

    At each length, two batch sizes: the first holds about half as many
    elements as the largest probe of the data's own length (fewer, if the
    length's power predicts it to grow the peak by more than `allowed`:
    twice what the largest probe did, at most half the free memory); the
    second is as large as the first's reading predicts to grow the peak
    by `allowed`, two to `_LENGTH_PROBE_SPAN` times the first. Neither is
    larger than `largest` (the first than half of it), where given: no
    batch larger is trained, so none is measured. The
    length's per-sample part is what the second holds above the data's
    length's `fixed`, per sample: its average, not the pair's slope, which
    at 512 tokens came from batches of 1 and 2 and read 12 to 20 MiB a
    sample where 7 samples held 18.6 each. What the first holds above
    the line through the second is what the length adds to the fixed
    part; where that is more than `_CONFIRMED_EXCESS` of the first's
    growth, both probes are read again, and it must show in both
    readings. (Where the polynomial falls below a probe, the estimate is
    raised there: `MemoryEstimate.per_sample_bytes_at`.)
    """
    fixed, slope = line
    base = base_length(source)
    powers = _graph.length_powers(model, source.sample_inputs(), base)
    if powers is None:
        raise MemoryEstimateError(
            "Could not estimate memory at other lengths: the model could "
            f"not be traced with inputs of another length than {base}."
        )
    replicas = model.distribute_strategy.num_replicas_in_sync
    top, top_peak, _ = measurements[-1]
    grown = max(top_peak - measurements[0][1], slope * top)
    allowed = 2 * grown if free is None else min(2 * grown, free / 2)
    points, slopes, triples, excess = [base], [slope], [], [0.0]

    def run(batch_size):
        arguments = resized_arguments(
            source, batch_size, length, _probe.PROBE_STEPS
        )
        _, peak, _ = probe.run(batch_size, arguments)
        triples.append((batch_size, length, peak))
        return peak

    for length in lengths:
        ratio = (length / base) ** max(powers)
        size = max(replicas, int(top * base / length) // 2)
        # Predicted growth at `size`, by the steepest power the graph has.
        while size > replicas and slope * size * ratio > allowed:
            size //= 2
        if largest is not None:
            size = min(size, largest // 2)
        first = max(size - size % replicas, replicas)
        low = run(first)
        # Per sample at the first, with what the length adds to the fixed.
        each = max(low - fixed, 1.0) / first
        second = min(int(allowed / each), _LENGTH_PROBE_SPAN * first)
        if largest is not None:
            second = min(second, largest)
        second = max(second - second % replicas, 2 * first)
        while second > 2 * first and not probe.room_for(fixed + each * second):
            second = max(second // 2 - second // 2 % replicas, 2 * first)
        high = run(second)
        average, added = _per_sample_and_added(
            fixed, (first, low), (second, high)
        )
        if added > _CONFIRMED_EXCESS * max(low - fixed, 1.0):
            # Each read again: the higher at the second (a step can reach
            # it), the lower at the first (both must show what is added).
            high = max(high, run(second))
            low = min(low, run(first))
            average, added = _per_sample_and_added(
                fixed, (first, low), (second, high)
            )
        points.append(length)
        slopes.append(average)
        excess.append(max(added, 0.0))
    coefficients = fit_powers(points, slopes, powers)
    fixed_coefficients = fit_powers(points, excess, powers, relative=False)
    if polynomial(coefficients, base) <= 0:
        raise MemoryEstimateError(
            "Could not estimate memory at other lengths: the peak did not "
            f"grow with the batch at length {base} "
            f"(slopes {[round(s) for s in slopes]} bytes a sample)."
        )
    return {
        "length": base,
        "length_coefficients": coefficients,
        "length_fixed_coefficients": fixed_coefficients,
        "length_measurements": tuple(triples),
    }


def _per_sample_and_added(fixed, low, high) -> tuple[float, float]:
    """`(per_sample, added)` of a length's pair of probes, `(size, peak)`
    each: per sample, the average over the fixed part at the larger; added,
    what the smaller holds beyond that (what the length adds to the fixed
    part)."""
    (first, low_peak), (second, high_peak) = low, high
    per_sample = max(high_peak - fixed, 0.0) / second
    return per_sample, low_peak - fixed - per_sample * first


def along_the_logs(points, length: int) -> float:
    """The bytes at `length` from `points`, two or more `(length, bytes)`
    pairs sorted by length: interpolated in the logs of both between
    them, the nearest pair's power carried on beyond them (at most the
    square past the longest, at most the length itself below the
    shortest)."""
    logs = [(math.log(n), math.log(b)) for n, b in points]
    at = math.log(length)
    if logs[0][0] <= at <= logs[-1][0]:
        xs, ys = zip(*logs, strict=True)
        return math.exp(float(np.interp(at, xs, ys)))
    (x0, y0), (x1, y1) = logs[:2] if at < logs[0][0] else logs[-2:]
    power = (y1 - y0) / (x1 - x0)
    power = min(max(power, 0.0), 1.0 if at < x0 else 2.0)
    x, y = (x0, y0) if at < x0 else (x1, y1)
    return math.exp(y + power * (at - x))
