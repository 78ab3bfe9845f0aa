"""The user's arrays as tensors: their batches, gathered as a run trains
on them, and their bytes."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _pipelines


def num_rows(structure) -> int:
    """The length of the first dimension of a structure's first array."""
    return int(keras.tree.flatten(structure)[0].shape[0])


def cycled(
    parts,
    batch_size: int,
    steps: int,
    *,
    one_worker: bool,
    then=None,
    known_size: bool = True,
):
    """`steps` batches of `batch_size` rows of `parts` (a tuple of
    structures of tensors, its `None`s left out) from the first row,
    wrapping round at the end, made as the run's own are (`gathered`, with
    `then`): the probes' and the trials'. With `known_size=False` the
    batches' first dimension is unknown to whatever traces them, so that
    one traced step serves every size."""
    parts = tuple(part for part in parts if part is not None)
    rows = int(keras.tree.flatten(parts[0])[0].shape[0])
    indices = tf.data.Dataset.range(rows).repeat()
    # Every batch is full either way: the indices repeat without end.
    indices = indices.batch(batch_size, drop_remainder=known_size)
    indices = indices.take(steps)
    return gathered(indices, parts, one_worker=one_worker, then=then)


def gathered(indices, parts, *, one_worker: bool, then=None):
    """The batches of `parts` (a structure of tensors) at each element of
    `indices` (a dataset of index vectors), as the run trains on them: a
    parallel gather, in order, handed to Keras as tfmemsafe hands every
    pipeline (`_pipelines.for_keras`: prefetched, tf.data's rewrites off).
    `then`, if given, is applied to each gathered batch in the same
    parallel map (before the prefetch, whose buffers then hold its result).

    The tensors enter as a dataset's elements, not as a `map` function's
    captures: a captured tensor is copied when an iterator is made (96 MiB
    for 8192 32x32 images, under a cap where that copy ran out and the
    process ended).
    """
    data = tf.data.Dataset.from_tensors(parts).repeat()

    def gather(index, parts):
        batch = keras.tree.map_structure(lambda t: tf.gather(t, index), parts)
        return batch if then is None else then(batch)

    dataset = tf.data.Dataset.zip((indices, data)).map(
        tf.autograph.experimental.do_not_convert(gather),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return _pipelines.for_keras(dataset, one_worker=one_worker)


def check_cardinality(argument: str, parts: dict) -> None:
    """Refuses arrays of different lengths, as `model.fit` does."""
    sizes = {
        name: sorted({num_rows(leaf) for leaf in keras.tree.flatten(part)})
        for name, part in parts.items()
        if part is not None
    }
    if len({size for found in sizes.values() for size in found}) > 1:
        received = ", ".join(
            f"{name} sizes: {', '.join(map(str, found))}"
            for name, found in sizes.items()
        )
        raise ValueError(
            "Data cardinality is ambiguous: the arrays of "
            f"`{argument}` must all hold the same number of samples. "
            f"Received: {received}"
        )


def is_dense(leaf) -> bool:
    """Whether `Arrays.tensors` converts `leaf` (else Keras slices it)."""
    if isinstance(leaf, np.ndarray):
        return leaf.dtype != object or all(isinstance(e, str) for e in leaf)
    return isinstance(leaf, tf.Tensor)  # Not sparse, not ragged.


def host_tensor(leaf):
    """`leaf` as a tensor, floats cast to `floatx` as Keras casts them."""
    tensor = tf.convert_to_tensor(leaf)
    if tensor.dtype.is_floating and tensor.dtype.name != keras.config.floatx():
        tensor = tf.cast(tensor, keras.config.floatx())
    return tensor


def tensor_bytes(leaf) -> int:
    """The bytes of `leaf` as `host_tensor` (or Keras) converts it."""
    nbytes = int(getattr(leaf, "nbytes", 0))
    if hasattr(leaf, "dtypes") and hasattr(leaf, "size"):  # pandas
        return int(leaf.size) * tf.as_dtype(keras.config.floatx()).size
    if hasattr(leaf, "nnz"):  # SciPy's sparse: values and indices.
        return int(leaf.nnz) * (leaf.dtype.itemsize + 8 * len(leaf.shape))
    if isinstance(leaf, tf.SparseTensor):
        return tensor_bytes(leaf.values) + tensor_bytes(leaf.indices)
    if isinstance(leaf, tf.RaggedTensor):
        return sum(tensor_bytes(t) for t in leaf.nested_row_splits) + (
            tensor_bytes(leaf.flat_values)
        )
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    if dtype is None or shape is None or None in tuple(shape):
        return nbytes
    try:
        dtype = tf.as_dtype(dtype)
    except TypeError:  # NumPy's object arrays.
        return nbytes
    if not dtype.size:  # Strings: their bytes are not the shape's.
        return nbytes
    if dtype.is_floating:
        dtype = tf.as_dtype(keras.config.floatx())
    return int(np.prod(tuple(shape), dtype=np.int64)) * dtype.size
