"""The callbacks every `AccumulatingModel.fit` runs first, and their order."""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe.monitor import monitors_first


class WindowCallback(keras.callbacks.Callback):
    """Starts each `fit` with empty windows and flushes them every epoch.

    It runs first, so validation, checkpoints and early stopping all see
    the weights with the epoch's last (partial) window applied.
    """

    def __init__(self):
        super().__init__()
        self._training = False

    def on_train_begin(self, logs=None):
        self._training = True
        self.model._discard_partial_windows()

    def on_test_begin(self, logs=None):
        if self._training:  # Validation at the end of an epoch.
            self.model.flush_gradients()

    def on_epoch_end(self, epoch, logs=None):
        self.model.flush_gradients()
        if logs is not None and "skipped_windows" in logs:
            logs["skipped_windows"] = self.model.skipped_windows

    def on_train_end(self, logs=None):
        self._training = False
        skipped = self.model.skipped_windows
        if skipped:
            logging.info(
                "%d accumulation windows were skipped because their "
                "scaled gradients overflowed (each halved the loss scale).",
                skipped,
            )


def ordered_callbacks(callbacks, window_callback, model):
    """Puts `window_callback` first, then every `MemoryMonitor`.

    The window callback flushes partial windows before anything else sees
    the epoch's end; the monitors come next so that every later callback
    (checkpoints, early stopping, CSV and progress logs) finds
    `memory_peak_mb` in `logs`. Others keep their order. `callbacks` is a
    list or a `CallbackList` (reordered in place).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        window_callback.set_model(model)
        if callbacks.params:
            window_callback.set_params(callbacks.params)
        callbacks.callbacks[:] = [
            window_callback,
            *monitors_first(callbacks.callbacks),
        ]
        return callbacks
    return [window_callback, *monitors_first(tf.nest.flatten(callbacks or []))]
