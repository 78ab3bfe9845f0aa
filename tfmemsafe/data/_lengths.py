"""What an example's length is: read, checked, bucketed, resized.

The parts of `memory_buckets` that look at the examples alone, before
any memory is measured: the default `length_fn`, one pass over the data
for every length, the default bucket boundaries (or the user's, checked),
and the examples resized to one length for the memory model's probes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _pipelines

# Each default bucket's length is at least this times the one before, so
# 8 to 1,024 takes twelve buckets: twelve traced steps.
BUCKET_RATIO = 1.5
# Default bucket lengths are multiples of this (a GPU's tensor cores').
LENGTH_MULTIPLE = 8
# Lengths are read in batches of this many examples.
_READ_BATCH = 4096


def check_unbatched(dataset) -> None:
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "`dataset` must be an unbatched tf.data.Dataset of examples. "
            f"Received: dataset={dataset!r:.80} of type "
            f"{type(dataset).__name__}"
        )
    batched, size = _pipelines.batching_of(dataset)
    if batched:
        raise ValueError(
            "`dataset` must be unbatched (one example per element): the "
            "buckets batch it, each at its own size. Received a dataset "
            f"batched{'' if size is None else f' by {size}'}; pass it "
            "before its `batch`, or `dataset.unbatch()`."
        )


def examples(dataset):
    """`dataset` with its one-row ragged parts as dense tensors.

    `from_tensor_slices` of a `tf.RaggedTensor` gives each row as a
    ragged tensor of ragged rank 0, which `padded_batch` refuses; a `map`
    hands them on as the dense tensors they are.
    """
    ragged = [
        spec
        for spec in tf.nest.flatten(dataset.element_spec)
        if isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank == 0
    ]
    return _pipelines.passed_through(dataset) if ragged else dataset


def length_fn_of(dataset, length_fn) -> Callable:
    """`length_fn` (or the default), returning a scalar `int32`."""
    if length_fn is None:
        length_fn = _default_length_fn(dataset.element_spec)
    elif not callable(length_fn):
        raise TypeError(
            "`length_fn` must be a callable returning an example's length, "
            f"or None. Received: length_fn={length_fn!r:.80}"
        )
    try:
        spec = dataset.map(length_fn).element_spec
    except (tf.errors.InvalidArgumentError, ValueError) as err:
        # `map` refuses a function that returns nothing (`None`).
        raise TypeError(
            "`length_fn` must return a scalar integer, the example's "
            "length. Received: length_fn returning nothing"
        ) from err
    if (
        not isinstance(spec, tf.TensorSpec)
        or spec.shape.rank != 0
        or not spec.dtype.is_integer
    ):
        raise TypeError(
            "`length_fn` must return a scalar integer, the example's "
            f"length. Received: length_fn returning {spec}"
        )
    user_fn = length_fn

    def as_int32(*parts):
        return tf.cast(user_fn(*parts), tf.int32)

    return as_int32


def _default_length_fn(element_spec) -> Callable:
    """The first axis of the first input leaf whose first axis varies."""
    labelled = isinstance(element_spec, tuple)
    leaves = keras.tree.flatten(element_spec[0] if labelled else element_spec)
    varying = [
        index
        for index, leaf in enumerate(leaves)
        if getattr(leaf, "shape", None) is not None
        and leaf.shape.rank
        and leaf.shape[0] is None
    ]
    if not varying:
        raise ValueError(
            "`dataset`'s inputs have no axis of varying length, so "
            "`length_fn` is needed to say an example's length. Received "
            f"examples of {element_spec}"
        )
    index = varying[0]

    def first_axis(*parts):
        inputs = parts[0] if labelled else parts
        return tf.shape(keras.tree.flatten(inputs)[index])[0]

    return first_axis


def read_lengths(dataset, length_fn) -> np.ndarray:
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` must be finite: every example's length is read once "
            "to choose the buckets. Received an endless dataset; pass it "
            "before its `repeat()`."
        )
    batches = dataset.map(length_fn).batch(_READ_BATCH)
    parts = [np.asarray(b) for b in batches.as_numpy_iterator()]
    lengths = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if not lengths.size:
        raise ValueError("`dataset` must hold at least one example.")
    if lengths.min() < 0:
        index = int(np.argmin(lengths))
        raise ValueError(
            "`length_fn` must return lengths >= 0. Received: a length of "
            f"{int(lengths[index])} for example {index}"
        )
    if lengths.max() == 0:
        raise ValueError(
            "`dataset` must hold an example longer than 0: `length_fn` "
            f"returned 0 for all {lengths.size} examples."
        )
    return lengths.astype(np.int64)


def round_up(length: int, multiple: int = LENGTH_MULTIPLE) -> int:
    return -(-length // multiple) * multiple


def candidate_boundaries(lengths) -> list[int]:
    """The default boundaries: padded lengths of 8k, each at least 1.5
    times the last, plus one, from the shortest to the longest of
    `lengths` (empty buckets included: `memory_buckets` leaves them out
    once it has counted)."""
    longest = round_up(max(int(lengths.max()), 1))
    padded = [min(round_up(max(int(lengths.min()), 1)), longest)]
    while padded[-1] < longest:
        grown = round_up(math.ceil(padded[-1] * BUCKET_RATIO))
        padded.append(min(grown, longest))
    return [length + 1 for length in padded]


def bucket_counts(boundaries, lengths) -> np.ndarray:
    """How many of `lengths` each bucket holds (none past the last)."""
    return np.bincount(
        np.searchsorted(boundaries, lengths, side="right"),
        minlength=len(boundaries),
    )[: len(boundaries)]


def checked_boundaries(bucket_boundaries, lengths) -> list[int]:
    if isinstance(bucket_boundaries, (str, bytes)) or not hasattr(
        bucket_boundaries, "__iter__"
    ):
        raise TypeError(
            "`bucket_boundaries` must be a list of integers or None. "
            f"Received: bucket_boundaries={bucket_boundaries!r}"
        )
    boundaries = list(bucket_boundaries)
    if (
        not boundaries
        or not all(_is_integer(b) and b >= 2 for b in boundaries)
        or sorted(set(boundaries)) != boundaries
    ):
        raise ValueError(
            "`bucket_boundaries` must be a non-empty list of increasing "
            "integers >= 2 (bucket `i` holds the lengths from boundary "
            "`i - 1` up to one less than boundary `i`). Received: "
            f"bucket_boundaries={boundaries!r}"
        )
    boundaries = [int(b) for b in boundaries]
    longest = int(lengths.max())
    if longest >= boundaries[-1]:
        boundaries.append(longest + 1)
    return boundaries


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def resized(dataset, length: int):
    """Examples made `length` long: their own values repeated, or cut."""

    def resize(tensor):
        if tensor.shape.rank and tensor.shape[0] is None:
            times = -(-length // tf.shape(tensor)[0])
            multiples = tf.concat(
                [[times], tf.ones([tensor.shape.rank - 1], tf.int32)], 0
            )
            tensor = tf.tile(tensor, multiples)[:length]
            return tf.ensure_shape(tensor, [length, *tensor.shape[1:]])
        return tensor

    def nonempty(*parts):
        # Every varying part, not only the one `length_fn` reads: an empty
        # one cannot be repeated to any length.
        sizes = [
            tf.shape(t)[0]
            for t in tf.nest.flatten(parts)
            if t.shape.rank and t.shape[0] is None
        ]
        if not sizes:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(sizes) > 0)

    kept = dataset.filter(nonempty)
    if isinstance(dataset.element_spec, tuple):
        return kept.map(lambda *parts: tf.nest.map_structure(resize, parts))
    return kept.map(lambda part: tf.nest.map_structure(resize, part))
