"""Batches as Keras' step functions get them: read, sliced, joined."""

from __future__ import annotations

import tensorflow as tf

_OPTIONALS = (tf.experimental.Optional, tf.OptionalSpec)


def read(iterator, count: int) -> list:
    """Up to `count` batches from `iterator`; raises `StopIteration` when
    it has none (Keras' loop ends the epoch there)."""
    batches = []
    for _ in range(count):
        try:
            batch = next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            if batches:
                break
            raise
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


def rows_of(batch) -> int:
    """The rows of `batch`'s largest replica share: what micro-batches
    are sized in."""
    return max(share_rows(batch))


def sliced(batch, start: int, end: int):
    """Rows `start` to `end` of `batch` (of each replica's share, for a
    batch of `tf.distribute` values: those rows of every share)."""

    def cut(value):
        if value is None:
            return None
        return value[start:end]

    leaves = tf.nest.flatten(batch)
    if any(isinstance(t, tf.distribute.DistributedValues) for t in leaves):
        raise ValueError(
            "A model with its own `train_step` is split under a "
            "`tf.distribute` strategy only by `SplitBatch`."
        )
    return tf.nest.map_structure(cut, batch)


def joined(outputs):
    if len(outputs) == 1:
        return outputs[0]
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outputs)
