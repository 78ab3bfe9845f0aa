"""Tests for calls without Keras' sample batch (`_sample_batch.py`): under
a strategy, a built model's data is started once a call, not twice; an
unbuilt model still builds; the scope leaves nothing behind. The crash
it avoids is recovery_test's `mirrored_strategy_with_memory_held_under_cap`.
"""

import _models
import keras
import numpy as np
import tensorflow as tf

import tfmemsafe
from tfmemsafe import _sample_batch
from tfmemsafe import testing


def pipeline_starts_under_mirrored_strategy():
    """How often each call started a generator's pipeline, in a child:
    logical devices are the process's."""
    strategy = _models.mirrored_on_two_cpus()
    starts = []

    def rows():
        starts.append(1)
        for i in range(64):
            yield np.full((4,), i, "float32"), np.float32(i % 2)

    data = tf.data.Dataset.from_generator(
        rows,
        output_signature=(
            tf.TensorSpec((4,), tf.float32),
            tf.TensorSpec((), tf.float32),
        ),
    ).batch(16)
    with strategy.scope():
        # No `Input`: the first call builds the model from a batch.
        model = keras.Sequential([keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=["mae"])
    counts = {}

    def count(name, call):
        call()
        counts[name] = len(starts)
        starts.clear()

    with _sample_batch.without_sample_batch(model):
        with _sample_batch.without_sample_batch(model):
            count("unbuilt", lambda: model.fit(data, verbose=0))
            count("built", lambda: model.fit(data, verbose=0))
        count("evaluate", lambda: model.evaluate(data, verbose=0))
    counts["left_behind"] = "_maybe_symbolic_build" in vars(model)
    count("keras_after", lambda: model.fit(data, verbose=0))
    count(
        "tfmemsafe_fit",
        lambda: tfmemsafe.fit(
            model, data, epochs=3, preflight=False, verbose=0
        ),
    )
    counts["left_behind"] |= "_maybe_symbolic_build" in vars(model)
    return counts


class SampleBatchTest(tf.test.TestCase):
    def test_a_built_model_reads_its_data_once_a_call(self):
        counts = testing.run_in_subprocess(
            pipeline_starts_under_mirrored_strategy
        )
        # Unbuilt, Keras reads a batch to build from: two starts.
        self.assertEqual(counts["unbuilt"], 2)
        self.assertEqual(counts["built"], 1)
        self.assertEqual(counts["evaluate"], 1)
        # Outside the scope, Keras reads its batch again.
        self.assertEqual(counts["keras_after"], 2)
        # One `model.fit` call an epoch, each starting the data once.
        self.assertEqual(counts["tfmemsafe_fit"], 3)
        self.assertFalse(counts["left_behind"])

    def test_a_model_that_has_its_own_method_gets_it_back(self):
        # Unbuilt (no `Input`): Keras' argument goes through.
        model = keras.Sequential([keras.layers.Dense(1)])
        seen = []

        def own(iterator=None, data_batch=None):
            seen.append(iterator)

        object.__setattr__(model, "_maybe_symbolic_build", own)
        with _sample_batch.without_sample_batch(model):
            model._maybe_symbolic_build(iterator="batches")
        self.assertEqual(seen, ["batches"])
        self.assertIs(vars(model)["_maybe_symbolic_build"], own)
