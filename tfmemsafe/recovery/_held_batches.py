"""Batches as Keras' step functions get them: read, sliced, joined; and
the outputs of a step under a strategy, as Keras reduces them."""

from __future__ import annotations

import tensorflow as tf

from tfmemsafe import memory
from tfmemsafe.errors import OutOfMemoryError

_OPTIONALS = (tf.experimental.Optional, tf.OptionalSpec)


def read(iterator, count: int) -> list:
    """Up to `count` batches from `iterator`; raises `StopIteration` when
    it has none (Keras' loop ends the epoch there).

    Raises:
        OutOfMemoryError: The data pipeline ran out of memory making the
            batch. Reading again would skip it, so nothing is retried.
    """
    batches = []
    for _ in range(count):
        try:
            batch = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            if batches:
                break
            raise
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            raise OutOfMemoryError(
                "The data pipeline ran out of memory making the next batch "
                "(tf.data reads ahead beside the training step; on a CPU "
                "both use one allocator). The batch is lost to its "
                "iterator, so training stops rather than skip it. Instead, "
                "leave the pipeline more room: a smaller `prefetch` or "
                "shuffle buffer, or a smaller batch.",
                error=err,
            ) from err
        batches.append(without_optionals(batch))
    return batches


def without_optionals(batch):
    """Keras' data gives `None` parts as empty `tf.experimental.Optional`s;
    its own step function maps them back to `None`, as here."""
    return tf.nest.map_structure(
        lambda t: None if isinstance(t, _OPTIONALS) else t, batch
    )


def share_rows(batch) -> list:
    """The rows of each replica's share of `batch` (one share unless it
    is a batch of `tf.distribute` values)."""
    for leaf in tf.nest.flatten(batch):
        if leaf is None:
            continue
        if isinstance(leaf, tf.distribute.DistributedValues):
            return [int(tf.shape(part)[0]) for part in leaf.values]
        return [int(tf.shape(leaf)[0])]
    raise ValueError("The batch holds no tensor.")


def example_shape(batch) -> tuple:
    """The shape and dtype of each tensor of one example of `batch` (of
    its first share): what sets a row's memory."""
    return tuple(
        (tuple(part.shape[1:]), part.dtype.name)
        for part in (
            leaf.values[0]
            if isinstance(leaf, tf.distribute.DistributedValues)
            else leaf
            for leaf in tf.nest.flatten(batch)
            if leaf is not None
        )
    )


def rows_of(batch) -> int:
    """The rows of `batch`'s largest replica share: what micro-batches
    are sized in."""
    return max(share_rows(batch))


def sliced(batch, start: int, end: int, strategy=None):
    """Rows `start` to `end` of `batch`; of a batch of `tf.distribute`
    values, those rows of every replica's share, on its replica."""

    def cut(value):
        return None if value is None else value[start:end]

    leaves = tf.nest.flatten(batch)
    if not any(isinstance(t, tf.distribute.DistributedValues) for t in leaves):
        return tf.nest.map_structure(cut, batch)
    local = [
        strategy.experimental_local_results(t)
        if isinstance(t, tf.distribute.DistributedValues)
        else None
        for t in leaves
    ]

    def on_replica(context):
        replica = context.replica_id_in_sync_group
        return tf.nest.pack_sequence_as(
            batch,
            [
                cut(leaf if parts is None else parts[replica])
                for leaf, parts in zip(leaves, local, strict=True)
            ],
        )

    return strategy.experimental_distribute_values_from_function(on_replica)


def local_shares(batch, strategy) -> list:
    """Each of this worker's replicas' share of `batch`: its local values
    of a batch of `tf.distribute` values (Keras distributes every batch
    under a strategy of several devices a worker), else the batch."""
    leaves = tf.nest.flatten(batch)
    if not any(isinstance(t, tf.distribute.DistributedValues) for t in leaves):
        return [batch]
    local = [
        None if t is None else strategy.experimental_local_results(t)
        for t in leaves
    ]
    return [
        tf.nest.pack_sequence_as(
            batch, [None if parts is None else parts[r] for parts in local]
        )
        for r in range(len(strategy.extended.worker_devices))
    ]


def joined(outputs):
    if len(outputs) == 1:
        return outputs[0]
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)


def reduced(strategy, name: str, outputs, reduce: bool = True):
    """Per-replica outputs of the `name` step as Keras reduces them: logs
    averaged, predictions joined (unless `reduce` is false)."""
    if strategy.num_replicas_in_sync == 1 or not reduce:
        return outputs

    def one(value):
        if not isinstance(value, tf.distribute.DistributedValues):
            return value
        parts = strategy.experimental_local_results(value)
        if name == "predict":
            return tf.concat(parts, axis=0)
        return tf.reduce_mean(parts, axis=0)

    return tf.nest.map_structure(one, outputs)


def joined_replicas(strategy, outputs):
    """Per-replica predictions of consecutive micro-batches, joined as
    Keras joins a batch's: each replica's pieces in order, then the
    replicas in order."""
    shares = [local_shares(out, strategy) for out in outputs]
    return joined(
        [joined([share[r] for share in shares]) for r in range(len(shares[0]))]
    )
