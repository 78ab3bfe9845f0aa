"""One fast check of every public capability, for the versions CI tries.

`.ci/run` runs this file (with `compat_test.py`) again on the oldest
TensorFlow and Keras that setup.cfg accepts and on keras-nightly, each in
its own virtual environment; the full suite runs on the newest releases.
Each test is the shortest real use of one capability, with an assertion
that fails when it does not work there.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tfmemsafe
from tfmemsafe import testing

_ROWS = 96


def _data(rows=_ROWS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return x, y


def _model(*layers, runs_out_above=None):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            testing.OutOfMemoryAbove(runs_out_above),
            *layers,
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _weights_after_fit(model, **kwargs):
    x, y = _data()
    model.fit(x, y, epochs=1, shuffle=False, verbose=0, **kwargs)
    return model.get_weights()


def _capped_recovery():
    """A batch of 1024 images that runs out under a 200 MB cap, in
    `model.fit` with `SplitBatchOnOOM`."""
    x, y = testing.random_images(1024, classes=4)
    model = testing.reference_model("conv_net", (32, 32, 3), metrics=None)
    split = tfmemsafe.SplitBatchOnOOM()
    # One element, the whole batch: its iterator hands it out uncopied
    # (a row by row copy's allocation is unchecked, docs/oom-recovery.md).
    batch = tf.data.Dataset.from_tensors((x, y))
    model.fit(batch, verbose=0, callbacks=[split])
    return {
        "events": len(split.oom_events),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


class SmokeTest(tf.test.TestCase):
    def test_import_says_what_it_did(self):
        self.assertIn("tfmemsafe:", str(tfmemsafe.runtime_config()))

    def test_split_batch_matches_the_whole_batch(self):
        whole = _weights_after_fit(_model(), batch_size=32)
        split = tfmemsafe.SplitBatchOnOOM()
        pieces = _weights_after_fit(
            _model(runs_out_above=8), batch_size=32, callbacks=[split]
        )
        self.assertNotEmpty(split.oom_events)
        for a, b in zip(whole, pieces, strict=True):
            self.assertAllClose(a, b, atol=1e-5)

    def test_fit_takes_model_fit_arguments(self):
        x, y = _data()
        model = _model(runs_out_above=8)
        history = tfmemsafe.fit(model, x, y, batch_size=32, epochs=2, verbose=0)
        self.assertLen(history.history["loss"], 2)
        self.assertNotEmpty(history.oom_events)

    def test_accumulation_matches_one_big_batch(self):
        whole = _weights_after_fit(_model(), batch_size=32)
        accumulating = tfmemsafe.with_gradient_accumulation(_model(), 4)
        pieces = _weights_after_fit(accumulating, batch_size=8)
        for a, b in zip(whole, pieces, strict=True):
            self.assertAllClose(a, b, atol=1e-5)

    def test_checkpointed_matches_the_plain_layer(self):
        plain = _model(keras.layers.Dense(8, activation="relu"))
        checkpointed = _model(
            tfmemsafe.Checkpointed(keras.layers.Dense(8, activation="relu"))
        )
        checkpointed.set_weights(plain.get_weights())
        for a, b in zip(
            _weights_after_fit(plain, batch_size=32),
            _weights_after_fit(checkpointed, batch_size=32),
            strict=True,
        ):
            self.assertAllClose(a, b, atol=1e-5)

    def test_monitor_logs_the_peak(self):
        x, y = _data()
        history = _model().fit(
            x,
            y,
            batch_size=32,
            verbose=0,
            callbacks=[tfmemsafe.MemoryMonitor()],
        )
        self.assertGreater(history.history["memory_peak_mb"][0], 0)

    def test_estimate_predicts_a_batch_size(self):
        x, y = _data()
        estimate = tfmemsafe.estimate_memory(_model(), (x, y))
        self.assertGreater(estimate.peak_bytes(64), estimate.peak_bytes(8))
        self.assertGreater(estimate.max_batch_size(), 64)

    def test_plan_trains_its_choice(self):
        x, y = _data()
        model = _model(keras.layers.Dense(8, activation="relu"))
        plan = tfmemsafe.plan(
            model, x, y, batch_size=32, checkpointing=True, steps=1, verbose=0
        )
        self.assertIn(
            True, {c.checkpointing for c in plan.candidates}, msg=str(plan)
        )
        self.assertIsNotNone(plan.chosen.step_seconds, msg=str(plan))
        history = tfmemsafe.fit(
            model, x, y, batch_size=32, verbose=0, plan=plan
        )
        self.assertLen(history.history["loss"], 1)

    def test_buckets_batch_variable_length_data(self):
        lengths = np.arange(4, 36, 2)
        dataset = tf.data.Dataset.from_generator(
            lambda: ((np.ones(n, "int32"), 1) for n in lengths),
            output_signature=(
                tf.TensorSpec((None,), tf.int32),
                tf.TensorSpec((), tf.int32),
            ),
        )
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((None,), dtype="int32"),
                keras.layers.Embedding(8, 4),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2),
            ]
        )
        model.compile(
            "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        batched = tfmemsafe.data.bucket_by_memory(
            dataset, model, bucket_boundaries=[16]
        )
        seen = sum(int(tf.shape(x)[0]) for x, _ in batched)
        self.assertEqual(seen, len(lengths))

    def test_frozen_mobilenet_builds(self):
        model = tfmemsafe.build_frozen_mobilenet_v2(
            input_shape=(32, 32, 3), num_classes=3, weights=None
        )
        self.assertGreater(len(model.non_trainable_weights), 0)
        self.assertEqual(model.output_shape[-1], 3)

    def test_a_real_out_of_memory_error_is_recovered(self):
        result = testing.run_with_memory_cap(_capped_recovery, 200)
        self.assertGreaterEqual(result["events"], 1)
        # The batch, split, made one update.
        self.assertEqual(result["iterations"], 1)
