"""Simulated out-of-memory errors: a callback that raises one at chosen
steps (outside the step), and a layer that raises one inside the step."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _checks

_PHASES = ("train", "test", "predict", "epoch_end")


class SimulatedOutOfMemory(keras.callbacks.Callback):
    """Raises a `ResourceExhaustedError` once at each of the given points.

    For testing what code does after an out-of-memory error escapes a
    Keras call, at an exact step, without a memory cap (see
    `run_with_memory_cap` for a real error). The error is the one
    TensorFlow raises when an allocation fails, with a message of the same
    shape, so `tfmemsafe.is_oom_error` recognises it. It is raised from a
    callback, outside the training step, where `SplitBatchOnOOM` does not
    retry it: to test recovery, put an `OutOfMemoryAbove` layer in the
    model instead. Each point raises once. The callback counts epochs and
    steps itself, as any user callback sees them.

    Args:
        *points: Tuples `(phase, epoch, step)`. `phase` is `"train"`,
            `"test"` (evaluation, or validation within `fit`),
            `"predict"`, or `"epoch_end"` (raised from `on_epoch_end`;
            `step` is `None`). `epoch` counts from 0, and is `None` for
            `evaluate()` or `predict()` outside `fit()`; `step` is the
            batch index within the epoch.

    Example:
    >>> model.fit(
    ...     x, y, batch_size=32, epochs=2,
    ...     callbacks=[tfmemsafe.testing.SimulatedOutOfMemory(("train", 1, 3))],
    ... )
    Traceback (most recent call last):
    ResourceExhaustedError: OOM when allocating tensor ...
    """

    def __init__(self, *points: tuple):
        super().__init__()
        for point in points:
            if (
                not isinstance(point, tuple)
                or len(point) != 3
                or point[0] not in _PHASES
            ):
                raise ValueError(
                    "Each point must be a tuple `(phase, epoch, step)` with "
                    f"phase one of {', '.join(_PHASES)}. Received: "
                    f"point={point!r}"
                )
        self.points = set(points)
        self.epoch = None

    def _maybe_raise(self, phase, step):
        point = (phase, self.epoch, step)
        if point in self.points:
            self.points.discard(point)
            raise tf.errors.ResourceExhaustedError(
                None, None, f"OOM when allocating tensor (injected: {point})"
            )

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe_raise("train", batch)

    def on_test_batch_begin(self, batch, logs=None):
        self._maybe_raise("test", batch)

    def on_epoch_end(self, epoch, logs=None):
        self._maybe_raise("epoch_end", None)

    def on_predict_batch_begin(self, batch, logs=None):
        self._maybe_raise("predict", batch)


@keras.saving.register_keras_serializable(package="tfmemsafe")
class OutOfMemoryAbove(keras.layers.Layer):
    """Runs out of memory, from inside the step, on batches of more than
    `rows` rows.

    Passes its input through. When the batch it is called on (under a
    `tf.distribute` strategy, a replica's share) has more than `rows`
    rows, it raises TensorFlow's out-of-memory error, with the message of
    a failed allocation, which `tfmemsafe.is_oom_error` recognises (out
    of a compiled step TensorFlow hands it on as an `UnknownError` that
    quotes it), from inside the step, at once: where a real allocator
    failure would come from, without a memory cap or its ten-second
    wait. Put it first in a model to test `SplitBatchOnOOM`: batches above
    `rows` run out, their micro-batches of at most `rows` train.

    Args:
        rows: int or `None`. The most rows that do not run out; `None`:
            none runs out.

    Example:
    >>> model = keras.Sequential([
    ...     keras.Input((8,)),
    ...     tfmemsafe.testing.OutOfMemoryAbove(16),
    ...     keras.layers.Dense(1),
    ... ])
    >>> model.compile("adam", "mse")
    >>> history = tfmemsafe.fit(model, x, y, batch_size=64, verbose=0)
    >>> history.oom_events[0].split_into >= 4
    True
    """

    def __init__(self, rows: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if rows is not None:
            rows = _checks.integer("rows", rows, 0)
        self.rows = rows

    def call(self, inputs):
        def check(count):
            if self.rows is not None and int(count) > self.rows:
                raise tf.errors.ResourceExhaustedError(
                    None,
                    None,
                    f"OOM when allocating tensor with shape[{int(count)},"
                    "4096] (simulated by OutOfMemoryAbove)",
                )
            return np.float32(0.0)

        first = tf.nest.flatten(inputs)[0]
        zero = tf.py_function(check, [tf.shape(first)[0]], tf.float32)
        zero.set_shape(())
        return tf.nest.map_structure(
            lambda t: t + tf.cast(zero, t.dtype), inputs
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "rows": self.rows}
