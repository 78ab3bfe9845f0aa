"""What a `tf.data` pipeline's own graph says about it.

tf.data has no public walk of a pipeline's transformations; these read
it through `_compat`, to tell whether a pipeline batches (and at what
size) and how many samples a batched one holds, and to hand a pipeline
to Keras in a form that raises, rather than ends the process, when
memory runs out.
"""

from __future__ import annotations

import functools
import math

import tensorflow as tf

from tfmemsafe import _compat


@functools.cache
def _transformations() -> dict:
    """The `tf.data.Dataset` method that makes each transformation class
    tfmemsafe reads, from datasets made by those public methods (tf.data
    does not export the classes)."""
    source = tf.data.Dataset.range(2)
    made = {
        "batch": [source.batch(1), source.batch(1, num_parallel_calls=2)],
        "padded_batch": [source.padded_batch(1)],
        "rebatch": [source.batch(2).rebatch(1)],
        "unbatch": [source.batch(1).unbatch()],
        "group_by_window": [
            source.group_by_window(lambda x: x, lambda _, w: w, 1)
        ],
        "prefetch": [source.prefetch(1)],
        "options": [source.with_options(tf.data.Options())],
    }
    return {type(d): name for name, ds in made.items() for d in ds}


def transformation(dataset) -> str | None:
    """The `tf.data.Dataset` method that made `dataset` (`"batch"`,
    `"padded_batch"`, `"rebatch"`, `"unbatch"`, `"group_by_window"`,
    `"prefetch"`, `"options"`), or `None` for any other."""
    return _transformations().get(type(dataset))


def batching_of(dataset) -> tuple[bool, int | None]:
    """Whether a dataset's pipeline batches, and the batch size if known."""
    node = dataset
    while node is not None:
        kind = transformation(node)
        if kind in ("batch", "padded_batch"):
            size = tf.get_static_value(
                _compat.transformation_argument(node, "batch_size")
            )
            return True, None if size is None else int(size)
        if kind == "rebatch":
            return True, None
        if kind == "unbatch":
            return False, None
        if kind == "group_by_window" and _adds_an_axis(node):
            return True, None  # `bucket_by_sequence_length`'s batches.
        inputs = _compat.dataset_inputs(node)
        if len(inputs) > 1:  # zip and similar
            found = [batching_of(d) for d in inputs]
            sizes = {size for _, size in found}
            batched = all(b for b, _ in found)
            return batched, sizes.pop() if batched and len(sizes) == 1 else None
        node = inputs[0] if inputs else None
    return False, None


def _adds_an_axis(node) -> bool:
    """Whether a `group_by_window` batches its windows (its elements have
    an axis more than its input's) rather than only grouping them."""
    out = tf.nest.flatten(node.element_spec)
    inner = _input_of(node)
    if inner is None:
        return False
    into = tf.nest.flatten(inner.element_spec)
    return (
        len(out) == len(into)
        and out[0].shape.rank is not None
        and into[0].shape.rank is not None
        and out[0].shape.rank == into[0].shape.rank + 1
    )


def rows_of_batched(dataset) -> int | None:
    """The samples of a batched dataset, when its pipeline tells them.

    They are the length of what its `batch` batches (less the remainder
    `drop_remainder` drops), if that is known and the batches count
    matches it (no `filter` after the batching, say).
    """
    batches = int(dataset.cardinality())
    for node in _nodes(dataset):
        if transformation(node) != "batch":
            continue
        inner = _input_of(node)
        if inner is None:
            return None
        rows = int(inner.cardinality())
        size = tf.get_static_value(
            _compat.transformation_argument(node, "batch_size")
        )
        drop = tf.get_static_value(
            _compat.transformation_argument(node, "drop_remainder")
        )
        if rows < 0 or size is None or drop is None:
            return None
        size = int(size)
        if bool(drop):
            rows -= rows % size
        return rows if math.ceil(rows / size) == batches else None
    return None


def rebatched(dataset, batch_size: int):
    """`dataset`'s batches as batches of `batch_size`, its length told
    where it is known: `rebatch` hides it, and Keras shows it in the
    progress bar, ends the epoch by it, and warns of data that ran out at
    the end of one of unknown length."""
    rows = rows_of_batched(dataset)
    dataset = dataset.rebatch(batch_size)
    if rows is None:
        return dataset
    return dataset.apply(
        tf.data.experimental.assert_cardinality(math.ceil(rows / batch_size))
    )


def for_keras(dataset, *, one_worker: bool):
    """`dataset` as tfmemsafe hands it to Keras: it raises when memory
    runs out, where TensorFlow (2.21 and before) would end the process.

    Two things in tf.data segfault when an allocation fails, in plain
    `model.fit` too; each is measured under a real cap in recovery_test:

    - tf.data's default graph optimizations rewrite a pipeline each time
      an iterator is made (each `fit`, `evaluate` and `predict` call,
      and tfmemsafe's probes and trials make several), and the
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
    while transformation(node) == "options" and _input_of(node) is not None:
        node = _input_of(node)
    inner = _input_of(node)
    buffer_size = None
    if transformation(node) == "prefetch":
        buffer_size = tf.get_static_value(
            _compat.transformation_argument(node, "buffer_size")
        )
    if inner is not None and buffer_size is not None:
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


def _input_of(node):
    """The one dataset a transformation reads, or `None`."""
    inputs = _compat.dataset_inputs(node)
    return inputs[0] if len(inputs) == 1 else None


def _nodes(dataset):
    """The transformations of a pipeline, from the last to the sources."""
    pending = [dataset]
    while pending:
        node = pending.pop()
        yield node
        pending.extend(_compat.dataset_inputs(node))


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
