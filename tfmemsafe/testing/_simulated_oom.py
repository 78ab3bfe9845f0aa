"""A callback that raises a simulated out-of-memory error at chosen steps."""

from __future__ import annotations

import keras
import tensorflow as tf

_PHASES = ("train", "test", "predict", "epoch_end")


class SimulatedOutOfMemory(keras.callbacks.Callback):
    """Raises a `ResourceExhaustedError` once at each of the given points.

    For testing out-of-memory handling in this process, at an exact step,
    without a memory cap (see `run_with_memory_cap` for a real error). The
    error is the one TensorFlow raises when an allocation fails, with a
    message of the same shape, so `tfmemsafe.is_oom_error` recognises it.
    Each point raises once; a retry of the same step goes through. The
    callback counts epochs and steps itself, as any user callback sees
    them.

    Args:
        *points: Tuples `(phase, epoch, step)`. `phase` is `"train"`,
            `"test"` (evaluation, or validation within `fit`),
            `"predict"`, or `"epoch_end"` (raised from `on_epoch_end`;
            `step` is `None`). `epoch` counts from 0, and is `None` for
            `evaluate()` or `predict()` outside `fit()`; `step` is the
            batch index within the epoch.

    Example:
    >>> history = tfmemsafe.fit(
    ...     model,
    ...     (x, y),
    ...     batch_size=32,
    ...     epochs=2,
    ...     callbacks=[
    ...         tfmemsafe.testing.SimulatedOutOfMemory(("train", 1, 3))
    ...     ],
    ... )
    >>> history.oom_events[0].batch_size_after
    16
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
