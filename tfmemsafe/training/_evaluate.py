"""`tfmemsafe.evaluate` and `tfmemsafe.predict`: `model.evaluate` and
`model.predict` with `SplitBatchOnOOM`, on the data `tfmemsafe.fit`
takes."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmemsafe import _checks
from tfmemsafe._keras_data import chained_cause
from tfmemsafe._keras_data import check_kind
from tfmemsafe._keras_data import check_x_and_y
from tfmemsafe._keras_data import keras_data
from tfmemsafe._keras_data import unpacked
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery import SplitBatchOnOOM


def evaluate(
    model: keras.Model,
    x=None,
    y=None,
    batch_size: int | None = None,
    verbose="auto",
    sample_weight=None,
    steps: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    return_dict: bool = False,
    *,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    memory_estimate: bool = True,
):
    """Evaluates a compiled model, splitting a batch that runs out of
    memory.

    `model.evaluate` with `tfmemsafe.SplitBatchOnOOM`: a batch that runs
    out is evaluated again as micro-batches whose metrics add up to the
    batch's, and the evaluation goes on; the metrics cover the whole data
    once.

    Takes `model.evaluate`'s arguments in its order, and the data
    `tfmemsafe.fit` takes (a tuple `(x, y[, sample_weight])` as `x`
    included).

    Args:
        model: A compiled `keras.Model`.
        x: The inputs, or the whole data: of any kind `tfmemsafe.fit`
            takes.
        y: The targets, with arrays or tensors as `x`.
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        verbose: `"auto"`, 0, 1 or 2.
        sample_weight: The samples' weights, with arrays as `x`.
        steps: int or `None`. As in `model.evaluate`.
        callbacks: list of `keras.callbacks.Callback`.
        return_dict: bool. Whether to return `{name: value}`.
        min_batch_size: int. The fewest rows of a micro-batch. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        memory_estimate: bool. Kept so that calls written for earlier
            versions run; micro-batches are sized by measurement.

    Returns:
        What `model.evaluate` returns.

    Raises:
        TypeError: If `x` or `y` is of no kind `model.evaluate` takes.
        ValueError: If `y` is given beside a dataset, generator or
            callable `x`, which brings its own targets.
        OutOfMemoryError: If a micro-batch of `min_batch_size` rows runs
            out, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.evaluate(model, x, y, batch_size=4096, return_dict=True)
    {'loss': 0.31}
    """
    _checks.compiled_model(model, "evaluate")
    _checks.boolean("memory_estimate", memory_estimate)
    split = _split_for(batch_size, min_batch_size, max_retries)
    check_x_and_y(x, y)
    x, y, sample_weight = unpacked(x, y, sample_weight)
    x, batch_size, _ = keras_data(x, batch_size, model.distribute_strategy)
    # Without the batch Keras reads and drops under a strategy: see
    # docs/oom-recovery.md.
    with without_sample_batch(model), chained_cause():
        return model.evaluate(
            x,
            y,
            batch_size=batch_size,
            sample_weight=sample_weight,
            steps=steps,
            callbacks=[*monitors_first(_checks.callbacks(callbacks)), split],
            verbose=verbose,
            return_dict=return_dict,
        )


def predict(
    model: keras.Model,
    x,
    batch_size: int | None = None,
    verbose="auto",
    steps: int | None = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    *,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    memory_estimate: bool = True,
):
    """Predicts with a model, splitting a batch that runs out of memory.

    `model.predict` with `tfmemsafe.SplitBatchOnOOM`: a batch that runs
    out is predicted again as micro-batches whose outputs are joined in
    order; every sample is returned once, in order.

    Takes `model.predict`'s arguments in its order.

    Args:
        model: A `keras.Model`.
        x: The inputs: an array (or a dict or list of arrays, for
            several inputs), a tf.data.Dataset (unbatched ones are batched
            at `batch_size`), a callable `batch_size -> tf.data.Dataset`,
            a `keras.utils.PyDataset` or a generator.
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        verbose: `"auto"`, 0, 1 or 2.
        steps: int or `None`. As in `model.predict`.
        callbacks: list of `keras.callbacks.Callback`.
        min_batch_size: int. The fewest rows of a micro-batch. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        memory_estimate: bool. Kept so that calls written for earlier
            versions run; micro-batches are sized by measurement.

    Returns:
        NumPy arrays, structured as the model's outputs.

    Raises:
        OutOfMemoryError: If a micro-batch of `min_batch_size` rows runs
            out, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.predict(model, x, batch_size=4096).shape
    (10000, 10)
    """
    _checks.model(model)
    _checks.boolean("memory_estimate", memory_estimate)
    split = _split_for(batch_size, min_batch_size, max_retries)
    check_kind(x, "x")
    x, batch_size, _ = keras_data(x, batch_size, model.distribute_strategy)
    # Without the batch Keras reads and drops under a strategy: see
    # docs/oom-recovery.md.
    with without_sample_batch(model), chained_cause():
        return model.predict(
            x,
            batch_size=batch_size,
            steps=steps,
            callbacks=[*monitors_first(_checks.callbacks(callbacks)), split],
            verbose=verbose,
        )


def _split_for(batch_size, min_batch_size, max_retries) -> SplitBatchOnOOM:
    """The callback of one `evaluate` or `predict` call, its limits
    checked against the batch size asked for."""
    _checks.retry_limits(min_batch_size, max_retries)
    if batch_size is not None:
        batch_size = _checks.integer("batch_size", batch_size)
    _checks.start_sizes(min_batch_size, batch_size=batch_size)
    return SplitBatchOnOOM(
        min_micro_batch_size=min_batch_size, max_retries=max_retries
    )
