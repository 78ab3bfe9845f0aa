"""The user's data as `model.fit`, `evaluate` and `predict` take it.

`tfmemsafe.fit`, `evaluate` and `predict` take what Keras takes, plus two
forms of their own: a tuple `(x, y[, sample_weight])` of arrays as `x`,
and a callable `batch_size -> tf.data.Dataset`. `keras_data` turns them
into Keras' arguments; every `tf.data` pipeline handed to Keras goes
through `_pipelines.for_keras`, so that a batch that cannot be allocated
raises instead of ending the process.
"""

from __future__ import annotations

import collections.abc
import contextlib
import math
import types

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _pipelines
from tfmemsafe import distribute
from tfmemsafe._per_step_variables import without_per_step_variables
from tfmemsafe._sources import DEFAULT_BATCH_SIZE
from tfmemsafe._sources import source_for
from tfmemsafe.errors import OutOfMemoryError


def is_iterable_only(x) -> bool:
    """Whether `x` is data only Keras' own loop reads: a `PyDataset`, or
    a generator or iterator."""
    return isinstance(
        x,
        (
            keras.utils.PyDataset,
            types.GeneratorType,
            collections.abc.Iterator,
        ),
    )


def check_x_and_y(x, y) -> None:
    """Refuses `x` or `y` of no kind Keras or tfmemsafe takes, and `y`
    beside an `x` that brings its own targets.

    Raises:
        TypeError: naming the argument of no kind.
        ValueError: for a `y` beside a dataset, generator or callable.
    """
    check_kind(x, "x")
    check_kind(y, "y")
    if y is not None and (
        isinstance(x, tf.data.Dataset) or is_iterable_only(x) or callable(x)
    ):
        raise ValueError(
            "`y` must not be passed when `x` is a tf.data.Dataset, a "
            "PyDataset, a generator or a callable: the targets come with "
            f"`x`. Received: x of type {type(x).__name__} and y"
        )


def check_kind(data, argument: str) -> None:
    """Refuses data of no kind Keras or tfmemsafe takes.

    Raises:
        TypeError: naming `argument`.
    """
    if data is None or is_iterable_only(data) or callable(data):
        return
    leaves = keras.tree.flatten(data) if isinstance(data, list) else []
    if not all(leaf is None or hasattr(leaf, "shape") for leaf in leaves):
        # As Keras: a list holds arrays (of each input), not numbers.
        raise TypeError(
            f"`{argument}` must be arrays or tensors, or a list or dict of "
            "them, not a list of Python numbers (use `np.asarray`). "
            f"Received: {argument}={data!r:.80} of type list"
        )
    if isinstance(data, (tf.data.Dataset, tf.Tensor, np.ndarray, dict, list)):
        return
    if isinstance(data, tuple) and all(
        part is None or _is_array_like(part) for part in data
    ):
        return
    if _is_array_like(data):
        return
    raise TypeError(
        f"`{argument}` must be arrays or tensors, a tuple `(x, y)` or `(x, "
        "y, sample_weight)` of them, a tf.data.Dataset, a callable "
        "`batch_size -> tf.data.Dataset`, a keras.utils.PyDataset, or a "
        f"generator of batches. Received: {argument}={data!r:.80} of type "
        f"{type(data).__name__}"
    )


def unpacked(x, y=None, sample_weight=None) -> tuple:
    """`(x, y, sample_weight)`, from tfmemsafe's form `x=(x, y[, sw])`."""
    if (
        y is None
        and sample_weight is None
        and isinstance(x, tuple)
        and len(x) in (2, 3)
    ):
        return keras.utils.unpack_x_y_sample_weight(x)
    return x, y, sample_weight


def keras_data(data, batch_size, strategy, argument: str = "x") -> tuple:
    """`data` as Keras takes it, and the batch size to pass with it.

    A callable is called with `batch_size` (else 32), and an unbatched
    dataset batched at it; a batched dataset is rebatched when a
    different `batch_size` is given and its own is known (not for length
    buckets). Datasets are passed with no batch size, as Keras wants
    them; other data as it is.

    Returns:
        `(data, batch_size_for_keras, rows_per_batch)`, the last `None`
        where the data says it alone.
    """
    if callable(data) and not isinstance(data, keras.utils.PyDataset):
        size = batch_size or DEFAULT_BATCH_SIZE
        made = data(size)
        if not isinstance(made, tf.data.Dataset):
            raise TypeError(
                f"`{argument}` must return a tf.data.Dataset when called "
                f"with a batch size. Received: {argument}({size}) = "
                f"{made!r:.80}"
            )
        data = made
        if not _pipelines.batching_of(data)[0]:
            data = data.batch(size)
        return _for_keras(data, strategy), None, size
    if isinstance(data, tf.data.Dataset):
        batched, size = _pipelines.batching_of(data)
        if not batched:
            size = batch_size or DEFAULT_BATCH_SIZE
            data = data.batch(size)
        elif size is not None and batch_size not in (None, size):
            data, size = _pipelines.rebatched(data, batch_size), batch_size
        return _for_keras(data, strategy), None, size or batch_size
    if is_iterable_only(data):
        return data, None, None
    return data, batch_size, batch_size or DEFAULT_BATCH_SIZE


def samples_of(data, validation_split: float = 0.0) -> int | None:
    """The samples `model.fit` trains on in an epoch of `data`, where
    known without reading it: the rows of arrays (less the last
    `validation_split` of them, as Keras splits), a dataset's by its
    pipeline; else `None`."""
    if isinstance(data, tf.data.Dataset):
        return source_for(data, "x", labelled=False).num_samples
    if is_iterable_only(data) or callable(data):
        return None
    shape = getattr(keras.tree.flatten(data)[0], "shape", None)
    if not shape or shape[0] is None:
        return None
    return max(1, math.floor(int(shape[0]) * (1.0 - (validation_split or 0))))


def varies_in_length(data) -> bool:
    """Whether `data` is an unbatched dataset some input of which varies
    in length from example to example."""
    if not isinstance(data, tf.data.Dataset) or _pipelines.batching_of(data)[0]:
        return False
    spec = data.element_spec
    inputs = spec[0] if isinstance(spec, tuple) else spec
    return any(
        isinstance(leaf, tf.RaggedTensorSpec)
        or (
            isinstance(leaf, tf.TensorSpec)
            and leaf.shape.rank
            and leaf.shape[0] is None
        )
        for leaf in tf.nest.flatten(inputs)
    )


def padded_batches(data) -> bool:
    """Whether `data` is a batched dataset whose examples vary in length
    (padded to each batch's longest): it cannot be batched again."""
    if not isinstance(data, tf.data.Dataset):
        return False
    if not _pipelines.batching_of(data)[0]:
        return False
    return _pipelines.padded_to_each_batch(data.element_spec)


@contextlib.contextmanager
def chained_cause():
    """An `OutOfMemoryError` out of a Keras call inside gets back the
    cause Keras' re-raise (`from None`) dropped; and the whole call, its
    callbacks too, runs without Grappler's `AddN` rewrite
    (`_per_step_variables`), as the held steps do."""
    try:
        with without_per_step_variables():
            yield
    except OutOfMemoryError as err:
        if err.__cause__ is None and err.error is not None:
            raise err from err.error
        raise


def _for_keras(dataset, strategy):
    return _pipelines.for_keras(
        dataset, one_worker=not distribute.is_multi_worker(strategy)
    )


def _is_array_like(value) -> bool:
    return isinstance(value, (np.ndarray, tf.Tensor, dict, list)) or hasattr(
        value, "__array__"
    )
