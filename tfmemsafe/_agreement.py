"""What the workers of a multi-worker job agree on, and how.

Plans that every worker must follow alike (the micro-batches of a step,
length buckets, a `tfmemsafe.plan`) are made from figures every worker
holds: `gathered` exchanges them through the strategy's own all-reduce,
`exchanged` also tells every worker when one failed to make its figures,
and `local_copy` gives a worker a copy of the model to measure its own
device without the job's collectives.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf


def gathered(strategy, figures) -> np.ndarray:
    """Every replica's `figures`, one row each, on every worker.

    Through the strategy's own all-reduce (`Strategy.reduce`), eagerly.

    Args:
        strategy: The `MultiWorkerMirroredStrategy` (or any strategy).
        figures: A 1-D sequence of numbers, of the same length on every
            worker (exact up to 2**53).

    Returns:
        An array of `num_replicas_in_sync` rows; the replicas of one
        worker hold the same row.
    """
    row = np.asarray(figures, np.float64).reshape(-1)
    replicas = strategy.num_replicas_in_sync

    def rows(context):
        table = np.zeros((replicas, row.size), np.float64)
        table[context.replica_id_in_sync_group] = row
        return tf.constant(table)

    return strategy.reduce(
        tf.distribute.ReduceOp.SUM,
        strategy.experimental_distribute_values_from_function(rows),
        axis=None,
    ).numpy()


def exchanged(strategy, work, width: int, caller: str) -> np.ndarray:
    """`work()`'s figures from every worker, one row each, on every worker.

    For plans made from figures every worker shares (`gathered`). If
    `work` raises on a worker, the others learn it in the exchange, so that
    every worker raises instead of waiting for it.

    Args:
        strategy: The `MultiWorkerMirroredStrategy`.
        work: A callable returning `width` numbers.
        width: int. How many, the same on every worker.
        caller: str. What plans, for the other workers' error.

    Returns:
        An array of `num_replicas_in_sync` rows of `width`.

    Raises:
        RuntimeError: If another worker's `work` raised. This worker's own
            error is raised as it is, after the others are told.
    """
    try:
        figures = np.asarray(work(), np.float64).reshape(-1)
        if figures.size != width:
            raise ValueError(
                f"{caller}: {figures.size} figures to exchange where every "
                f"worker gives {width}"
            )
    except BaseException:  # Told to the others, then raised as it is.
        _told(strategy, np.zeros(width), caller, failed=True)
        raise
    return _told(strategy, figures, caller, failed=False)


def _told(strategy, figures, caller, *, failed: bool) -> np.ndarray:
    """`gathered`, with a last column saying whether a worker failed."""
    row = np.append(figures, float(failed))
    table = gathered(strategy, row)
    if not failed and table[:, -1].any():
        raise RuntimeError(
            f"{caller} stopped: another worker of the job could not plan "
            "(its error is in its own log)."
        )
    return table[:, :-1]


@contextlib.contextmanager
def local_copy(model: keras.Model, caller: str, remedy: str = ""):
    """A copy of `model` outside every strategy, compiled as it is.

    For measuring one worker's device without the job's collectives: a
    probe of the model itself would run them, and workers whose probes
    differed would wait for each other for ever. Built from the model's
    config (`keras.models.clone_model`) with fresh weights: the memory of
    a step does not depend on their values. Its memory goes once the
    caller drops it too and collects garbage (a Keras model is in
    reference cycles).

    Args:
        model: The job's `keras.Model`.
        caller: str. What measures, for the errors.
        remedy: str. What else the user can do, for the error when the
            model cannot be copied.

    Raises:
        ValueError: Inside a strategy's scope, or if the model cannot be
            copied.
    """
    if tf.distribute.has_strategy():
        raise ValueError(
            f"{caller} must be called outside `strategy.scope()` for a "
            "multi-worker job: it measures a copy of the model outside the "
            "strategy. Received a call inside the scope of "
            f"{type(tf.distribute.get_strategy()).__name__}."
        )
    config = model.get_compile_config()
    try:
        copy = keras.models.clone_model(model)
        if config is None:
            raise ValueError("the model was not compiled from a config")
        copy.compile_from_config(config)
    except Exception as err:
        raise ValueError(
            f"{caller} measures a multi-worker job's memory on a copy of "
            f"the model outside the strategy, and could not copy this one: "
            f"{err}. Give its layers a complete `get_config`{remedy}."
        ) from err
    try:
        yield copy
    finally:
        del copy
