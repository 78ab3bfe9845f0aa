"""The result of `memory_buckets`: `MemoryBuckets`, length buckets and
the batch size each is predicted to fit, and the batching they make."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._messages import mib
from tfmemsafe.data import _lengths


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
