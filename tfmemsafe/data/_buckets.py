"""Batches of variable-length examples, sized by predicted memory.

`memory_buckets` reads every example's length once, groups the lengths
into buckets (each bucket's examples padded to its longest), estimates
the training step's peak memory in the batch size and the length
(`tfmemsafe.estimate_memory` with `lengths`) and gives each bucket the
largest batch predicted to leave the headroom free. `MemoryBuckets.apply`
then batches as TensorFlow's `bucket_by_sequence_length` would at those
sizes (with `group_by_window`, padding each example before a `batch`):
what tfmemsafe adds is the sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._messages import mib
from tfmemsafe.data import _lengths
from tfmemsafe.data import _plan
from tfmemsafe.data import _workers

_DEFAULT_MAX_BATCH_SIZE = 4096
# Every bucket's batch is predicted near the limit, where the allocator's
# fragmentation adds most: a transformer's buckets under a 160 MB cap
# peaked up to 18% above their predictions (docs/variable-length.md).
HEADROOM = 0.2


@dataclasses.dataclass(frozen=True)
class MemoryBuckets:
    """Length buckets and the batch size each is predicted to fit.

    `bucket_boundaries` and `bucket_batch_sizes` are the arguments of
    `tf.data.Dataset.bucket_by_sequence_length` (with
    `pad_to_bucket_boundary=True`), which `apply` batches as that call
    would: bucket `i` holds the examples of length in
    `[bucket_boundaries[i - 1], bucket_boundaries[i])`, padded to
    `lengths[i]`, one less than its boundary.

    Attributes:
        bucket_boundaries: tuple of int. Increasing; no example is as long
            as the last.
        bucket_batch_sizes: tuple of int. One per bucket, and one more for
            the lengths past the last boundary, which hold no example
            (`bucket_by_sequence_length` wants it).
        lengths: tuple of int. Each bucket's padded length.
        counts: tuple of int. The examples of each bucket, as read.
        predicted_peak_bytes: tuple of int. Each bucket's predicted peak
            at its batch size, with what else was in use then.
        estimate: `tfmemsafe.MemoryEstimate`. The memory model the sizes
            come from, with a second dimension (the length); under a
            multi-worker strategy, one device's scaled to the job's global
            batch.
        length_fn: callable. An example's parts to its length, as a
            scalar `int32` tensor.
        multiple: int. Every batch size is a multiple of it.
    """

    bucket_boundaries: tuple[int, ...]
    bucket_batch_sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    predicted_peak_bytes: tuple[int, ...]
    estimate: estimate_lib.MemoryEstimate
    length_fn: Callable = dataclasses.field(repr=False)
    multiple: int = 1

    def num_batches(self, drop_remainder: bool = False) -> int:
        """The batches of one pass over the examples the buckets counted:
        each bucket's last batch is smaller (or dropped).

        `apply` does not assert it, as the lengths may change from one
        pass to the next (a random crop); where they do not,
        `batched.apply(tf.data.experimental.assert_cardinality(n))`
        gives Keras the epoch's length (a progress bar, and no "ran out
        of data" warning after the first epoch).
        """
        rounded = math.floor if drop_remainder else math.ceil
        return sum(
            rounded(count / size)
            for count, size in zip(
                self.counts, self.bucket_batch_sizes, strict=False
            )
            if count
        )

    def scaled(self, batch_size: int) -> MemoryBuckets:
        """These buckets with the first's batch size `batch_size`, and
        every other bucket's scaled with it (down to `multiple`).

        What `tfmemsafe.fit` trains on after an out-of-memory error: its
        batch size is the first bucket's.
        """
        batch_size = _checks.integer("batch_size", batch_size, 1)
        factor = batch_size / self.bucket_batch_sizes[0]
        sizes = []
        for size in self.bucket_batch_sizes:
            size = int(size * factor)
            sizes.append(max(size - size % self.multiple, self.multiple))
        # What else was in use when they were planned, as in theirs.
        held = self.predicted_peak_bytes[0] - self.estimate.peak_bytes(
            self.bucket_batch_sizes[0], length=self.lengths[0]
        )
        return dataclasses.replace(
            self,
            bucket_batch_sizes=tuple(sizes),
            predicted_peak_bytes=tuple(
                self.estimate.peak_bytes(size, length=length) + held
                for size, length in zip(sizes, self.lengths, strict=False)
            ),
        )

    def apply(
        self,
        dataset: tf.data.Dataset,
        *,
        padding_values=None,
        drop_remainder: bool = False,
    ) -> tf.data.Dataset:
        """Batches unbatched `dataset` by these buckets.

        As `tf.data.Dataset.bucket_by_sequence_length` with
        `pad_to_bucket_boundary=True` would, with `group_by_window`, but
        each example is padded (`tf.pad`) before a plain `batch`:
        `padded_batch` ends the process when its batch cannot be
        allocated (TensorFlow 2.21 writes the padding into the buffer it
        did not get), where `batch` raises.

        Args:
            dataset: An unbatched `tf.data.Dataset` of examples like the
                ones the buckets were made from.
            padding_values: A scalar, or one per part of an example, to
                pad with. Defaults to `None`: zeros (and empty strings).
            drop_remainder: bool. Whether to drop each bucket's last,
                smaller batch. Defaults to `False`.

        Returns:
            A `tf.data.Dataset` of padded batches, each of at most its
            bucket's batch size.

        Raises:
            InvalidArgumentError: When iterated, for an example as long as
                the last boundary or longer.
        """
        _lengths.check_unbatched(dataset)
        drop_remainder = _checks.boolean("drop_remainder", drop_remainder)
        examples = _lengths.examples(dataset)
        boundaries = tf.constant(self.bucket_boundaries, tf.int64)
        sizes = tf.constant(self.bucket_batch_sizes[:-1], tf.int64)
        length_fn = self.length_fn
        last = self.bucket_boundaries[-1]

        def bucket(*parts):
            length = tf.cast(length_fn(*parts), tf.int64)
            index = tf.reduce_sum(tf.cast(boundaries <= length, tf.int64))
            check = tf.debugging.assert_less(
                length,
                tf.constant(last, tf.int64),
                message=f"an example is longer than the buckets (up to "
                f"{last - 1}) that `memory_buckets` planned: plan them on "
                "data that holds it",
            )
            with tf.control_dependencies([check]):
                return tf.identity(index)

        def batched(index, window):
            length = tf.cast(boundaries[index] - 1, tf.int32)
            padded = window.map(_padding(window, length, padding_values))
            return padded.batch(sizes[index], drop_remainder=drop_remainder)

        grouped = examples.group_by_window(
            bucket, batched, window_size_func=lambda index: sizes[index]
        )
        # A batch that cannot be allocated must raise, not end the
        # process in a prefetch after it (`_pipelines.for_keras`).
        return _pipelines.passed_through(grouped)

    def __str__(self) -> str:
        estimate = self.estimate
        lines = [
            f"MemoryBuckets on {estimate.device} "
            f"(limit {mib(estimate.limit_bytes)})",
            f"  {'length':>8}  {'examples':>9}  {'batch':>6}  "
            f"{'predicted peak':>15}",
        ]
        for row in zip(
            self.lengths,
            self.counts,
            self.bucket_batch_sizes,
            self.predicted_peak_bytes,
            strict=False,
        ):
            length, count, size, peak = row
            lines.append(
                f"  {length:>8}  {count:>9}  {size:>6}  {mib(peak):>15}"
            )
        return "\n".join(lines)


def _padding(window, length, padding_values):
    """A `map` function padding every axis of unknown size to `length`."""
    spec = window.element_spec
    values = padding_values
    if values is None or not tf.nest.is_nested(values):
        values = tf.nest.map_structure(lambda _: padding_values, spec)

    def pad(tensor, value):
        unknown = [d is None for d in tensor.shape.as_list()]
        if not any(unknown):
            return tensor
        if value is None:
            value = "" if tensor.dtype == tf.string else 0
        shape = tf.shape(tensor)
        paddings = [
            [0, length - shape[axis] if varies else 0]
            for axis, varies in enumerate(unknown)
        ]
        return tf.pad(
            tensor, paddings, constant_values=tf.cast(value, tensor.dtype)
        )

    def padded(*parts):
        parts = parts if isinstance(spec, tuple) else parts[0]
        return tf.nest.map_structure(pad, parts, values)

    return padded


def memory_buckets(
    dataset: tf.data.Dataset,
    model: keras.Model,
    *,
    length_fn: Callable | None = None,
    bucket_boundaries=None,
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
    max_tokens: int | None = None,
    multiple: int | None = None,
    headroom: float = HEADROOM,
    estimate: estimate_lib.MemoryEstimate | None = None,
    verbose="auto",
) -> MemoryBuckets:
    """Length buckets for `dataset`, each with the largest batch that fits.

    Reads the length of every example of `dataset` once (one pass over the
    data), groups them into buckets, and gives each bucket the largest
    batch that the memory model predicts to leave `headroom` of the
    device's limit free at the bucket's padded length, beside what is in
    use now. Without `estimate`, it estimates the training step's memory
    (`tfmemsafe.estimate_memory`) on the data's own examples, resized to
    the length of the bucket holding the median example, and probed also
    at the shortest and the longest bucket's length; then it trains each
    bucket's batch for a few steps and sizes the buckets again from the
    estimate raised where a step held more than predicted.

    Under a `MultiWorkerMirroredStrategy` of several workers, call it on
    every worker (outside `strategy.scope()`): the workers share their
    lengths and each bucket takes the smallest batch any worker predicts
    to fit, each measuring its own device on a copy of the model outside
    the strategy, so that every worker batches the same (see
    docs/variable-length.md).

    Args:
        dataset: A finite, unbatched `tf.data.Dataset` of `(inputs,
            targets)` or `(inputs, targets, sample_weights)` examples
            whose inputs vary in length along their first axis.
        model: The compiled `keras.Model` to train on it; it is left as
            it was found.
        length_fn: callable or `None`. Called with an example's parts, as
            `Dataset.map` calls its function; returns its length, a
            scalar integer. Defaults to `None`: the first axis of the
            first input whose first axis varies.
        bucket_boundaries: list of int or `None`. Lengths where a bucket
            ends, as in `tf.data.Dataset.bucket_by_sequence_length`; one
            past the longest example is added if no boundary is past it.
            Defaults to `None`: each bucket's padded length a multiple of
            8, at least 1.5 times the last one's, up to the longest
            example (empty buckets left out).
        max_batch_size: int. No bucket's batch is larger. Defaults to
            4096.
        max_tokens: int or `None`. No bucket's batch holds more padded
            tokens (its batch size times its padded length) than this, as
            fairseq's `--max-tokens`; an `AccumulatingModel` with
            `tokens_per_update` gets it from `tfmemsafe.fit`. Defaults to
            `None`: memory alone sets the sizes.
        multiple: int or `None`. Batch sizes are multiples of this.
            Defaults to `None`: the model's replicas in sync.
        headroom: float. The fraction of the memory limit to leave free
            at each bucket's predicted peak, in [0, 1). Defaults to 0.2,
            twice `fit`'s: plain `model.fit` has no recovery, and every
            bucket's batch is a prediction near the limit (see
            docs/variable-length.md).
        estimate: `tfmemsafe.MemoryEstimate` or `None`. A memory model of
            this model's training step made with `lengths` (or a plan's
            `estimate`, with its buckets' measurements), to use instead of
            making one and measuring. Under a multi-worker strategy, one
            device's, made outside the strategy (as the plan makes its
            own): it is scaled to the job's global batch. Arrays it was
            made on are left out of its line (`data_bytes`): the buckets'
            pipeline does not hold them. Defaults to `None`.
        verbose: `"auto"`, 0 or 1, as `model.fit` takes it: 1 (and
            `"auto"`) shows a progress bar of the memory model's probes;
            0 nothing. Defaults to `"auto"`.

    Returns:
        A `MemoryBuckets`; its `apply(dataset)` batches the data.

    Raises:
        TypeError: If `dataset`, `model` or `length_fn`'s result is of the
            wrong kind.
        ValueError: If `dataset` is batched, infinite or empty, a length
            is negative, an argument is out of range, or an example is
            longer than any predicted to fit even alone (the message says
            the longest that is).
        MemoryEstimateError: If no estimate can be made (a device without
            memory statistics, a model that cannot take other lengths).
        RuntimeError: Under a multi-worker strategy, if another worker
            could not plan (its own error is in its log). A call inside
            the strategy's scope, or a model that cannot be copied from
            its config, raises a `ValueError` on that worker.

    Example:
    >>> buckets = tfmemsafe.data.memory_buckets(train, model)
    >>> print(buckets)
    >>> model.fit(buckets.apply(train), epochs=3)
    """
    _checks.compiled_model(model, "memory_buckets")
    strategy = model.distribute_strategy
    workers = distribute.is_multi_worker(strategy)
    _lengths.check_unbatched(dataset)
    max_batch_size = _checks.integer("max_batch_size", max_batch_size, 1)
    multiple = strategy.num_replicas_in_sync if multiple is None else multiple
    multiple = _checks.integer("multiple", multiple, 1)
    if max_batch_size < multiple:
        raise ValueError(
            f"`max_batch_size` must be at least `multiple`, {multiple}. "
            f"Received: max_batch_size={max_batch_size}"
        )
    headroom = _checks.fraction("headroom", headroom)
    _checks.verbose(verbose)
    if max_tokens is not None:
        max_tokens = _checks.integer("max_tokens", max_tokens, 1)
    if estimate is not None:
        _plan.check_estimate(estimate)
    read = {}

    def read_lengths():
        read["dataset"] = _lengths.examples(dataset)
        read["length_fn"] = _lengths.length_fn_of(read["dataset"], length_fn)
        return _lengths.read_lengths(read["dataset"], read["length_fn"])

    if workers:
        # Every worker the same buckets, from every worker's lengths (an
        # error reading this worker's makes every worker raise).
        boundaries, counts, lengths, longest = _workers.agreed_buckets(
            strategy, read_lengths, bucket_boundaries
        )
    else:
        lengths = read_lengths()
        longest = int(lengths.max())
        if bucket_boundaries is None:
            boundaries = _lengths.candidate_boundaries(lengths)
        else:
            boundaries = _lengths.checked_boundaries(bucket_boundaries, lengths)
        counts = _lengths.bucket_counts(boundaries, lengths)
        # A bucket with no example needs no size (and its length no probe).
        boundaries = [b for b, c in zip(boundaries, counts, strict=True) if c]
        counts = [int(c) for c in counts if c]
    dataset, length_fn = read["dataset"], read["length_fn"]
    padded = [boundary - 1 for boundary in boundaries]
    if max_tokens is not None and max_tokens < multiple * padded[-1]:
        raise ValueError(
            f"`max_tokens` must hold a batch of {multiple} (`multiple`) of "
            f"the longest bucket's examples, padded to {padded[-1]}: at "
            f"least {multiple * padded[-1]}. Received: "
            f"max_tokens={max_tokens}"
        )
    sizing = _plan.Sizing(
        max_batch_size - max_batch_size % multiple,
        multiple,
        headroom,
        max_tokens,
        verbose,
    )

    arguments = (model, dataset, lengths, padded, counts, estimate, sizing)
    if workers:
        # Every worker the smallest size any predicts for each bucket; a
        # worker whose planning raises makes every worker raise.
        mine = {}

        def sizes_here():
            mine["estimate"], mine["held"], sizes = _plan.planned(*arguments)
            return sizes

        sizes = _workers.agreed_sizes(strategy, sizes_here, len(padded))
        estimate, held = mine["estimate"], mine["held"]
    else:
        estimate, held, sizes = _plan.planned(*arguments)
    if not all(sizes):
        _plan.raise_too_long(longest, estimate, held, sizing)
    peaks = [
        estimate.peak_bytes(size, length=length) + held
        for length, size in zip(padded, sizes, strict=True)
    ]
    return MemoryBuckets(
        bucket_boundaries=tuple(boundaries),
        # The bucket past the last boundary holds nothing; it needs a size.
        bucket_batch_sizes=tuple(sizes) + (max(sizes[-1], 1),),
        lengths=tuple(padded),
        counts=tuple(counts),
        predicted_peak_bytes=tuple(int(p) for p in peaks),
        estimate=estimate,
        length_fn=length_fn,
        multiple=multiple,
    )


def bucket_by_memory(
    dataset: tf.data.Dataset,
    model: keras.Model,
    *,
    length_fn: Callable | None = None,
    bucket_boundaries=None,
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
    max_tokens: int | None = None,
    multiple: int | None = None,
    headroom: float = HEADROOM,
    estimate: estimate_lib.MemoryEstimate | None = None,
    padding_values=None,
    drop_remainder: bool = False,
    verbose="auto",
) -> tf.data.Dataset:
    """`dataset` batched by length, each batch as large as memory allows.

    `memory_buckets(dataset, model, ...).apply(dataset, padding_values=...,
    drop_remainder=...)`: see `memory_buckets` for the arguments and the
    errors, and `MemoryBuckets.apply` for the last two.

    Example:
    >>> train = tfmemsafe.data.bucket_by_memory(examples, model)
    >>> model.fit(train, epochs=3)
    """
    buckets = memory_buckets(
        dataset,
        model,
        length_fn=length_fn,
        bucket_boundaries=bucket_boundaries,
        max_batch_size=max_batch_size,
        max_tokens=max_tokens,
        multiple=multiple,
        headroom=headroom,
        estimate=estimate,
        verbose=verbose,
    )
    return buckets.apply(
        dataset, padding_values=padding_values, drop_remainder=drop_remainder
    )
