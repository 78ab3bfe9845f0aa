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

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _pipelines
from tfmemsafe import _sources


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
            return _sources.cycled(
                tuple(part for part in tensors if part is not None),
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
