"""`tfmemsafe.evaluate` and `tfmemsafe.predict`: one phase, one retry loop.

Both open the same way (`_retry.SinglePhase`: checks, sizes, planner) and
recover through the same loop; `predict` keeps the rows it finished
(`PredictionProgress`) so that it goes on from the first one it did not.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
from absl import logging

from tfmemsafe import _checks
from tfmemsafe._sources import num_rows
from tfmemsafe.monitor import monitors_first
from tfmemsafe.recovery._retry import SinglePhase


def evaluate(
    model: keras.Model,
    data,
    *,
    batch_size: int | None = None,
    steps: int | None = None,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    memory_estimate: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    return_dict: bool = False,
):
    """Evaluates a compiled model, halving the batch when memory runs out.

    Like `model.evaluate`. An out-of-memory error starts the evaluation
    again from the first batch at half the batch size (and twice the
    `steps`), so the metrics always cover the whole data once; or, when a
    memory estimate of the evaluation step predicts that half does not
    fit either, at the largest halving predicted to fit (as in `fit`).

    Args:
        model: A compiled `keras.Model`.
        data: Data of any kind `tfmemsafe.fit` accepts.
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        steps: int or `None`. As in `model.evaluate`, at the first batch
            size.
        min_batch_size: int. The smallest batch size to try. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        memory_estimate: bool. Whether to estimate the step's memory
            after an error, to jump to a size predicted to fit. Defaults
            to `True`.
        callbacks: list of `keras.callbacks.Callback`.
        verbose: `"auto"`, 0, 1 or 2.
        return_dict: bool. Whether to return `{name: value}`.

    Returns:
        What `model.evaluate` returns.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.evaluate(model, (x, y), batch_size=4096, return_dict=True)
    {'loss': 0.31}
    """
    _checks.compiled_model(model, "evaluate")
    call = SinglePhase(
        "evaluation",
        "tfmemsafe.evaluate",
        model,
        data,
        batch_size=batch_size,
        min_batch_size=min_batch_size,
        max_retries=max_retries,
        memory_estimate=memory_estimate,
        labelled=True,
    )
    callbacks = monitors_first(_checks.callbacks(callbacks))

    def attempt():
        return model.evaluate(
            **call.source.keras_arguments(call.batch_size),
            steps=call.policy.scaled_steps("evaluation", steps),
            callbacks=callbacks,
            verbose=verbose,
            return_dict=return_dict,
        )

    def recover(decision) -> None:
        decision = call.jump(decision)
        logging.warning(
            "tfmemsafe.evaluate: out of memory: %s. Starting again.",
            decision.describe(),
        )

    return call.run(attempt, recover)


def predict(
    model: keras.Model,
    data,
    *,
    batch_size: int | None = None,
    min_batch_size: int = 1,
    max_retries: int | None = None,
    memory_estimate: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
):
    """Predicts with a model, halving the batch when memory runs out.

    Like `model.predict`, and it returns every sample once, in order, even
    when it had to halve midway: the batches finished before an
    out-of-memory error are kept (moved to host memory), and prediction
    goes on from the first sample that was not finished (at half the
    batch size, or at the largest halving a memory estimate of the
    prediction step predicts to fit, as in `fit`). A dataset or a
    callable's dataset must therefore give the same samples in the same
    order each time (no shuffling), and be finite.

    Args:
        model: A `keras.Model`.
        data: The inputs: a callable `batch_size -> tf.data.Dataset`, an
            unbatched or batched `tf.data.Dataset`, or an array (or a
            dict or list of arrays, for several inputs).
        batch_size: int or `None`. The batch size to start at. `None`
            means the batch size of a batched dataset, else 32.
        min_batch_size: int. The smallest batch size to try. Defaults
            to 1.
        max_retries: int or `None`. How many out-of-memory errors to
            recover from; `None` for no limit but `min_batch_size`.
        memory_estimate: bool. Whether to estimate the step's memory
            after an error, to jump to a size predicted to fit. Defaults
            to `True`.
        callbacks: list of `keras.callbacks.Callback`.
        verbose: `"auto"`, 0, 1 or 2.

    Returns:
        NumPy arrays, structured as the model's outputs.

    Raises:
        OutOfMemoryError: If the batch size would fall below
            `min_batch_size`, or `max_retries` is used up.

    Example:
    >>> tfmemsafe.predict(model, x, batch_size=4096).shape
    (10000, 10)
    """
    _checks.model(model)
    call = SinglePhase(
        "prediction",
        "tfmemsafe.predict",
        model,
        data,
        batch_size=batch_size,
        min_batch_size=min_batch_size,
        max_retries=max_retries,
        memory_estimate=memory_estimate,
        labelled=False,
    )
    progress = PredictionProgress()
    callbacks = monitors_first([progress, *_checks.callbacks(callbacks)])

    def attempt():
        outputs = model.predict(
            **call.source.keras_arguments(
                call.batch_size, skip=progress.rows_done
            ),
            callbacks=callbacks,
            verbose=verbose,
        )
        return progress.all_outputs(outputs)

    def recover(decision):
        progress.keep_finished()
        if progress.ended:  # Every batch was done; what failed came after.
            return progress.all_outputs()
        decision = call.jump(decision)
        logging.warning(
            "tfmemsafe.predict: out of memory after %d samples: %s. Going "
            "on from there.",
            progress.rows_done,
            decision.describe(),
        )
        return None

    return call.run(attempt, recover)


class PredictionProgress(keras.callbacks.Callback):
    """The rows `predict` has finished, kept across its attempts.

    Attributes:
        batches: list. The outputs of the current attempt's batches.
        finished: list. Host copies of the outputs of earlier attempts'
            finished batches, in order.
        rows_done: int. The number of rows in `finished`.
        ended: bool. Whether the current attempt predicted every batch.
    """

    def __init__(self):
        super().__init__()
        self.batches = []
        self.finished = []
        self.rows_done = 0
        self.ended = False

    def on_predict_begin(self, logs=None):
        self.batches = []
        self.ended = False

    def on_predict_batch_end(self, batch, logs=None):
        self.batches.append(logs["outputs"])

    def on_predict_end(self, logs=None):
        self.ended = True

    def keep_finished(self) -> None:
        """Moves a failed attempt's finished batches to `finished`."""
        # Host copies, so the device memory of the finished batches is free.
        kept = [keras.tree.map_structure(np.asarray, o) for o in self.batches]
        self.batches = []
        self.rows_done += sum(num_rows(o) for o in kept)
        self.finished.extend(kept)

    def all_outputs(self, last=None):
        """The finished outputs, then `last` (the final attempt's)."""
        if last is None:
            return _concatenate(self.finished)
        if not self.finished:
            return last
        return _concatenate([*self.finished, last])


def _concatenate(batches: list):
    return keras.tree.map_structure(
        lambda *parts: np.concatenate(parts, axis=0), *batches
    )
