"""Tests for tfmemsafe.checkpointing: Checkpointed and checkpoint_blocks."""

import os
import tempfile

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing

_BFC_ENV = {
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "CUDA_VISIBLE_DEVICES": "",
}


def _data(samples=32, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype("float32")
    y = rng.standard_normal((samples, 1)).astype("float32")
    return x, y


def _dense_block(seed, batch_norm=False, dropout=0.0, units=8):
    """Dense-tanh[-BN][-Dropout]-Dense, unbuilt, with seeded initializers."""
    layers = [
        keras.layers.Dense(
            units,
            activation="tanh",
            kernel_initializer=keras.initializers.GlorotUniform(seed),
            bias_initializer=keras.initializers.RandomNormal(seed=seed + 1),
        )
    ]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=seed + 2))
    layers.append(
        keras.layers.Dense(
            units, kernel_initializer=keras.initializers.GlorotUniform(seed + 3)
        )
    )
    return keras.Sequential(layers)


def _head():
    return keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(99)
    )


class SubclassedStack(keras.Model):
    def __init__(self, blocks, head, **kwargs):
        super().__init__(**kwargs)
        self.blocks = blocks
        self.head = head

    def call(self, inputs, training=None):
        x = inputs
        for block in self.blocks:
            x = block(x, training=training)
        return self.head(x)


def _model(kind, checkpointed, batch_norm=False, dropout=0.0, blocks=3):
    """A small block stack; the same weights whether checkpointed or not."""
    stack = [_dense_block(10 * i, batch_norm, dropout) for i in range(blocks)]
    if checkpointed == "segments":
        stack = tfmemsafe.checkpoint_blocks(stack)  # Recomputes 2 of 3.
    elif checkpointed:
        stack = [tfmemsafe.Checkpointed(block) for block in stack]
    if kind == "sequential":
        return keras.Sequential([keras.Input((8,)), *stack, _head()])
    if kind == "subclassed":
        return SubclassedStack(stack, _head())
    inputs = x = keras.Input((8,))
    for block in stack:
        x = block(x)
    return keras.Model(inputs, _head()(x))


def _compile(model, mode):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        run_eagerly=mode == "eager",
        jit_compile=mode == "jit_compile",
    )
    return model


def _values(variables):
    return [v.numpy() for v in variables]


class _StatefulRandomNoise(keras.layers.Layer):
    """Adds noise from TensorFlow's stateful RNG, which cannot be replayed."""

    def __init__(self, op="uniform", **kwargs):
        super().__init__(**kwargs)
        self.op = op

    def call(self, inputs):
        if self.op == "dropout":
            return tf.nn.dropout(inputs, 0.5)
        if self.op == "nested_function":
            return _noise_in_a_function(inputs)
        return inputs + tf.random.uniform(tf.shape(inputs))


@tf.function
def _noise_in_a_function(inputs):
    return inputs + tf.random.normal(tf.shape(inputs))


class _UnseededDropout(keras.layers.Layer):
    """Dropout through `keras.random` with no seed: the global generator."""

    def call(self, inputs, training=None):
        if training:
            return keras.random.dropout(inputs, 0.5)
        return inputs


class CheckpointedTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("eager", "eager"), ("tf_function", "graph"), ("xla", "jit_compile")
    )
    def test_gradients_equal_the_unwrapped_gradients(self, mode):
        blocks = [_dense_block(10 * i) for i in range(3)]
        plain = keras.Sequential([keras.Input((8,)), *blocks, _head()])
        wrapped = keras.Sequential(
            [
                keras.Input((8,)),
                *[tfmemsafe.Checkpointed(b) for b in blocks],
                plain.layers[-1],
            ]
        )
        x, y = _data()

        def gradients(model):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            return tape.gradient(loss, model.trainable_weights)

        if mode != "eager":
            gradients = tf.function(
                gradients, jit_compile=mode == "jit_compile"
            )
        expected = gradients(plain)
        actual = gradients(wrapped)
        self.assertLen(actual, len(plain.trainable_weights))
        for a, e in zip(actual, expected, strict=True):
            self.assertIsNotNone(a)
            self.assertAllClose(a, e, atol=1e-5, rtol=1e-5)

    @parameterized.named_parameters(
        ("functional_graph", "functional", "graph"),
        ("functional_xla", "functional", "jit_compile"),
        ("functional_segments_graph", "functional", "graph", "segments"),
        ("sequential_segments_eager", "sequential", "eager", "segments"),
        ("sequential_eager", "sequential", "eager"),
        ("sequential_graph", "sequential", "graph"),
        ("subclassed_graph", "subclassed", "graph"),
        ("subclassed_eager", "subclassed", "eager"),
    )
    def test_fit_with_batch_norm_and_dropout_matches_unwrapped_fit(
        self, kind, mode, wrapping=True
    ):
        x, y = _data()
        models = []
        for checkpointed in (False, wrapping):
            keras.utils.set_random_seed(1)
            model = _model(kind, checkpointed, batch_norm=True, dropout=0.3)
            models.append(_compile(model, mode))
            model(x[:2])  # Builds the subclassed model.
        plain, wrapped = models
        initial = _values(wrapped.weights)
        for model in models:
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        # Every weight of the wrapped layers trained, and moving statistics
        # moved, exactly as without checkpointing (a second update of the
        # moving statistics or a different dropout mask would show here).
        self.assertLen(wrapped.trainable_weights, len(plain.trainable_weights))
        for before, after in zip(
            initial, _values(wrapped.weights), strict=True
        ):
            self.assertNotAllClose(before, after)
        self.assertAllClose(
            _values(wrapped.weights), _values(plain.weights), atol=1e-5
        )

    @parameterized.named_parameters(("eager", True), ("graph", False))
    def test_batch_norm_moving_statistics_update_once_per_step(self, eager):
        batch_norm = keras.layers.BatchNormalization(momentum=0.5)
        block = keras.Sequential([batch_norm, keras.layers.Dense(4)])
        inputs = keras.Input((4,))
        model = keras.Model(inputs, tfmemsafe.Checkpointed(block)(inputs))
        model.compile("sgd", "mse", run_eagerly=eager)
        x = np.arange(32, dtype="float32").reshape(8, 4)
        model.train_on_batch(x, np.zeros((8, 4), "float32"))
        # One update from (0, 1): 0.5 * 0 + 0.5 * batch statistic.
        self.assertAllClose(batch_norm.moving_mean, 0.5 * x.mean(axis=0))
        self.assertAllClose(
            batch_norm.moving_variance, 0.5 + 0.5 * x.var(axis=0)
        )

    @parameterized.named_parameters(
        ("keras_dropout_eager", "dropout", False),
        ("keras_dropout_tf_function", "dropout", True),
        ("unseeded_keras_random_eager", "unseeded", False),
        ("unseeded_keras_random_tf_function", "unseeded", True),
    )
    def test_recomputation_reuses_the_dropout_mask(self, layer, traced):
        dropout = (
            keras.layers.Dropout(0.5)
            if layer == "dropout"
            else _UnseededDropout()
        )
        block = tfmemsafe.Checkpointed(
            keras.Sequential([keras.layers.Identity(), dropout])
        )
        x = tf.ones((64, 32))

        def outputs_and_gradient():
            with tf.GradientTape() as tape:
                tape.watch(x)
                outputs = block(x, training=True)
            return outputs, tape.gradient(outputs, x)

        if traced:
            outputs_and_gradient = tf.function(outputs_and_gradient)
        masks = []
        for _ in range(2):
            outputs, gradient = outputs_and_gradient()
            # d(dropout(x))/dx is the mask the outputs were drawn with.
            self.assertAllClose(gradient, outputs)
            self.assertBetween(float(tf.reduce_mean(outputs)), 0.7, 1.3)
            masks.append(outputs)
        self.assertNotAllClose(masks[0], masks[1])  # Seeds still advance.

    @parameterized.named_parameters(
        (
            "augmentation",
            lambda: [
                keras.layers.RandomFlip(seed=1),
                keras.layers.RandomRotation(0.1, seed=2),
                keras.layers.RandomZoom(0.1, seed=3),
            ],
        ),
        (
            "noise",
            lambda: [
                keras.layers.GaussianNoise(0.1),
                keras.layers.GaussianDropout(0.2),
                keras.layers.AlphaDropout(0.2),
                keras.layers.SpatialDropout2D(0.2),
            ],
        ),
    )
    def test_keras_random_layers_get_the_gradient_of_their_forward_pass(
        self, make_layers
    ):
        block = keras.Sequential(
            [keras.layers.Conv2D(3, 3, padding="same"), *make_layers()]
        )
        wrapper = tfmemsafe.Checkpointed(block)
        x = tf.random.normal((4, 8, 8, 3))
        wrapper.build(x.shape)
        seeds = [v for v in block.non_trainable_variables]
        initial_seeds = _values(seeds)

        @tf.function
        def outputs_and_gradients(layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                outputs = layer(x, training=True)
                loss = tf.reduce_sum(outputs**2)
            return outputs, tape.gradient(loss, [x, *block.trainable_weights])

        actual = outputs_and_gradients(wrapper)
        for seed, value in zip(seeds, initial_seeds, strict=True):
            seed.assign(value)
        expected = outputs_and_gradients(block)  # Same random numbers.
        self.assertAllClose(actual, expected, atol=1e-5)

    @parameterized.named_parameters(
        ("uniform_eager", "uniform", True),
        ("uniform_fit", "uniform", False),
        ("tf_nn_dropout_fit", "dropout", False),
        ("inside_a_tf_function_fit", "nested_function", False),
    )
    def test_stateful_random_ops_are_refused(self, op, eager):
        block = keras.Sequential(
            [
                keras.layers.Dense(8),
                _StatefulRandomNoise(op),
                keras.layers.Dense(1),
            ]
        )
        inputs = keras.Input((8,))
        model = keras.Model(inputs, tfmemsafe.Checkpointed(block)(inputs))
        model.compile("sgd", "mse", run_eagerly=eager)
        x, y = _data()
        with self.assertRaisesRegex(
            ValueError, "`Checkpointed` cannot wrap layer .* stateful random"
        ):
            model.fit(x, y, epochs=1, verbose=0)

    def test_stateful_random_ops_are_allowed_without_recomputation(self):
        block = keras.Sequential(
            [_StatefulRandomNoise(), keras.layers.Dense(1)]
        )
        inputs = keras.Input((8,))
        wrapper = tfmemsafe.Checkpointed(block, recompute=False)
        model = keras.Model(inputs, wrapper(inputs))
        model.compile("sgd", "mse")
        x, y = _data()
        history = model.fit(x, y, epochs=1, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][0]))

    def test_outer_model_tracks_the_wrapped_weights(self):
        block = _dense_block(0, batch_norm=True)
        wrapper = tfmemsafe.Checkpointed(block)
        inputs = keras.Input((8,))
        model = keras.Model(inputs, _head()(wrapper(inputs)))
        tracked = {id(v) for v in model.trainable_weights}
        self.assertTrue({id(v) for v in block.trainable_weights} <= tracked)
        self.assertLen(
            model.trainable_weights, len(block.trainable_weights) + 2
        )
        self.assertLen(model.non_trainable_weights, 2)  # Moving statistics.
        self.assertEqual(wrapper.dtype_policy.name, block.dtype_policy.name)

    def test_losses_added_inside_are_kept_and_differentiated(self):
        def model(checkpointed):
            keras.utils.set_random_seed(2)
            block = keras.Sequential(
                [
                    keras.layers.Dense(
                        8,
                        activity_regularizer=keras.regularizers.L2(0.1),
                        kernel_initializer=keras.initializers.GlorotUniform(3),
                    )
                ]
            )
            if checkpointed:
                block = tfmemsafe.Checkpointed(block)
            inputs = keras.Input((8,))
            return _compile(
                keras.Model(inputs, _head()(block(inputs))), "graph"
            )

        x, y = _data()
        plain, wrapped = model(False), model(True)
        wrapped(x)
        self.assertLen(wrapped.losses, 1)
        self.assertAllClose(wrapped.losses[0], (plain(x), plain.losses[0])[1])
        for m in (plain, wrapped):
            m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        self.assertAllClose(
            _values(wrapped.weights), _values(plain.weights), atol=1e-5
        )

    @parameterized.named_parameters(("eager", False), ("tf_function", True))
    def test_nested_outputs_and_nested_integer_inputs(self, traced):
        floats = keras.Input((4,))
        ids = keras.Input((3,), dtype="int32")
        embedded = keras.layers.Flatten()(keras.layers.Embedding(10, 2)(ids))
        merged = keras.layers.Concatenate()([floats, embedded])
        block = keras.Model(
            [floats, ids],
            {"dense": keras.layers.Dense(2)(merged), "raw": merged},
        )
        wrapper = tfmemsafe.Checkpointed(block)
        x = [tf.random.normal((5, 4)), tf.constant([[1, 2, 3]] * 5)]

        def outputs_and_gradients(layer):
            with tf.GradientTape() as tape:
                tape.watch(x[0])
                outputs = layer(x)
            sources = [x[0], *block.trainable_weights]
            gradients = tape.gradient(outputs, sources)
            return outputs, [tf.convert_to_tensor(g) for g in gradients]

        if traced:
            outputs_and_gradients = tf.function(outputs_and_gradients)
        self.assertAllClose(
            outputs_and_gradients(wrapper), outputs_and_gradients(block)
        )

    def test_stateless_call_matches_the_wrapped_layer(self):
        block = _dense_block(0, batch_norm=True)
        wrapper = tfmemsafe.Checkpointed(block)
        x, _ = _data()
        wrapper.build(x.shape)

        def stateless_call(layer):
            return layer.stateless_call(
                [v.value for v in layer.trainable_variables],
                [v.value for v in layer.non_trainable_variables],
                x,
                training=True,
            )

        outputs, updated = stateless_call(wrapper)
        expected_outputs, expected_updated = stateless_call(block)
        self.assertAllClose(outputs, expected_outputs)
        self.assertAllClose(updated, expected_updated)

    def test_save_and_load_round_trip(self):
        keras.utils.set_random_seed(3)
        model = _model("functional", True, batch_norm=True, dropout=0.2)
        _compile(model, "graph")
        x, y = _data()
        model.fit(x, y, epochs=1, verbose=0)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        wrapper = loaded.layers[1]
        self.assertIsInstance(wrapper, tfmemsafe.Checkpointed)
        self.assertIsInstance(wrapper.layer, keras.Sequential)
        self.assertEqual(
            [type(layer) for layer in wrapper.layer.layers],
            [type(layer) for layer in model.layers[1].layer.layers],
        )
        self.assertAllClose(
            loaded.predict(x, verbose=0), model.predict(x, verbose=0)
        )
        loaded.fit(x, y, epochs=1, verbose=0)  # Still trains.
        config = model.layers[1].get_config()
        clone = tfmemsafe.Checkpointed.from_config(config)
        self.assertIn("layer", config)  # from_config leaves it intact.
        self.assertEqual(clone.get_config(), config)

    def test_rejects_bad_arguments(self):
        with self.assertRaisesRegex(
            TypeError, "`layer` must be a `keras.layers.Layer`"
        ):
            tfmemsafe.Checkpointed(lambda x: x)
        with self.assertRaisesRegex(ValueError, "`recompute` must be True"):
            tfmemsafe.Checkpointed(keras.layers.Dense(2), recompute=1)


class CheckpointBlocksTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("default_sqrt", 12, None, False, [4, 4, 4], [True, True, False]),
        ("uneven", 10, 4, False, [3, 3, 2, 2], [True, True, True, False]),
        ("checkpoint_last", 4, None, True, [2, 2], [True, True]),
        ("one_segment", 3, 1, False, [3], [False]),
        ("single_blocks", 3, 3, False, [1, 1, 1], [True, True, False]),
    )
    def test_groups_blocks_into_segments(
        self, num_blocks, segments, checkpoint_last, sizes, recomputed
    ):
        blocks = [keras.layers.Dense(4) for _ in range(num_blocks)]
        layers = tfmemsafe.checkpoint_blocks(
            blocks, segments=segments, checkpoint_last=checkpoint_last
        )
        self.assertTrue(
            all(isinstance(x, tfmemsafe.Checkpointed) for x in layers)
        )
        self.assertEqual([x.recompute for x in layers], recomputed)
        grouped = [
            x.layer.layers
            if isinstance(x.layer, keras.Sequential)
            else [x.layer]
            for x in layers
        ]
        self.assertEqual([len(group) for group in grouped], sizes)
        self.assertEqual(sum(grouped, []), blocks)
        x = tf.random.normal((2, 4))
        expected = x
        for block in blocks:
            expected = block(expected)
        self.assertAllClose(keras.Sequential(layers)(x), expected)

    @parameterized.named_parameters(
        ("empty", [], None, "`blocks` must be a non-empty sequence"),
        ("not_layers", ["dense"], None, "`blocks` must be a non-empty"),
        ("a_number", 7, None, r"`blocks` must be a non-empty.*blocks=7$"),
        ("zero_segments", None, 0, r"`segments` must be an integer between"),
        ("too_many_segments", None, 4, r"between 1 and len\(blocks\)=3"),
        ("bool_segments", None, True, "Received: segments=True"),
        ("checkpoint_last", None, "yes", "`checkpoint_last` must be True"),
    )
    def test_rejects_bad_arguments(self, blocks, segments, message):
        if blocks is None:
            blocks = [keras.layers.Dense(2) for _ in range(3)]
        kwargs = {"segments": segments}
        if segments == "yes":
            kwargs = {"checkpoint_last": segments}
        with self.assertRaisesRegex(ValueError, message):
            tfmemsafe.checkpoint_blocks(blocks, **kwargs)


def _residual_block(channels, name):
    inputs = keras.Input((None, None, channels))
    x = keras.layers.Conv2D(channels, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(channels, 3, padding="same")(x)
    x = keras.layers.ReLU()(keras.layers.Add()([inputs, x]))
    return keras.Model(inputs, x, name=name)


def peak_memory_of_one_training_step(variants, num_blocks=9, channels=16):
    """Child: the allocator peak (MB) of one fit step per variant."""
    import tfmemsafe

    # One op at a time: the peak then does not depend on thread timing.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x = np.random.default_rng(0).standard_normal((32, 32, 32, channels))
    x = x.astype("float32")
    peaks = {}
    for variant in variants:
        blocks = [
            _residual_block(channels, f"{variant}_{i}")
            for i in range(num_blocks)
        ]
        if variant == "per_block":
            blocks = [tfmemsafe.Checkpointed(b) for b in blocks]
        elif variant == "segments":
            blocks = tfmemsafe.checkpoint_blocks(blocks)
        model = keras.Sequential(
            [keras.Input(x.shape[1:]), *blocks, keras.layers.Conv2D(1, 1)]
        )
        model.compile("sgd", "mse")
        model.fit(x, x[..., :1], batch_size=32, verbose=0)  # Traces.
        tfmemsafe.reset_peak_memory("CPU:0")
        before = tfmemsafe.memory_info("CPU:0").current_mb
        model.fit(x, x[..., :1], batch_size=32, verbose=0)
        peaks[variant] = tfmemsafe.memory_info("CPU:0").peak_mb - before
    return peaks


def train_under_mixed_precision():
    """Child: mixed_float16 fit with and without checkpointing."""
    keras.config.set_dtype_policy("mixed_float16")
    x, y = _data()
    models = []
    for checkpointed in (False, True):
        keras.utils.set_random_seed(4)
        model = _model("functional", checkpointed, batch_norm=True)
        models.append(_compile(model, "graph"))
    plain, wrapped = models
    initial = _values(wrapped.trainable_weights)
    for model in models:
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    wrapper = wrapped.layers[1]
    return {
        "wrapper_policy": wrapper.dtype_policy.name,
        "output_dtype": str(wrapper(x).dtype),
        "optimizer": type(wrapped.optimizer).__name__,
        "weight_dtypes": sorted({v.dtype for v in wrapped.weights}),
        "all_trained": all(
            not np.allclose(a, b)
            for a, b in zip(
                initial, _values(wrapped.trainable_weights), strict=True
            )
        ),
        "max_difference": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                _values(wrapped.weights), _values(plain.weights), strict=True
            )
        ),
    }


def train_under_mirrored_strategy():
    """Child: two replicas, with and without checkpointing."""
    strategy = _models.mirrored_on_two_cpus()
    x, y = _data(64)
    models = []
    for checkpointed in (False, True):
        keras.utils.set_random_seed(6)
        with strategy.scope():
            model = _model("functional", checkpointed, True, dropout=0.3)
            models.append(_compile(model, "graph"))
    plain, wrapped = models
    initial = _values(wrapped.weights)
    for model in models:
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return {
        "all_trained": all(
            not np.allclose(a, b)
            for a, b in zip(initial, _values(wrapped.weights), strict=True)
        ),
        "max_difference": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                _values(wrapped.weights), _values(plain.weights), strict=True
            )
        ),
    }


def seeds_after_building(checkpointed: bool) -> dict:
    """The default seed of a layer made after a block was built, plain or
    `Checkpointed`, and Keras' global seed generator's seed."""
    import random

    from tfmemsafe import _compat

    keras.utils.set_random_seed(3)
    block = keras.layers.Dense(2)
    if checkpointed:
        block = tfmemsafe.Checkpointed(block)
    block(keras.Input((4,)))
    _, generator = _compat.global_seed_generator()
    return {
        "next": random.random(),
        "global": None if generator is None else int(generator.state[0]),
    }


class CheckpointingInProcessesTest(parameterized.TestCase, tf.test.TestCase):
    def test_building_draws_no_seed_from_later_layers(self):
        plain = testing.run_in_subprocess(seeds_after_building, args=[False])
        wrapped = [
            testing.run_in_subprocess(seeds_after_building, args=[True])
            for _ in range(2)
        ]
        self.assertEqual(wrapped[0]["next"], plain["next"])
        # And the generator it makes has the same seed in every process.
        self.assertIsNotNone(wrapped[0]["global"])
        self.assertEqual(wrapped[0]["global"], wrapped[1]["global"])

    def test_checkpointing_lowers_the_allocator_peak(self):
        peaks = testing.run_in_subprocess(
            peak_memory_of_one_training_step,
            args=[["none", "per_block", "segments"]],
            env=_BFC_ENV,
        )
        self.assertLess(peaks["per_block"], 0.6 * peaks["none"])
        self.assertLess(peaks["segments"], 0.7 * peaks["none"])

    def test_mirrored_strategy_training_matches_unwrapped(self):
        result = testing.run_in_subprocess(train_under_mirrored_strategy)
        self.assertTrue(result["all_trained"])
        self.assertLess(result["max_difference"], 1e-5)

    def test_mixed_precision_training_matches_unwrapped(self):
        result = testing.run_in_subprocess(train_under_mixed_precision)
        self.assertEqual(result["wrapper_policy"], "mixed_float16")
        self.assertEqual(result["output_dtype"], "<dtype: 'float16'>")
        self.assertEqual(result["optimizer"], "LossScaleOptimizer")
        self.assertEqual(result["weight_dtypes"], ["float32"])
        self.assertTrue(result["all_trained"])
        self.assertLess(result["max_difference"], 1e-3)


class AccumulationTest(tf.test.TestCase):
    def test_accumulating_model_with_checkpointed_blocks_matches_unwrapped(
        self,
    ):
        x, y = _data()
        models = []
        for checkpointed in (False, True):
            keras.utils.set_random_seed(5)
            inputs = x_ = keras.Input((8,))
            for i in range(2):
                block = _dense_block(10 * i, batch_norm=True)
                if checkpointed:
                    block = tfmemsafe.Checkpointed(block)
                x_ = block(x_)
            model = tfmemsafe.AccumulatingModel(
                inputs, _head()(x_), accumulation_steps=2
            )
            models.append(_compile(model, "graph"))
        plain, wrapped = models
        initial = _values(wrapped.trainable_weights)
        for model in models:
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(wrapped.optimizer.iterations), 4)
        for before, after in zip(
            initial, _values(wrapped.trainable_weights), strict=True
        ):
            self.assertNotAllClose(before, after)
        self.assertAllClose(
            _values(wrapped.weights), _values(plain.weights), atol=1e-5
        )


if __name__ == "__main__":
    tf.test.main()
