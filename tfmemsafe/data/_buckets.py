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

from collections.abc import Callable

import keras
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe.data import _lengths
from tfmemsafe.data import _plan
from tfmemsafe.data import _workers
from tfmemsafe.data._memory_buckets import MemoryBuckets

_DEFAULT_MAX_BATCH_SIZE = 4096
# Every bucket's batch is predicted near the limit, where the allocator's
# fragmentation adds most (docs/variable-length.md, "Why each bucket is
# measured, and 20% headroom").
HEADROOM = 0.2


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
