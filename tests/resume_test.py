"""Tests for resuming `tfmemsafe.fit` at the step that ran out of memory.

Issue #15 (resume at the failed step; restore only what can have changed;
multi-worker restarts at the smaller size) and issue #16 items 1 and 2 (no
phantom optimizer step after rebatching; a consistent model when `fit`
gives up).

The in-process tests raise `ResourceExhaustedError` from a callback at an
exact step. `RealOutOfMemoryTest` runs its scenarios in child processes
under a real allocator cap, side by side, so that their ten-second
allocator waits overlap.
"""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe

_ROWS = 256
_BATCH = 32


class CountingModel(keras.Model):
    """A regression model that counts, in its own state, what it trains on.

    Inputs are `(features, ids)`. In a training forward pass it adds one
    to `seen[id]` for every sample: state the model keeps, updated whether
    or not the step goes on to finish, like BatchNormalization's moving
    statistics. `forward_passes`, a variable the model does not own (so no
    recovery puts it back), counts every sample that entered a training
    forward pass.
    """

    def __init__(self, rows=_ROWS, seed=0, **kwargs):
        super().__init__(**kwargs)
        keras.utils.set_random_seed(seed)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.head = keras.layers.Dense(1)
        self.seen = self.add_weight(
            shape=(rows,), initializer="zeros", trainable=False, name="seen"
        )
        self._forward = [tf.Variable(0.0, trainable=False)]

    @property
    def forward_passes(self) -> int:
        return int(self._forward[0].numpy())

    def call(self, inputs, training=False):
        features, ids = inputs
        if training:
            ones = tf.ones_like(ids, self.seen.dtype)
            self.seen.assign_add(
                tf.scatter_nd(ids[:, None], ones, self.seen.shape)
            )
            self._forward[0].assign_add(tf.reduce_sum(ones))
        return self.head(self.hidden(features))


def _counting(accumulation_steps=None, rows=_ROWS):
    model = CountingModel(rows)
    (x, ids), _ = _table(rows)
    model((x[:1], ids[:1]))  # Built, so wrapping it keeps its variables.
    if accumulation_steps is not None:
        model = tfmemsafe.with_gradient_accumulation(model, accumulation_steps)
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    return model


def _table(rows=_ROWS):
    x = np.random.default_rng(1).normal(size=(rows, 4)).astype("float32")
    ids = np.arange(rows, dtype="int32")
    return (x, ids), x.sum(axis=1, keepdims=True)


def _data_of_kind(kind, inputs, y):
    dataset = tf.data.Dataset.from_tensor_slices((inputs, y))
    return {
        "arrays": (inputs, y),
        "unbatched_dataset": dataset,
        "batched_dataset": dataset.batch(_BATCH),
        "callable": lambda batch_size: dataset.batch(batch_size),
    }[kind]


_KINDS = (
    ("arrays", "arrays", False),
    ("shuffled_arrays", "arrays", True),
    ("unbatched_dataset", "unbatched_dataset", False),
    ("batched_dataset", "batched_dataset", False),
    ("callable", "callable", False),
)


class _RaiseOutOfMemory(keras.callbacks.Callback):
    """Raises a `ResourceExhaustedError` once at each `(phase, epoch, step)`.

    `phase` is "train" or "test". It counts epochs and steps itself, so it
    sees what a user's callback sees.
    """

    def __init__(self, *points):
        super().__init__()
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


class _Recorder(keras.callbacks.Callback):
    """Records the hooks a user's callback sees."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.batches = {}
        self.epoch_logs = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_train_end(self, logs=None):
        self.calls.append("train_end")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))
        self.batches[epoch] = []

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch))
        self.epoch_logs.append(dict(logs))

    def on_train_batch_end(self, batch, logs=None):
        self.batches[self.calls[-1][1]].append(batch)


def _epochs_of(recorder):
    return [c for c in recorder.calls if c != "train_begin"]


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


class PhantomStepTest(parameterized.TestCase, tf.test.TestCase):
    """Issue #16.1: `iterations` counts updates whatever the data kind."""

    def _rows(self):
        (x, _), y = _table(1024)
        return tf.data.Dataset.from_tensor_slices((x, y))

    def _model(self, accumulation_steps=None):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        if accumulation_steps is not None:
            model = tfmemsafe.with_gradient_accumulation(
                model, accumulation_steps
            )
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        return model

    @parameterized.named_parameters(("plain", None), ("accumulating", 2))
    def test_rebatched_dataset_takes_no_phantom_step(self, steps):
        reference = self._model(steps)
        reference.fit(self._rows().batch(512), epochs=2, verbose=0)
        model = self._model(steps)
        tfmemsafe.fit(
            model, self._rows().batch(1024), batch_size=512, epochs=2, verbose=0
        )
        self.assertEqual(
            int(model.optimizer.iterations),
            int(reference.optimizer.iterations),
        )
        self.assertEqual(int(model.optimizer.iterations), 4 if not steps else 2)
        self.assertAllClose(_weights(model), _weights(reference), atol=1e-6)

    @parameterized.named_parameters(
        ("callable", "callable"), ("unbatched", "unbatched_dataset")
    )
    def test_data_of_unknown_length_takes_no_phantom_step(self, kind):
        # `filter` hides the length; plain `model.fit` takes one phantom
        # step per epoch on such data (6 here), tfmemsafe.fit does not.
        rows = self._rows()
        if kind == "callable":
            data = lambda size: rows.batch(size).filter(lambda *_: True)  # noqa: E731
        else:
            data = rows.filter(lambda *_: True)
        reference = self._model()
        reference.fit(rows.batch(512), epochs=2, verbose=0)
        model = self._model()
        tfmemsafe.fit(model, data, batch_size=512, epochs=2, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertAllClose(_weights(model), _weights(reference), atol=1e-6)


class GiveUpTest(tf.test.TestCase):
    """Issue #16.2: giving up leaves the last completed epoch's state."""

    def _state(self, model):
        return [v.numpy() for v in model.variables + model.optimizer.variables]

    def test_giving_up_puts_back_the_last_completed_epoch(self):
        (x, ids), y = _table()
        reference = _counting()
        reference.fit((x, ids), y, batch_size=_BATCH, shuffle=False, verbose=0)
        model = _counting()
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError,
            r"^Could not fit a training batch of 32 after trying 32, and "
            r"`max_retries` is used up\. The model is as it was at the end "
            r"of epoch 1 \(optimizer iterations 8\)\. Instead, try",
        ):
            tfmemsafe.fit(
                model,
                ((x, ids), y),
                batch_size=_BATCH,
                epochs=3,
                max_retries=0,
                shuffle=False,
                callbacks=[_RaiseOutOfMemory(("train", 1, 3))],
                verbose=0,
            )
        self.assertEqual(int(model.optimizer.iterations), 8)
        self.assertAllClose(self._state(model), self._state(reference))

    def test_giving_up_in_the_first_epoch_puts_back_the_start(self):
        (x, ids), y = _table()
        model = _counting()
        model.optimizer.build(model.trainable_variables)
        start = self._state(model)
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError,
            r"The model is as it was before training \(optimizer "
            r"iterations 0\)\.",
        ):
            tfmemsafe.fit(
                model,
                ((x, ids), y),
                batch_size=_BATCH,
                min_batch_size=_BATCH,
                callbacks=[_RaiseOutOfMemory(("train", 0, 5))],
                verbose=0,
            )
        self.assertAllClose(self._state(model), start)


class ResumeTest(parameterized.TestCase, tf.test.TestCase):
    """Issue #15.1: an OOM at step k resumes at step k, not the epoch."""

    @parameterized.named_parameters(*_KINDS)
    def test_each_sample_trains_once_per_epoch_after_resuming(
        self, kind, shuffle
    ):
        inputs, y = _table()
        model = _counting()
        recorder = _Recorder()
        with self.assertLogs(level="WARNING") as logs:
            history = tfmemsafe.fit(
                model,
                _data_of_kind(kind, inputs, y),
                batch_size=_BATCH,
                epochs=3,
                shuffle=shuffle,
                callbacks=[_RaiseOutOfMemory(("train", 1, 5)), recorder],
                verbose=0,
            )
        [event] = history.oom_events
        self.assertEqual(event.resumed_at_step, 5)
        self.assertIn("Resuming at step 5 of epoch 2", "\n".join(logs.output))
        self.assertAllEqual(model.seen.numpy(), np.full(_ROWS, 3.0))
        # The failed step never started (the error came before it): no
        # sample went through a forward pass twice.
        self.assertEqual(model.forward_passes, 3 * _ROWS)
        # 8 steps, then 5 at 32 and 6 at 16, then 16 steps at 16.
        self.assertEqual(int(model.optimizer.iterations), 8 + 5 + 6 + 16)
        self.assertEqual(history.epoch, [0, 1, 2])
        self.assertLen(history.history["loss"], 3)
        self.assertEqual(
            _epochs_of(recorder),
            [
                ("epoch_begin", 0),
                ("epoch_end", 0),
                ("epoch_begin", 1),
                ("epoch_end", 1),
                ("epoch_begin", 2),
                ("epoch_end", 2),
                "train_end",
            ],
        )
        self.assertEqual(recorder.batches[1], list(range(11)))
        self.assertEqual(recorder.batches[2], list(range(16)))

    def test_resumed_epoch_logs_and_weights_match_fit_on_the_same_batches(
        self,
    ):
        (x, ids), y = _table()
        model = _counting()
        history = tfmemsafe.fit(
            model,
            ((x, ids), y),
            batch_size=_BATCH,
            epochs=2,
            shuffle=False,
            callbacks=[_RaiseOutOfMemory(("train", 1, 5))],
            verbose=0,
        )
        # What never failing would do: epoch 1 whole at 32; epoch 2 in 5
        # batches of 32, then the rest in 16s.
        rows = tf.data.Dataset.from_tensor_slices(((x, ids), y))
        reference = _counting()
        first = reference.fit(rows.batch(32), epochs=1, verbose=0)
        resumed = rows.take(160).batch(32).concatenate(rows.skip(160).batch(16))
        second = reference.fit(resumed, epochs=2, initial_epoch=1, verbose=0)
        self.assertEqual(int(model.optimizer.iterations), 8 + 5 + 6)
        self.assertAllClose(_weights(model), _weights(reference), atol=1e-5)
        for name in ("loss", "mae"):
            self.assertAllClose(
                history.history[name],
                first.history[name] + second.history[name],
                rtol=1e-5,
            )

    def test_accumulating_model_resumes_mid_window_with_the_same_updates(
        self,
    ):
        # Windows of 2 batches of 32; the error at step 3 splits a window
        # whose first half already ran: it ends with 2 batches of 16.
        inputs, y = _table()
        model = _counting(accumulation_steps=2)
        history = tfmemsafe.fit(
            model,
            (inputs, y),
            batch_size=_BATCH,
            epochs=2,
            shuffle=False,
            callbacks=[_RaiseOutOfMemory(("train", 0, 3))],
            verbose=0,
        )
        self.assertEqual(history.oom_events[0].resumed_at_step, 3)
        self.assertEqual(model.accumulation_steps, 4)
        reference = _counting(accumulation_steps=2)
        reference.fit(
            *_table(), batch_size=_BATCH, epochs=2, shuffle=False, verbose=0
        )
        self.assertEqual(int(model.optimizer.iterations), 8)
        self.assertAllClose(_weights(model), _weights(reference), atol=1e-5)
        self.assertAllEqual(model.inner_model.seen.numpy(), np.full(_ROWS, 2.0))

    def test_validation_failure_resumes_the_validation_not_the_epoch(self):
        inputs, y = _table()
        model = _counting()
        recorder = _Recorder()
        history = tfmemsafe.fit(
            model,
            (inputs, y),
            batch_size=_BATCH,
            epochs=2,
            shuffle=False,
            validation_data=(inputs, y),
            callbacks=[_RaiseOutOfMemory(("test", 0, 3)), recorder],
            verbose=0,
        )
        [event] = history.oom_events
        self.assertEqual(
            (event.phase, event.resumed_at_step), ("validation", 3)
        )
        # Training was not replayed.
        self.assertEqual(model.forward_passes, 2 * _ROWS)
        self.assertEqual(int(model.optimizer.iterations), 16)
        self.assertEqual(history.epoch, [0, 1])
        self.assertLen(history.history["val_loss"], 2)
        self.assertLen(history.history["loss"], 2)
        self.assertIn(("epoch_end", 0), recorder.calls)
        self.assertEqual(recorder.calls.count(("epoch_begin", 0)), 1)
        # The epoch's validation covers all rows once, as evaluate does.
        reference = _counting()
        reference.set_weights(model.get_weights())
        self.assertAllClose(
            history.history["val_loss"][1],
            reference.evaluate(inputs, y, batch_size=16, verbose=0)[0],
            rtol=1e-5,
        )

    def test_unseeded_shuffle_falls_back_to_replaying_the_epoch(self):
        inputs, y = _table()
        rows = tf.data.Dataset.from_tensor_slices((inputs, y))
        model = _counting()
        with self.assertLogs(level="WARNING") as logs:
            history = tfmemsafe.fit(
                model,
                lambda size: rows.shuffle(_ROWS).batch(size),
                batch_size=_BATCH,
                epochs=2,
                callbacks=[_RaiseOutOfMemory(("train", 1, 5))],
                verbose=0,
            )
        [event] = history.oom_events
        self.assertIsNone(event.resumed_at_step)
        self.assertIn(
            "Resuming at the start of epoch 2", "\n".join(logs.output)
        )
        self.assertAllEqual(model.seen.numpy(), np.full(_ROWS, 2.0))
        self.assertEqual(int(model.optimizer.iterations), 8 + 16)


if __name__ == "__main__":
    tf.test.main()
