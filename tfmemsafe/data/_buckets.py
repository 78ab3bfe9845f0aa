"""Batches of variable-length examples, sized by predicted memory.

`memory_buckets` reads every example's length once, groups the lengths
into buckets (each bucket's examples padded to its longest), estimates
the training step's peak memory in the batch size and the length
(`tfmemsafe.estimate_memory` with `lengths`) and gives each bucket the
largest batch predicted to leave the headroom free. `MemoryBuckets.apply`
then batches with TensorFlow's own `bucket_by_sequence_length` at those
sizes: what tfmemsafe adds is only the sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._messages import mib
from tfmemsafe._sources import source_for

# Each default bucket's length is at least this times the one before, so
# padding adds at most a third to a bucket's examples (a sixth on
# average), and 8 to 1,024 takes twelve buckets: twelve traced steps.
_BUCKET_RATIO = 1.5
# Default bucket lengths are multiples of this (a GPU's tensor cores').
_LENGTH_MULTIPLE = 8
_DEFAULT_MAX_BATCH_SIZE = 4096
# Every bucket's batch is predicted near the limit, where the allocator's
# fragmentation adds most: a transformer's buckets under a 160 MB cap
# peaked up to 18% above their predictions (docs/variable-length.md).
HEADROOM = 0.2
# The share of the free memory the probes may take (`estimate_source`):
# over twice `estimate_memory`'s, so that the largest probe is about half
# the size a bucket gets.
_PROBE_BUDGET = 0.45
# Lengths are read in batches of this many examples.
_READ_BATCH = 4096


@dataclasses.dataclass(frozen=True)
class MemoryBuckets:
    """Length buckets and the batch size each is predicted to fit.

    `bucket_boundaries` and `bucket_batch_sizes` are the arguments of
    `tf.data.Dataset.bucket_by_sequence_length` (with
    `pad_to_bucket_boundary=True`), which `apply` calls: bucket `i` holds
    the examples of length in `[bucket_boundaries[i - 1],
    bucket_boundaries[i])`, padded to `lengths[i]`, one less than its
    boundary.

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
            come from, with a second dimension (the length).
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
        each bucket's last batch is smaller (or dropped)."""
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

        Args:
            dataset: An unbatched `tf.data.Dataset` of examples like the
                ones the buckets were made from.
            padding_values: As in `tf.data.Dataset.padded_batch`.
                Defaults to `None`: zeros (and empty strings).
            drop_remainder: bool. Whether to drop each bucket's last,
                smaller batch. Defaults to `False`.

        Returns:
            A `tf.data.Dataset` of padded batches, each of at most its
            bucket's batch size.
        """
        return self._batched(dataset, padding_values, drop_remainder)

    def _batched(self, dataset, padding_values, drop_remainder, batches=None):
        _check_unbatched(dataset)
        drop_remainder = _checks.boolean("drop_remainder", drop_remainder)
        batched = _examples(dataset).bucket_by_sequence_length(
            self.length_fn,
            list(self.bucket_boundaries),
            list(self.bucket_batch_sizes),
            padding_values=padding_values,
            pad_to_bucket_boundary=True,
            drop_remainder=drop_remainder,
        )
        if batches is not None:
            batched = batched.apply(
                tf.data.experimental.assert_cardinality(batches)
            )
        # A padded batch that cannot be allocated must raise, not end the
        # process in a prefetch after it (`_pipelines.for_keras`).
        return _pipelines.passed_through(batched)

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


def memory_buckets(
    dataset: tf.data.Dataset,
    model: keras.Model,
    *,
    length_fn: Callable | None = None,
    bucket_boundaries=None,
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
    multiple: int | None = None,
    headroom: float = HEADROOM,
    estimate: estimate_lib.MemoryEstimate | None = None,
) -> MemoryBuckets:
    """Length buckets for `dataset`, each with the largest batch that fits.

    Reads the length of every example of `dataset` once (one pass over the
    data), groups them into buckets, and gives each bucket the largest
    batch that the memory model predicts to leave `headroom` of the
    device's limit free at the bucket's padded length, beside what is in
    use now. Without `estimate`, it estimates the training step's memory
    (`tfmemsafe.estimate_memory`) on the data's own examples, resized to
    the length of the bucket holding the median example, and probed also
    at the shortest and the longest bucket's length.

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
        multiple: int or `None`. Batch sizes are multiples of this.
            Defaults to `None`: the model's replicas in sync.
        headroom: float. The fraction of the memory limit to leave free
            at each bucket's predicted peak, in [0, 1). Defaults to 0.2,
            twice `fit`'s: plain `model.fit` has no recovery, and every
            bucket's batch is a prediction near the limit (see
            docs/variable-length.md).
        estimate: `tfmemsafe.MemoryEstimate` or `None`. A memory model of
            this model's training step made with `lengths`, to use instead
            of making one. Defaults to `None`.

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

    Example:
    >>> buckets = tfmemsafe.data.memory_buckets(train, model)
    >>> print(buckets)
    >>> model.fit(buckets.apply(train), epochs=3)
    """
    _checks.compiled_model(model, "memory_buckets")
    if distribute.is_multi_worker(model.distribute_strategy):
        # Probes and sizes are each worker's own: workers whose buckets
        # differed would end an epoch after different numbers of steps,
        # and wait for each other in a collective for ever.
        raise ValueError(
            "`memory_buckets` does not plan for a multi-worker job yet: "
            "each worker would measure its own memory and could choose "
            "other batch sizes than the rest. Batch each worker's data "
            "with the same `tf.data.Dataset.bucket_by_sequence_length` "
            "sizes instead. Received a model under a "
            "MultiWorkerMirroredStrategy of more than one worker."
        )
    _check_unbatched(dataset)
    max_batch_size = _checks.integer("max_batch_size", max_batch_size, 1)
    replicas = model.distribute_strategy.num_replicas_in_sync
    multiple = replicas if multiple is None else multiple
    multiple = _checks.integer("multiple", multiple, 1)
    if max_batch_size < multiple:
        raise ValueError(
            f"`max_batch_size` must be at least `multiple`, {multiple}. "
            f"Received: max_batch_size={max_batch_size}"
        )
    headroom = _checks.fraction("headroom", headroom)
    dataset = _examples(dataset)
    length_fn = _length_fn(dataset, length_fn)
    lengths = _read_lengths(dataset, length_fn)
    if bucket_boundaries is None:
        boundaries = _default_boundaries(lengths)
    else:
        boundaries = _checked_boundaries(bucket_boundaries, lengths)
    padded = [boundary - 1 for boundary in boundaries]
    counts = np.bincount(
        np.searchsorted(boundaries, lengths, side="right"),
        minlength=len(boundaries),
    )[: len(boundaries)]
    if estimate is None:
        estimate = _estimate(model, dataset, length_fn, lengths, padded)
    elif not isinstance(estimate, estimate_lib.MemoryEstimate):
        raise TypeError(
            "`estimate` must be a tfmemsafe.MemoryEstimate or None. "
            f"Received: estimate={estimate!r:.80}"
        )
    elif not estimate.length_coefficients:
        raise ValueError(
            "`estimate` must be made with `lengths` (a second dimension): "
            "tfmemsafe.estimate_memory(model, data, lengths=[...]). "
            "Received an estimate without one."
        )
    held = estimate_lib.held_bytes(estimate.device, estimate.state_bytes)
    limit = _usable_limit(estimate, held)

    def size_at(length: int) -> int:
        size = estimate.max_batch_size(
            limit, headroom=headroom, multiple=multiple, length=length
        )
        return min(size, max_batch_size - max_batch_size % multiple)

    sizes = [size_at(length) for length in padded]
    fitting = zip(counts, sizes, strict=True)
    if any(count and not size for count, size in fitting):
        _raise_too_long(lengths, estimate, size_at, multiple, headroom)
    peaks = [
        estimate.peak_bytes(max(size, 1), length=length) + held
        for length, size in zip(padded, sizes, strict=True)
    ]
    return MemoryBuckets(
        bucket_boundaries=tuple(boundaries),
        # The bucket past the last boundary holds nothing; it needs a size.
        bucket_batch_sizes=tuple(sizes) + (max(sizes[-1], 1),),
        lengths=tuple(padded),
        counts=tuple(int(c) for c in counts),
        predicted_peak_bytes=tuple(int(p) for p in peaks),
        estimate=estimate,
        length_fn=length_fn,
        multiple=multiple,
    )


def bucket_by_memory(
    dataset: tf.data.Dataset,
    model: keras.Model,
    *,
    padding_values=None,
    drop_remainder: bool = False,
    **kwargs,
) -> tf.data.Dataset:
    """`dataset` batched by length, each batch as large as memory allows.

    `memory_buckets(dataset, model, **kwargs).apply(dataset, ...)`: see
    `memory_buckets` for the arguments and the errors.

    Example:
    >>> train = tfmemsafe.data.bucket_by_memory(examples, model)
    >>> model.fit(train, epochs=3)
    """
    buckets = memory_buckets(dataset, model, **kwargs)
    # Keras then knows the epoch's length (its progress bar, and no "ran
    # out of data" warning). Only for the examples the buckets counted.
    return buckets._batched(
        dataset,
        padding_values,
        drop_remainder,
        buckets.num_batches(drop_remainder),
    )


def _check_unbatched(dataset) -> None:
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


def _examples(dataset):
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


def _length_fn(dataset, length_fn) -> Callable:
    """`length_fn` (or the default), returning a scalar `int32`."""
    if length_fn is None:
        length_fn = _default_length_fn(dataset.element_spec)
    elif not callable(length_fn):
        raise TypeError(
            "`length_fn` must be a callable returning an example's length, "
            f"or None. Received: length_fn={length_fn!r:.80}"
        )
    spec = dataset.map(length_fn).element_spec
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


def _read_lengths(dataset, length_fn) -> np.ndarray:
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
    return lengths.astype(np.int64)


def _round_up(length: int) -> int:
    return -(-length // _LENGTH_MULTIPLE) * _LENGTH_MULTIPLE


def _default_boundaries(lengths) -> list[int]:
    """Padded lengths of 8k, each at least 1.5 times the last, plus one."""
    longest = _round_up(max(int(lengths.max()), 1))
    padded = [min(_round_up(max(int(lengths.min()), 1)), longest)]
    while padded[-1] < longest:
        grown = _round_up(math.ceil(padded[-1] * _BUCKET_RATIO))
        padded.append(min(grown, longest))
    boundaries = np.asarray(padded) + 1
    counts = np.bincount(
        np.searchsorted(boundaries, lengths, side="right"),
        minlength=len(boundaries),
    )
    return [int(b) for b, c in zip(boundaries, counts, strict=False) if c]


def _checked_boundaries(bucket_boundaries, lengths) -> list[int]:
    if isinstance(bucket_boundaries, (str, bytes)) or not hasattr(
        bucket_boundaries, "__iter__"
    ):
        raise TypeError(
            "`bucket_boundaries` must be a list of integers or None. "
            f"Received: bucket_boundaries={bucket_boundaries!r}"
        )
    boundaries = [
        _checks.integer("bucket_boundaries", b, 1) for b in bucket_boundaries
    ]
    if not boundaries or sorted(set(boundaries)) != boundaries:
        raise ValueError(
            "`bucket_boundaries` must be a non-empty list of increasing "
            f"lengths. Received: bucket_boundaries={list(bucket_boundaries)!r}"
        )
    longest = int(lengths.max())
    if longest >= boundaries[-1]:
        boundaries.append(longest + 1)
    return boundaries


def _resized(dataset, length_fn, length: int):
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

    nonempty = dataset.filter(lambda *parts: length_fn(*parts) > 0)
    if isinstance(dataset.element_spec, tuple):
        return nonempty.map(lambda *parts: tf.nest.map_structure(resize, parts))
    return nonempty.map(lambda part: tf.nest.map_structure(resize, part))


def _estimate(model, dataset, length_fn, lengths, padded):
    """The training step's estimate at the median example's bucket length,
    probed also at the shortest and longest buckets' lengths and midway
    (geometrically) between them and it: five lengths for at most three
    terms, so that no one length's reading sets the polynomial."""
    median = float(np.median(lengths))
    base = next(length for length in padded if length >= median)
    others = {padded[0], padded[-1]}
    for end in (padded[0], padded[-1]):
        middle = _round_up(int(round(math.sqrt(end * base))))
        others.add(min(max(middle, padded[0]), padded[-1]))
    others = sorted(others - {base})
    if not others:  # One bucket: any other length gives the slope in it.
        others = [max(base // 2, 1)]
    # Checked as `estimate_memory` checks them, then probed nearer the
    # limit than its default: every bucket's size is a prediction at the
    # limit, and the nearer the probes, the less the line is extrapolated.
    data = _resized(dataset, length_fn, base)
    source = source_for(
        data, "dataset", labelled=True, strategy=model.distribute_strategy
    )
    return estimate_lib.estimate_source(
        model, source, lengths=others, probe_budget=_PROBE_BUDGET
    )


def _usable_limit(estimate, held: int) -> int:
    if estimate.limit_bytes is None:
        raise ValueError(
            f"The memory limit of {estimate.device} is unknown, so no batch "
            "size can be chosen by memory. Pass a `tfmemsafe."
            "MemoryEstimate` whose device has a known limit."
        )
    return max(estimate.limit_bytes - held, 1)


def _raise_too_long(lengths, estimate, size_at, multiple, headroom):
    longest = int(lengths.max())
    fits = 0
    if size_at(1) >= multiple:
        fits = estimate_lib.largest_fitting(lambda n: size_at(n) >= multiple, 1)
    raise ValueError(
        f"`dataset` holds an example of length {longest}, longer than any "
        f"predicted to fit in a batch of {multiple} with "
        f"{100 * headroom:.0f}% of the {mib(estimate.limit_bytes)} of "
        f"{estimate.device} free: the longest that fits is {fits}. Cut or "
        "leave out the longest examples (`dataset.filter`)."
    )
