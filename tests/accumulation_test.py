"""Tests for tfmemsafe.accumulation.

The reference for every exactness test is plain Keras: a `keras.Model`
with the same initial weights trained at the large batch (micro-batch ×
`accumulation_steps`) on the same unshuffled samples.
"""

import contextlib
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from keras.src.models.functional import Functional

import tfmemsafe
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.accumulation import GradientAccumulator

_SAMPLES = 100  # 3 windows of 32 and a partial one of 4 samples.


def _data(samples=_SAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = rng.normal(size=(samples, 3)).astype("float32")
    return x, y


def _layers(seed=0, output_dtype=None):
    """A tiny seeded regression network, with a regularization loss."""
    keras.utils.set_random_seed(seed)
    return [
        keras.layers.Dense(8, activation="tanh", kernel_regularizer="l2"),
        keras.layers.Dense(3, dtype=output_dtype),
    ]


def _functional(cls=keras.Model, seed=0, output_dtype=None, **kwargs):
    inputs = keras.Input((6,))
    x = inputs
    for layer in _layers(seed, output_dtype):
        x = layer(x)
    return cls(inputs, x, **kwargs)


def _optimizer(name):
    if callable(name):
        return name()
    if name == "sgd_schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.9)
        return keras.optimizers.SGD(schedule, momentum=0.5)
    return keras.optimizers.get(name)


def _max_difference(model_a, model_b) -> float:
    return max(
        float(np.abs(a - b).max())
        for a, b in zip(
            model_a.get_weights(), model_b.get_weights(), strict=True
        )
    )


def _reference_and_accumulating(
    optimizer="sgd", steps=4, loss="mse", output_dtype=None, **compile_kwargs
):
    """A plain model and an `AccumulatingModel` with equal weights."""
    reference = _functional(output_dtype=output_dtype)
    reference.compile(_optimizer(optimizer), loss)
    model = _functional(
        AccumulatingModel,
        seed=1,
        output_dtype=output_dtype,
        accumulation_steps=steps,
    )
    model.compile(_optimizer(optimizer), loss, **compile_kwargs)
    model.set_weights(reference.get_weights())
    return reference, model


def _fit_both(reference, model, micro_batch=8, epochs=2, **fit_kwargs):
    x, y = _data()
    fit = dict(epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    steps = model.accumulation_steps
    expected = reference.fit(x, y, batch_size=micro_batch * steps, **fit)
    history = model.fit(x, y, batch_size=micro_batch, **fit)
    return expected.history, history.history


def _iterations(model) -> int:
    return int(tf.convert_to_tensor(model.optimizer.iterations))


class TwoNetworks(AccumulatingModel):
    """Two networks with two optimizers and two accumulators, like a GAN.

    With `accumulation_steps=1` it applies each gradient directly: the
    large-batch reference.
    """

    def __init__(self, accumulation_steps, **kwargs):
        super().__init__(**kwargs)
        self.networks = [
            keras.Sequential([keras.Input((6,)), *_layers(seed)])
            for seed in (1, 2)
        ]
        self.direct = accumulation_steps == 1
        self.first_accumulator = GradientAccumulator(
            accumulation_steps, name="first"
        )
        self.second_accumulator = GradientAccumulator(
            accumulation_steps, name="second"
        )

    def compile(self, first_optimizer, second_optimizer):
        super().compile()
        self.optimizers = [first_optimizer, second_optimizer]
        self.mse = keras.losses.MeanSquaredError()

    def call(self, x):
        return self.networks[0](x) + self.networks[1](x)

    def train_step(self, data):
        x, y = data
        accumulators = (self.first_accumulator, self.second_accumulator)
        for network, optimizer, accumulator in zip(
            self.networks, self.optimizers, accumulators, strict=True
        ):
            variables = network.trainable_weights
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(self.mse(y, network(x)))
            gradients = tape.gradient(loss, variables)
            if self.direct:
                optimizer.apply(gradients, variables)
            else:
                accumulator.accumulate(gradients, variables, tf.shape(x)[0])
                accumulator.apply_if_ready(optimizer)
        return {"loss": loss}


def _train_two_networks(steps, micro_batch, strategy=None):
    x, y = _data()
    with (strategy or tf.distribute.get_strategy()).scope():
        model = TwoNetworks(steps)
        model.compile(keras.optimizers.Adam(), keras.optimizers.SGD())
    model.fit(x, y, batch_size=micro_batch, epochs=2, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]


@keras.saving.register_keras_serializable(package="accumulation_test")
class SubclassedModel(AccumulatingModel):
    def __init__(self, accumulation_steps=1, **kwargs):
        super().__init__(accumulation_steps=accumulation_steps, **kwargs)
        self.hidden, self.out = _layers(seed=0)

    def call(self, x):
        return self.out(self.hidden(x))


@keras.saving.register_keras_serializable(package="accumulation_test")
class PlainSubclassedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = _layers(seed=0)

    def call(self, x):
        return self.out(self.hidden(x))


def _model_to_wrap(kind):
    if kind == "functional":
        return _functional()
    if kind == "sequential":
        return keras.Sequential([keras.Input((6,)), *_layers()])
    if kind == "unbuilt_sequential":
        return keras.Sequential(_layers())
    return PlainSubclassedModel()


class AccumulationTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("adam", "adam"), ("sgd_momentum_schedule", "sgd_schedule")
    )
    def test_uneven_last_window_matches_large_batch(self, optimizer):
        reference, model = _reference_and_accumulating(optimizer)
        x, y = _data(seed=1)
        expected, history = _fit_both(reference, model, validation_data=(x, y))
        self.assertLess(_max_difference(reference, model), 1e-5)
        # 3 full windows and 1 flushed partial one per epoch.
        self.assertEqual(_iterations(model), 8)
        self.assertEqual(_iterations(model), _iterations(reference))
        # Validation ran on the weights with the partial window applied.
        self.assertAllClose(
            history["val_loss"], expected["val_loss"], atol=1e-5
        )

    def test_uneven_last_micro_batch_matches_large_batch(self):
        # Micro-batches of 12: windows of 48, 48 and 4 samples, the last
        # a lone micro-batch of 4.
        reference, model = _reference_and_accumulating("adam")
        at_epoch_end = []
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda *_: at_epoch_end.append(model.get_weights())
        )
        _fit_both(reference, model, micro_batch=12, callbacks=[record])
        self.assertLess(_max_difference(reference, model), 1e-5)
        # User callbacks see the epoch's partial window applied.
        for a, b in zip(at_epoch_end[-1], model.get_weights(), strict=True):
            self.assertAllEqual(a, b)

    def test_unfreezing_layers_between_fits_matches_large_batch(self):
        reference, model = _reference_and_accumulating("adam")
        for m in (reference, model):
            m.layers[1].trainable = False
            m.compile("adam", "mse")
        _fit_both(reference, model, epochs=1)
        for m in (reference, model):
            m.layers[1].trainable = True
            m.compile("adam", "mse")
        _fit_both(reference, model, epochs=1)
        self.assertLess(_max_difference(reference, model), 1e-5)

    @parameterized.named_parameters(
        ("sum_over_batch_size", "sum_over_batch_size"),
        ("mean_with_sample_weight", "mean_with_sample_weight"),
    )
    def test_sample_weights_match_large_batch(self, reduction):
        loss = keras.losses.MeanSquaredError(reduction=reduction)
        reference, model = _reference_and_accumulating("sgd", loss=loss)
        weights = np.random.default_rng(2).uniform(0.1, 3.0, _SAMPLES)
        _fit_both(reference, model, sample_weight=weights)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_steps_per_execution_matches_large_batch(self):
        reference, model = _reference_and_accumulating(
            "adam", steps_per_execution=3
        )
        _fit_both(reference, model)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_embedding_gradients_match_large_batch(self):
        self.assertLess(_embedding_difference(), 1e-5)

    def test_accumulation_steps_one_is_plain_keras(self):
        reference, model = _reference_and_accumulating("adam", steps=1)
        expected, history = _fit_both(reference, model)
        for a, b in zip(
            reference.get_weights(), model.get_weights(), strict=True
        ):
            self.assertAllEqual(a, b)
        self.assertEqual(history, expected)

    def test_loss_and_metrics_are_reported_per_micro_batch(self):
        # With a zero learning rate the weights never change, so the
        # reported numbers must be those of plain Keras at the micro-batch.
        reference, model = _reference_and_accumulating()
        for m in (reference, model):
            m.compile(keras.optimizers.SGD(0.0), "mse", metrics=["mae"])
        x, y = _data()
        fit = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
        expected = reference.fit(x, y, **fit).history
        self.assertAllClose(model.fit(x, y, **fit).history, expected)

    def test_changing_accumulation_steps_takes_effect_in_next_fit(self):
        reference, model = _reference_and_accumulating(steps=2)
        x, y = _data(samples=96)
        fit = dict(epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=8, **fit)
        self.assertEqual(_iterations(model), 6)
        model.accumulation_steps = 4
        model.fit(x, y, batch_size=8, **fit)
        self.assertEqual(_iterations(model), 9)
        # What the OOM-safe fit does: change it and rebuild the function.
        model.accumulation_steps = 3
        model.make_train_function(force=True)
        model.fit(x, y, batch_size=8, **fit)
        self.assertEqual(_iterations(model), 13)
        for batch_size in (16, 32, 24):
            reference.fit(x, y, batch_size=batch_size, **fit)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_train_on_batch_applies_when_window_is_flushed(self):
        reference, model = _reference_and_accumulating()
        x, y = _data()
        for start in (0, 8, 16):
            model.train_on_batch(x[start : start + 8], y[start : start + 8])
        self.assertEqual(_iterations(model), 0)
        self.assertEqual(
            int(model.gradient_accumulator.pending_micro_batches), 3
        )
        self.assertTrue(model.flush_gradients())
        self.assertFalse(model.flush_gradients())
        reference.train_on_batch(x[:24], y[:24])
        self.assertEqual(_iterations(model), 1)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_interrupted_fit_leaves_no_stale_gradients(self):
        class Interrupt(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    raise KeyboardInterrupt

        reference, model = _reference_and_accumulating()
        x, y = _data()
        with self.assertRaises(KeyboardInterrupt):
            model.fit(x, y, batch_size=8, callbacks=[Interrupt()], verbose=0)
        accumulator = model.gradient_accumulator
        self.assertEqual(int(accumulator.pending_micro_batches), 2)
        with self.assertLogs(level="WARNING") as logs:
            _fit_both(reference, model)
        self.assertIn("Discarding 2 accumulated micro-batches", logs.output[0])
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_subclassed_model_matches_large_batch(self):
        reference = _functional()
        reference.compile("adam", "mse")
        model = SubclassedModel(accumulation_steps=4)
        model.compile("adam", "mse")
        model(np.zeros((1, 6)))
        model.set_weights(reference.get_weights())
        _fit_both(reference, model)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_unbuilt_subclassed_model_matches_large_batch(self):
        reference = _functional()  # The same seeded layers.
        reference.compile("adam", "mse")
        model = SubclassedModel(accumulation_steps=4)
        model.compile("adam", "mse")
        self.assertFalse(model.built)
        _fit_both(reference, model)
        self.assertLess(_max_difference(reference, model), 1e-5)

    def test_functional_construction_leaves_class_intact(self):
        bases_before = AccumulatingModel.__bases__
        model = _functional(AccumulatingModel, accumulation_steps=2)
        self.assertIsInstance(model, AccumulatingModel)
        self.assertEqual(type(model).__name__, "AccumulatingModel")
        self.assertEqual(AccumulatingModel.__bases__, bases_before)
        self.assertNotIn(Functional, AccumulatingModel.__mro__)
        # Keras would have rewritten the class, breaking subclasses.
        self.assertEqual(
            SubclassedModel(accumulation_steps=2).accumulation_steps, 2
        )

    def test_subclass_taking_two_models_is_not_built_functionally(self):
        class Pair(AccumulatingModel):
            def __init__(self, first, second, **kwargs):
                super().__init__(**kwargs)
                self.first = first
                self.second = second

            def call(self, x):
                return self.first(x) + self.second(x)

        first, second = (
            keras.Sequential([keras.Input((6,)), *_layers(seed)])
            for seed in (1, 2)
        )
        model = Pair(first, second)
        self.assertNotIsInstance(model, Functional)
        self.assertIs(model.first, first)
        self.assertIs(model.second, second)
        self.assertEqual(model.accumulation_steps, 1)
        x = np.ones((2, 6), "float32")
        self.assertAllClose(model(x), first(x) + second(x))

    def test_subclass_passing_its_arguments_on_is_built_functionally(self):
        class PassingOn(AccumulatingModel):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.extra = "kept"

        bases_before = PassingOn.__bases__
        model = _functional(PassingOn, accumulation_steps=2)
        self.assertIsInstance(model, Functional)
        self.assertIsInstance(model, PassingOn)
        self.assertEqual((model.accumulation_steps, model.extra), (2, "kept"))
        self.assertEqual(PassingOn.__bases__, bases_before)
        self.assertNotIn(Functional, AccumulatingModel.__mro__)

    def test_two_networks_with_two_optimizers_match_large_batch(self):
        expected = _train_two_networks(steps=1, micro_batch=32)
        weights = _train_two_networks(steps=4, micro_batch=8)
        for a, b in zip(expected, weights, strict=True):
            self.assertAllClose(a, b, atol=1e-5)

    def test_setting_accumulation_steps_sets_every_accumulator(self):
        model = TwoNetworks(4)
        model.accumulation_steps = 2
        self.assertEqual(model.first_accumulator.accumulation_steps, 2)
        self.assertEqual(model.second_accumulator.accumulation_steps, 2)

    @parameterized.named_parameters(
        ("functional", "functional"),
        ("sequential", "sequential"),
        ("unbuilt_sequential", "unbuilt_sequential"),
        ("subclassed", "subclassed"),
    )
    def test_with_gradient_accumulation_trains_the_shared_weights(self, kind):
        reference = _functional()
        reference.compile("adam", "mse")
        original = _model_to_wrap(kind)
        original.compile("adam", "mse", metrics=["mae"])
        model = tfmemsafe.with_gradient_accumulation(original, 4)
        self.assertIsInstance(model, AccumulatingModel)
        self.assertIs(model.optimizer, original.optimizer)
        original(np.zeros((1, 6)))
        original.set_weights(reference.get_weights())
        _, history = _fit_both(reference, model, epochs=1)
        self.assertIn("mae", history)
        for a, b in zip(
            reference.get_weights(), original.get_weights(), strict=True
        ):
            self.assertAllClose(a, b, atol=1e-5)
        self.assertEqual(
            [id(v) for v in model.weights], [id(v) for v in original.weights]
        )

    def test_with_gradient_accumulation_returns_accumulating_model(self):
        model = _functional(AccumulatingModel, accumulation_steps=2)
        self.assertIs(tfmemsafe.with_gradient_accumulation(model), model)
        self.assertEqual(model.accumulation_steps, 2)
        self.assertIs(tfmemsafe.with_gradient_accumulation(model, 8), model)
        self.assertEqual(model.accumulation_steps, 8)
        wrapped = tfmemsafe.with_gradient_accumulation(_functional())
        self.assertEqual(wrapped.accumulation_steps, 1)

    def test_with_gradient_accumulation_rejects_what_is_not_a_model(self):
        with self.assertRaisesRegex(TypeError, "`model` must be a keras"):
            tfmemsafe.with_gradient_accumulation(keras.layers.Dense(3), 2)

    def test_with_gradient_accumulation_refuses_a_step_of_its_own(self):
        class OwnStep(keras.Model):
            def train_step(self, data):
                return super().train_step(data)

        class OwnLoss(keras.Sequential):
            def compute_loss(self, *args, **kwargs):
                return 1000 * super().compute_loss(*args, **kwargs)

        inputs = keras.Input((4,))
        for model, name in (
            (OwnStep(inputs, keras.layers.Dense(2)(inputs)), "train_step"),
            (OwnLoss([keras.Input((4,)), keras.layers.Dense(2)]), "loss"),
        ):
            with self.assertRaisesRegex(
                ValueError, rf"own `\w*{name}` would not run.*Received: a"
            ):
                tfmemsafe.with_gradient_accumulation(model, 2)

    @parameterized.named_parameters(
        ("functional", lambda: _functional(AccumulatingModel)),
        (
            "wrapped",
            lambda: tfmemsafe.with_gradient_accumulation(
                _model_to_wrap("sequential"), 1
            ),
        ),
        ("subclassed", lambda: SubclassedModel()),
    )
    def test_keras_file_round_trip_restores_a_model_that_trains(self, make):
        model = make()
        model.accumulation_steps = 3  # Saved as it is now, not as built.
        model.compile("sgd", "mse")
        model(np.zeros((1, 6)))
        self.assertEqual(model.get_config()["accumulation_steps"], 3)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        self.assertIsInstance(loaded, type(model))
        self.assertEqual(loaded.accumulation_steps, 3)
        for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
            self.assertAllEqual(a, b)
        x, y = _data(samples=48)
        loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertEqual(_iterations(loaded), 2)
        self.assertGreater(_max_difference(model, loaded), 0)

    @parameterized.named_parameters(
        ("zero", 0),
        ("negative", -1),
        ("float", 2.5),
        ("string", "4"),
        ("bool", True),
        ("none", None),
    )
    def test_invalid_accumulation_steps_raise(self, value):
        message = "`accumulation_steps` must be an integer >= 1. Received"
        model = _functional(AccumulatingModel)
        with self.assertRaisesRegex(ValueError, message):
            model.accumulation_steps = value
        with self.assertRaisesRegex(ValueError, message):
            _functional(AccumulatingModel, accumulation_steps=value)
        if value is not None:  # None means "the default" there.
            with self.assertRaisesRegex(ValueError, message):
                tfmemsafe.with_gradient_accumulation(_functional(), value)
        with self.assertRaisesRegex(ValueError, message):
            GradientAccumulator(value)

    def test_numpy_integer_accumulation_steps_are_accepted(self):
        model = _functional(AccumulatingModel, accumulation_steps=np.int64(4))
        self.assertEqual(model.accumulation_steps, 4)
        self.assertIsInstance(model.accumulation_steps, int)

    def test_accumulator_used_before_accumulate_explains_itself(self):
        accumulator = GradientAccumulator(2)
        with self.assertRaisesRegex(ValueError, "is not built yet"):
            accumulator.accumulate([tf.ones(3)])
        with self.assertRaisesRegex(ValueError, "call `accumulate` before"):
            accumulator.apply_if_ready(keras.optimizers.SGD())


def _batches(sizes, seed=1):
    """Unshuffled batches of the given sizes, as a dataset."""
    x, y = _data(samples=sum(sizes), seed=seed)
    bounds = np.cumsum([0, *sizes])
    parts = [
        (x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return tf.data.Dataset.from_generator(
        lambda: iter(parts),
        output_signature=(
            tf.TensorSpec((None, 6), tf.float32),
            tf.TensorSpec((None, 3), tf.float32),
        ),
    )


class UpdateSizeTest(parameterized.TestCase, tf.test.TestCase):
    """Windows that close at a number of samples or tokens."""

    def _models(self, **kwargs):
        reference = _functional()
        reference.compile(_optimizer("adam"), "mse")
        model = _functional(AccumulatingModel, seed=1, **kwargs)
        model.compile(_optimizer("adam"), "mse")
        model.set_weights(reference.get_weights())
        return reference, model

    def test_batches_of_varying_size_make_updates_of_the_samples_asked(self):
        # Windows close at 24 samples or more: 4+12+8, 8+20, 4+16+10, and
        # the epoch's last 8+10 flushed.
        sizes = [4, 12, 8, 8, 20, 4, 16, 10, 8, 10]
        reference, model = self._models(samples_per_update=24)
        iterations = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: iterations.append(
                _iterations(model)
            )
        )
        model.fit(
            _batches(sizes),
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[record],
        )
        self.assertEqual(iterations, [0, 0, 1, 1, 2, 2, 2, 3, 3, 3])
        self.assertEqual(_iterations(model), 4)  # The last, at epoch end.
        # The same as plain Keras trained on each window as one batch.
        reference.fit(
            _batches([24, 28, 30, 18]), epochs=1, shuffle=False, verbose=0
        )
        self.assertLess(_max_difference(reference, model), 1e-5)
        self.assertEqual(model.accumulation_steps, 1)
        self.assertEqual(model.gradient_accumulator.update_size, 24)

    def test_equal_batches_match_accumulation_steps(self):
        _, by_steps = self._models(accumulation_steps=4)
        _, by_samples = self._models(samples_per_update=32)
        x, y = _data()
        for model in (by_steps, by_samples):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        self.assertEqual(_iterations(by_samples), 8)
        self.assertLess(_max_difference(by_steps, by_samples), 1e-6)

    def test_a_loss_scaled_window_closes_by_samples_too(self):
        # A `LossScaleOptimizer` checks and unscales once per window; in
        # float32 nothing overflows, so it trains as the plain optimizer.
        models = []
        for scaled in (False, True):
            model = _functional(AccumulatingModel, samples_per_update=24)
            optimizer = keras.optimizers.SGD(0.1)
            if scaled:
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            model.compile(optimizer, "mse")
            if models:
                model.set_weights(models[0].get_weights())
            models.append(model)
        for model in models:
            model.fit(
                _batches([4, 12, 8, 8, 20]),
                epochs=1,
                shuffle=False,
                verbose=0,
            )
        plain, scaled = models
        # Windows of 4 + 12 + 8 and 8 + 20 samples; none left open.
        self.assertEqual(_iterations(plain), 2)
        self.assertEqual(int(scaled.optimizer.iterations.numpy()), 2)
        self.assertEqual(scaled.skipped_windows, 0)
        self.assertLess(_max_difference(plain, scaled), 1e-5)

    def test_unknown_length_makes_the_updates_of_known_length(self):
        # Keras calls the step once more at the end of data of unknown
        # length; that call must not count as a micro-batch, which the
        # epoch's end would apply as an (Adam: weight-moving) update.
        models = []
        for _ in range(2):
            model = _functional(AccumulatingModel, samples_per_update=24)
            model.compile(_optimizer("adam"), "mse")
            if models:
                model.set_weights(models[0].get_weights())
            models.append(model)
        unknown = _batches([4, 12, 8, 8, 20])
        known = unknown.apply(tf.data.experimental.assert_cardinality(5))
        for model, data in zip(models, (known, unknown), strict=True):
            model.fit(data, epochs=2, shuffle=False, verbose=0)
        self.assertEqual([_iterations(m) for m in models], [4, 4])
        self.assertLess(_max_difference(*models), 1e-6)

    def test_tokens_per_update_counts_padded_tokens(self):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((None, 6))
        pooled = keras.layers.GlobalAveragePooling1D()(inputs)
        model = AccumulatingModel(
            inputs, keras.layers.Dense(3)(pooled), tokens_per_update=80
        )
        model.compile("sgd", "mse")
        # (samples, length): 40 + 40 tokens, then 60 + 30, then 100.
        shapes = [(4, 10), (2, 20), (3, 20), (1, 30), (10, 10)]
        rng = np.random.default_rng(0)
        parts = [
            (rng.normal(size=(b, n, 6)).astype("float32"), np.zeros((b, 3)))
            for b, n in shapes
        ]
        data = tf.data.Dataset.from_generator(
            lambda: iter(parts),
            output_signature=(
                tf.TensorSpec((None, None, 6), tf.float32),
                tf.TensorSpec((None, 3), tf.float64),
            ),
        )
        iterations = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: iterations.append(
                _iterations(model)
            )
        )
        model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[record])
        self.assertEqual(iterations, [0, 1, 1, 2, 3])
        self.assertEqual(model.tokens_per_update, 80)
        self.assertIsNone(model.samples_per_update)

    def test_tokens_per_update_needs_a_length_axis(self):
        inputs = keras.Input(())  # One number a sample: no axis 1.
        outputs = keras.layers.Dense(3)(keras.layers.Reshape((1,))(inputs))
        model = AccumulatingModel(inputs, outputs, tokens_per_update=80)
        model.compile("sgd", "mse")
        x, y = np.zeros(16, "float32"), np.zeros((16, 3), "float32")
        with self.assertRaisesRegex(
            ValueError, r"`tokens_per_update` counts a micro-batch's samples"
        ):
            model.fit(x, y, batch_size=8, verbose=0)

    def test_one_way_of_closing_a_window_is_asked_for(self):
        with self.assertRaisesRegex(
            ValueError, r"Give `samples_per_update` or `tokens_per_update`"
        ):
            _functional(
                AccumulatingModel, samples_per_update=8, tokens_per_update=80
            )
        with self.assertRaisesRegex(
            ValueError, r"or at `samples_per_update`, not both"
        ):
            _functional(
                AccumulatingModel, accumulation_steps=2, samples_per_update=8
            )
        with self.assertRaisesRegex(
            ValueError, r"`tokens_per_update` must be an integer >= 1"
        ):
            _functional(AccumulatingModel, tokens_per_update=0)
        model = _functional(AccumulatingModel, samples_per_update=8)
        with self.assertRaisesRegex(
            ValueError,
            r"windows close at `samples_per_update`, so `accumulation_steps` "
            r"stays 1\. Received: accumulation_steps=2",
        ):
            model.accumulation_steps = 2
        with self.assertRaisesRegex(
            ValueError,
            r"update size is set when it is constructed.*Received: "
            r"samples_per_update=4 for",
        ):
            tfmemsafe.with_gradient_accumulation(model, samples_per_update=4)
        with self.assertRaisesRegex(ValueError, r"`update_size` must be"):
            GradientAccumulator(1, update_size=-3)

    def test_keras_file_round_trip_keeps_the_update_size(self):
        _, model = self._models(samples_per_update=24)
        model(np.zeros((1, 6)))
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        # Compiled anew: no optimizer state to load into another optimizer.
        loaded = keras.saving.load_model(path, compile=False)
        self.assertEqual(loaded.samples_per_update, 24)
        loaded.compile("sgd", "mse")
        loaded.fit(_batches([8, 8, 8, 8]), epochs=1, shuffle=False, verbose=0)
        self.assertEqual(_iterations(loaded), 2)


def _log_keys_seen_by_a_callback_listed_before_the_monitor():
    """Child: the epoch log keys of the first callback in `callbacks`."""
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(sorted(logs))
    )
    _, model = _reference_and_accumulating()
    x, y = _data()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        callbacks=[record, tfmemsafe.MemoryMonitor(verbose=0)],
        verbose=0,
    )
    return seen


class MemoryMonitorOrderTest(tf.test.TestCase):
    def test_callbacks_listed_before_a_memory_monitor_see_its_logs(self):
        # The BFC allocator keeps memory statistics on any CPU.
        seen = tfmemsafe.testing.run_in_subprocess(
            _log_keys_seen_by_a_callback_listed_before_the_monitor,
            env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
        )
        self.assertLen(seen, 2)
        for keys in seen:
            self.assertIn("memory_peak_mb", keys)
            self.assertIn("loss", keys)


def _mixed_precision_results():
    keras.mixed_precision.set_global_policy("mixed_float16")
    results = {}
    for name, scale in (("normal", 2.0**15), ("overflow", 2.0**40)):
        reference, model = _reference_and_accumulating(
            lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(),
                initial_scale=scale,  # noqa: B023
            ),
            output_dtype="float32",
        )
        _, history = _fit_both(reference, model)
        results[name] = {
            "optimizer": type(model.optimizer).__name__,
            "difference": _max_difference(reference, model),
            "iterations": _iterations(model),
            "scale": float(model.optimizer.dynamic_scale.numpy()),
            "skipped": model.skipped_windows,
            "logged_skipped": history["skipped_windows"],
        }
    return results


class MixedPrecisionTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.results = tfmemsafe.testing.run_in_subprocess(
            _mixed_precision_results
        )

    def test_loss_scaled_windows_match_large_batch(self):
        results = self.results["normal"]
        self.assertEqual(results["optimizer"], "LossScaleOptimizer")
        self.assertLess(results["difference"], 1e-4)
        self.assertEqual(results["iterations"], 8)
        self.assertEqual(results["skipped"], 0)

    def test_overflowing_windows_are_skipped_counted_and_logged(self):
        results = self.results["overflow"]
        # Every window overflows: none is applied, each halves the scale.
        self.assertEqual(results["iterations"], 0)
        self.assertEqual(results["skipped"], 8)
        self.assertEqual(results["scale"], 2.0**40 / 2**8)
        self.assertEqual(results["logged_skipped"], [4, 8])
        # Skipped exactly as plain Keras skips the large-batch steps.
        self.assertEqual(results["difference"], 0.0)


def _embedding_difference(strategy=None) -> float:
    """How far an `AccumulatingModel` with an `Embedding` (sparse
    gradients), under `strategy` if given, ends from plain Keras at its
    update's batch (global batches of 8, four to an update)."""

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,), dtype="int32")
        x = keras.layers.Embedding(20, 4)(inputs)
        return keras.layers.Dense(1)(keras.layers.Flatten()(x)), inputs

    outputs, inputs = build()
    reference = keras.Model(inputs, outputs)
    reference.compile("sgd", "mse")
    with strategy.scope() if strategy else contextlib.nullcontext():
        outputs, inputs = build()
        model = AccumulatingModel(inputs, outputs, accumulation_steps=4)
        model.compile("sgd", "mse")
    model.set_weights(reference.get_weights())
    x = np.random.default_rng(0).integers(0, 20, (_SAMPLES, 5))
    y = np.random.default_rng(1).normal(size=(_SAMPLES, 1))
    fit = dict(epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, **fit)
    model.fit(x, y, batch_size=8, **fit)
    return _max_difference(reference, model)


def _pair_under(strategy, **kwargs):
    """A plain model, and an `AccumulatingModel` under `strategy` made
    with `kwargs`, with the same weights."""
    reference = _functional()
    reference.compile("adam", "mse")
    with strategy.scope():
        model = _functional(AccumulatingModel, **kwargs)
        model.compile("adam", "mse")
    model.set_weights(reference.get_weights())
    return reference, model


def _distributed_results():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    # One strategy for all: each has its own collective keys, and two
    # strategies' collectives can collide in the runtime.
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    reference, model = _pair_under(strategy, accumulation_steps=4)
    x, y = _data(seed=1)
    expected, history = _fit_both(reference, model, validation_data=(x, y))
    results = {
        "adam": {
            "difference": _max_difference(reference, model),
            "iterations": _iterations(model),
            "val_loss": [expected["val_loss"], history["val_loss"]],
        }
    }
    # Windows closed at 32 samples, summed over both replicas' 4 + 4.
    reference, model = _pair_under(strategy, samples_per_update=32)
    fit = dict(epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, **fit)
    model.fit(x, y, batch_size=8, **fit)
    results["samples_per_update"] = {
        "difference": _max_difference(reference, model),
        "iterations": _iterations(model),
    }
    results["embedding"] = _embedding_difference(strategy)
    results["two_networks"] = [
        _train_two_networks(steps=1, micro_batch=32),
        _train_two_networks(steps=4, micro_batch=8, strategy=strategy),
    ]

    # Mixed precision with one sample whose gradient overflows in float16
    # on the second replica only: the whole window must be skipped.
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(samples=64)
    x[5] *= 1e4
    models = []
    for scope, steps in ((tf.distribute.get_strategy(), 1), (strategy, 4)):
        with scope.scope():
            model = AccumulatingModel(*_linear(), accumulation_steps=steps)
            optimizer = keras.optimizers.SGD()
            model.compile(keras.optimizers.LossScaleOptimizer(optimizer), "mse")
        models.append(model)
    reference, model = models
    model.set_weights(reference.get_weights())
    fit = dict(epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, **fit)
    model.fit(x, y, batch_size=8, **fit)
    results["overflow_on_one_replica"] = {
        "difference": _max_difference(reference, model),
        "finite": all(np.isfinite(w).all() for w in model.get_weights()),
        "skipped": model.skipped_windows,
        "iterations": _iterations(model),
        "reference_iterations": _iterations(reference),
    }
    return results


def _linear():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    return inputs, keras.layers.Dense(3)(inputs)


class MirroredStrategyTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.results = tfmemsafe.testing.run_in_subprocess(_distributed_results)

    def test_two_replicas_match_one_device_large_batch(self):
        results = self.results["adam"]
        self.assertLess(results["difference"], 1e-5)
        self.assertEqual(results["iterations"], 8)
        expected, val_loss = results["val_loss"]
        self.assertAllClose(val_loss, expected, atol=1e-5)

    def test_windows_closed_by_samples_count_every_replicas(self):
        results = self.results["samples_per_update"]
        self.assertLess(results["difference"], 1e-5)
        self.assertEqual(results["iterations"], 8)

    def test_embedding_gradients_match_large_batch(self):
        # Each replica sums its sparse gradients as a dense tensor.
        self.assertLess(self.results["embedding"], 1e-5)

    def test_accumulators_by_hand_match_large_batch(self):
        expected, weights = self.results["two_networks"]
        for a, b in zip(expected, weights, strict=True):
            self.assertAllClose(a, b, atol=1e-5)

    def test_overflow_on_one_replica_skips_the_window(self):
        results = self.results["overflow_on_one_replica"]
        self.assertTrue(results["finite"])
        self.assertEqual(results["skipped"], 1)
        self.assertEqual(results["iterations"], 1)
        self.assertEqual(results["reference_iterations"], 1)
        self.assertLess(results["difference"], 1e-4)


if __name__ == "__main__":
    tf.test.main()
