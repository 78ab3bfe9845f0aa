"""What a `tf.data` pipeline's own graph says about it.

tf.data has no public walk of a pipeline's transformations; these read
the `_input_dataset` and `_datasets` attributes every transformation
keeps, to tell whether a pipeline batches (and at what size), how many
samples a batched one holds, and whether its order is the same at each
iteration (a shuffle that reshuffles is not; nor a pipeline that lets
tf.data trade order for speed).
"""

from __future__ import annotations

import math

import tensorflow as tf

# `tf.data` transformations that batch or unbatch their input, by class.
_BATCHING = (
    "_BatchDataset",
    "_PaddedBatchDataset",
    "_ParallelBatchDataset",
    "_RebatchDataset",
)
_UNBATCHING = ("_UnbatchDataset",)


def batching_of(dataset) -> tuple[bool, int | None]:
    """Whether a dataset's pipeline batches, and the batch size if known."""
    node = dataset
    while node is not None:
        name = type(node).__name__
        if name in _BATCHING:
            size = getattr(node, "_batch_size", None)
            try:
                return True, int(size) if size is not None else None
            except TypeError:
                return True, None
        if name in _UNBATCHING:
            return False, None
        if name == "_GroupByWindowDataset" and _adds_an_axis(node):
            return True, None  # `bucket_by_sequence_length`'s batches.
        inputs = getattr(node, "_datasets", None)  # zip and similar
        if inputs:
            found = [batching_of(d) for d in tf.nest.flatten(inputs)]
            sizes = {size for _, size in found}
            batched = all(b for b, _ in found)
            return batched, sizes.pop() if batched and len(sizes) == 1 else None
        node = getattr(node, "_input_dataset", None)
    return False, None


def _adds_an_axis(node) -> bool:
    """Whether a `group_by_window` batches its windows (its elements have
    an axis more than its input's) rather than only grouping them."""
    out = tf.nest.flatten(node.element_spec)
    into = tf.nest.flatten(node._input_dataset.element_spec)  # noqa: SLF001
    return (
        len(out) == len(into)
        and out[0].shape.rank is not None
        and into[0].shape.rank is not None
        and out[0].shape.rank == into[0].shape.rank + 1
    )


def rows_of_batched(dataset) -> int | None:
    """The samples of a batched dataset, when its pipeline tells them.

    They are the length of what its `batch` batches, if that is known and
    the batches count matches it (no `filter` after the batching, say).
    """
    batches = int(dataset.cardinality())
    for node in dataset_nodes(dataset):
        if type(node).__name__ != "_BatchDataset":
            continue
        rows = int(node._input_dataset.cardinality())  # noqa: SLF001
        size = int(node._batch_size)  # noqa: SLF001
        drop = bool(node._drop_remainder)  # noqa: SLF001
        if rows < 0 or drop:
            return None
        return rows if math.ceil(rows / size) == batches else None
    return None


def is_deterministic(dataset) -> bool:
    """Whether a dataset's order is the same at each new iteration."""
    if dataset.options().deterministic is False:
        return False
    # A shuffle that reshuffles gives a new order at each iteration.
    return not any(
        getattr(node, "_reshuffle_each_iteration", True)
        for node in dataset_nodes(dataset)
        if type(node).__name__ == "_ShuffleDataset"
    )


def shuffle_seeds(dataset) -> list:
    return [
        (int(node._seed), int(node._seed2))  # noqa: SLF001
        for node in dataset_nodes(dataset)
        if type(node).__name__ == "_ShuffleDataset"
    ]


def for_keras(dataset, *, one_worker: bool):
    """`dataset` as tfmemsafe hands it to Keras: it raises when memory
    runs out, where TensorFlow (2.21 and before) would end the process.

    Two things in tf.data segfault when an allocation fails, in plain
    `model.fit` too; each is measured under a real cap in recovery_test:

    - tf.data's default graph optimizations rewrite a pipeline each time
      an iterator is made (each `fit`, `evaluate` and `predict` call,
      which tfmemsafe makes once per epoch and once per retry), and the
      rewrite allocates a copy of every array the pipeline holds (32 MiB
      for 24 MiB of `from_tensor_slices` images): when that allocation
      fails, the process ends. They are turned off
      (`apply_default_optimizations=False`) unless the pipeline sets
      them itself; their `inject_prefetch` is replaced by a final
      `prefetch(tf.data.AUTOTUNE)`. Under a `tf.distribute` strategy,
      sharding the pipeline between workers (`auto_shard_policy`)
      rewrites it again, with the same copy: with `one_worker`, where
      there is nothing to shard, sharding is turned off.
    - When a batching transformation (`batch`, `padded_batch`,
      `rebatch`) cannot allocate its batch, it returns the error with the
      unallocated tensor still in its output, and a `prefetch` that reads
      that output (straight after it, or through `take`, `skip`, `repeat`
      or an assertion, which hand the output on) asks the allocator for
      the size of a null buffer. A pass-through `map` hands on the error
      alone: one ends the pipeline, before its final prefetch, which is
      kept at its buffer size.

    A batching followed by a prefetch earlier in the user's pipeline is
    left as it is.

    Args:
        dataset: The `tf.data.Dataset` of batches to give Keras.
        one_worker: bool. Whether the job is known to run on one worker.
    """
    optimization = dataset.options().experimental_optimization
    node = dataset
    while type(node).__name__ == "_OptionsDataset":
        node = getattr(node, "_input_dataset", None)
    inner = getattr(node, "_input_dataset", None)
    buffer_size = tf.get_static_value(getattr(node, "_buffer_size", None))
    if (
        type(node).__name__ == "_PrefetchDataset"
        and inner is not None
        and buffer_size is not None
    ):
        options = dataset.options()
        dataset = passed_through(inner).prefetch(int(buffer_size))
        dataset = dataset.with_options(options)
    else:
        dataset = passed_through(dataset).prefetch(tf.data.AUTOTUNE)
    return without_rewrites(dataset, one_worker=one_worker, set_by=optimization)


def without_rewrites(dataset, *, one_worker: bool, set_by=None):
    """`dataset` with tf.data's default optimizations off (unless
    `set_by`, the pipeline's own optimization options, sets them) and,
    with `one_worker`, no sharding: each rewrite copies every array the
    pipeline holds when an iterator is made (see `for_keras`)."""
    if set_by is None:
        set_by = dataset.options().experimental_optimization
    options = tf.data.Options()
    if set_by.apply_default_optimizations is None:
        options.experimental_optimization.apply_default_optimizations = False
    if one_worker:
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
    return dataset.with_options(options)


def passed_through(dataset):
    """`dataset` through a `map` that changes nothing: after a batching
    transformation, it hands on an error alone (see `for_keras`)."""
    # `map` calls its function with a tuple's parts (exactly a tuple, not
    # a namedtuple) and with anything else as one argument.
    # Nothing for autograph to convert: it would only slow the tracing.
    if type(dataset.element_spec) is tuple:
        return dataset.map(
            tf.autograph.experimental.do_not_convert(lambda *parts: parts)
        )
    return dataset.map(tf.autograph.experimental.do_not_convert(lambda p: p))


def dataset_nodes(dataset):
    """The transformations of a pipeline, from the last to the sources."""
    # tf.data has no public graph walk: `_input_dataset` and `_datasets`
    # are the attributes `_batching_of` reads too.
    pending = [dataset]
    while pending:
        node = pending.pop()
        yield node
        inputs = getattr(node, "_datasets", None)
        if inputs:
            pending.extend(tf.nest.flatten(inputs))
        parent = getattr(node, "_input_dataset", None)
        if parent is not None:
            pending.append(parent)


def padded_to_each_batch(spec) -> bool:
    """Whether batches of `spec` have an axis after the batch's of unknown
    length: their examples were padded to each batch's longest, and
    cannot be batched again."""
    return any(
        isinstance(leaf, tf.TensorSpec)
        and leaf.shape.rank is not None
        and None in leaf.shape.as_list()[1:]
        for leaf in tf.nest.flatten(spec)
    )
