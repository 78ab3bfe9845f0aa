"""Tests for tfmemsafe.transfer: frozen MobileNetV2, unfreeze, cached features.

ImageNet weights cannot be downloaded here. A MobileNetV2 with random
weights and untouched BatchNormalization statistics computes features of
about 1e-12, which would make every comparison trivially true, so the
tests use "pretrained" weights made once per run: random filters whose
BatchNormalization statistics are calibrated on random images.
"""

import functools
import os
import socket
import tempfile
import urllib.error
from unittest import mock

import h5py
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from keras.src.legacy.saving import legacy_h5_format
from keras.src.utils import file_utils

import tfmemsafe
from tfmemsafe import testing

_SIZE = 32
_ALPHA = 0.35
_CLASSES = 3


def _images(count, size=_SIZE, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def _labels(count, seed=0):
    return np.random.default_rng(seed).integers(0, _CLASSES, count)


def _calibrated_backbone(seed=0):
    """A random MobileNetV2 whose BN statistics match its activations."""
    keras.utils.set_random_seed(seed)
    backbone = keras.applications.MobileNetV2(
        input_shape=(_SIZE, _SIZE, 3),
        alpha=_ALPHA,
        include_top=False,
        weights=None,
    )
    batchnorms = [
        layer
        for layer in backbone.layers
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    for layer in batchnorms:
        layer.momentum = 0.0  # The moving statistics become this batch's.
    backbone(_images(64, seed=seed) / 127.5 - 1.0, training=True)
    for layer in batchnorms:
        layer.momentum = 0.999
    return backbone


@functools.cache
def _weights_directory():
    # Kept alive by the cache; removed when the interpreter exits.
    return tempfile.TemporaryDirectory(prefix="backbones_test-")


@functools.cache
def _weights_file():
    """A backbone weights file, written once per test run."""
    path = os.path.join(_weights_directory().name, "backbone.weights.h5")
    _calibrated_backbone().save_weights(path)
    return path


def _build(**kwargs):
    kwargs = {
        "input_shape": (_SIZE, _SIZE, 3),
        "num_classes": _CLASSES,
        "weights": _weights_file(),
        "alpha": _ALPHA,
        **kwargs,
    }
    return tfmemsafe.build_frozen_mobilenet_v2(**kwargs)


@functools.cache
def _untouched_model():
    """A model shared by tests that never compile, train or unfreeze it."""
    return _build()


def _backbone(model):
    return model.get_layer("backbone").layer


def _values(variables):
    return {v.path: v.numpy() for v in variables}


def _compile(model, learning_rate=0.05):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def train_under_mixed_float16():
    """Builds, trains and caches under mixed_float16 (in a fresh process)."""
    tfmemsafe.configure(precision="mixed_float16")
    model = _build(head_units=(8,))
    _compile(model)
    x, y = _images(4), _labels(4)
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    features = tfmemsafe.cache_features(model, x, y, verbose=0)
    head_history = tfmemsafe.fit_head(model, features, verbose=0)
    return {
        "policy": keras.config.dtype_policy().name,
        "backbone_compute_dtype": _backbone(model).compute_dtype,
        "output_dtype": model.output.dtype,
        "prediction_dtype": str(model.predict(x, verbose=0).dtype),
        "optimizer": type(model.optimizer).__name__,
        "loss": history.history["loss"][0],
        "features_dtype": features.element_spec[0].dtype.name,
        "head_loss": head_history.history["loss"][0],
    }


class BuildTest(parameterized.TestCase, tf.test.TestCase):
    def test_fit_trains_only_the_head_and_keeps_backbone_and_bn_statistics(
        self,
    ):
        model = _build(head_units=(8,))
        backbone = _backbone(model)
        head_paths = {
            v.path
            for name in ("head_1", "predictions")
            for v in model.get_layer(name).weights
        }
        self.assertEqual({v.path for v in model.trainable_weights}, head_paths)
        moving_statistics = [
            v.path for v in backbone.non_trainable_weights if "moving" in v.path
        ]
        self.assertLen(moving_statistics, 2 * 52)  # MobileNetV2 has 52 BNs.
        backbone_before = _values(backbone.weights)
        head_before = _values(model.trainable_weights)

        _compile(model)
        model.fit(_images(32), _labels(32), batch_size=8, epochs=2, verbose=0)

        for path, value in _values(backbone.weights).items():
            self.assertAllEqual(value, backbone_before[path], msg=path)
        for path, value in _values(model.trainable_weights).items():
            self.assertNotAllClose(value, head_before[path], msg=path)

    def test_output_is_float32_under_mixed_float16(self):
        result = testing.run_in_subprocess(
            train_under_mixed_float16, timeout=180
        )
        self.assertEqual(result["policy"], "mixed_float16")
        self.assertEqual(result["backbone_compute_dtype"], "float16")
        self.assertEqual(result["output_dtype"], "float32")
        self.assertEqual(result["prediction_dtype"], "float32")
        self.assertEqual(result["optimizer"], "LossScaleOptimizer")
        self.assertTrue(np.isfinite(result["loss"]))
        self.assertEqual(result["features_dtype"], "float16")
        self.assertTrue(np.isfinite(result["head_loss"]))

    def test_keras_round_trip_gives_same_predictions(self):
        model = _build(
            input_shape=(20, 24, 3),
            resize_to=_SIZE,
            augmentation=[keras.layers.RandomFlip("horizontal", seed=1)],
            head_units=(8, 4),
        )
        x = _images(6, size=24)[:, :20]
        expected = model.predict(x, verbose=0)
        path = os.path.join(self.get_temp_dir(), "model.keras")
        model.save(path)

        restored = keras.saving.load_model(path)

        self.assertAllClose(restored.predict(x, verbose=0), expected)
        self.assertFalse(_backbone(restored).trainable)
        self.assertEqual(
            restored.get_layer("resize").output.shape[1:3], (32, 32)
        )

    @parameterized.named_parameters(
        ("tensor_shape", "tensor_shape"),
        ("list", "list"),
    )
    def test_input_shape_may_be_a_dataset_shape_or_a_list(self, kind):
        images = tf.data.Dataset.from_tensor_slices(
            (_images(2, size=40)[:, :, :36], _labels(2))
        )
        shape = images.element_spec[0].shape
        input_shape = shape if kind == "tensor_shape" else list(shape)
        model = _build(input_shape=input_shape)
        self.assertEqual(model.input_shape, (None, 40, 36, 3))

    def test_accumulation_steps_give_an_accumulating_model(self):
        model = _build(accumulation_steps=2, dropout=0.0)
        self.assertIsInstance(model, tfmemsafe.AccumulatingModel)
        self.assertEqual(model.accumulation_steps, 2)
        backbone_before = _values(_backbone(model).weights)
        _compile(model)
        x = _images(16)
        model.fit(x, _labels(16), batch_size=4, verbose=0)

        # 4 micro-batches of 4 make 2 updates of 8.
        self.assertEqual(int(model.optimizer.iterations), 2)
        for path, value in _values(_backbone(model).weights).items():
            self.assertAllEqual(value, backbone_before[path], msg=path)
        path = os.path.join(self.get_temp_dir(), "accumulating.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        self.assertIsInstance(restored, tfmemsafe.AccumulatingModel)
        self.assertEqual(restored.accumulation_steps, 2)
        self.assertAllClose(
            restored.predict(x, verbose=0), model.predict(x, verbose=0)
        )

    @parameterized.named_parameters(
        ("keras_weights_file", "backbone.weights.h5"),
        ("legacy_h5_like_the_imagenet_download", "backbone_no_top.h5"),
    )
    def test_weights_path_loads_the_saved_backbone(self, filename):
        source = _calibrated_backbone(seed=7)
        path = os.path.join(self.get_temp_dir(), filename)
        if filename.endswith(".weights.h5"):
            source.save_weights(path)
        else:
            with h5py.File(path, "w") as f:
                legacy_h5_format.save_weights_to_hdf5_group(f, source)

        model = _build(weights=path)

        loaded = _backbone(model).get_weights()
        self.assertLen(loaded, len(source.weights))
        for value, expected in zip(loaded, source.get_weights(), strict=True):
            self.assertAllEqual(value, expected)

    @parameterized.named_parameters(
        ("native_size", {"resize_to": 96}, "0.35_96_no_top.h5"),
        ("small_images_fall_back_to_224", {}, "0.35_224_no_top.h5"),
    )
    def test_imagenet_weights_come_from_the_keras_download(
        self, kwargs, expected_file
    ):
        with mock.patch.object(
            keras.utils, "get_file", return_value=_weights_file()
        ) as get_file:
            model = _build(weights="imagenet", **kwargs)

        (filename, url), options = get_file.call_args
        self.assertEqual(
            filename,
            "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_" + expected_file,
        )
        self.assertTrue(url.endswith("/mobilenet_v2/" + filename), url)
        self.assertEqual(options, {"cache_subdir": "models"})
        backbone = _backbone(model)
        expected = _calibrated_backbone().get_weights()
        for value, want in zip(backbone.get_weights(), expected, strict=True):
            self.assertAllEqual(value, want)

    def test_offline_imagenet_weights_raise_a_clear_chained_error(self):
        # Keras' real download code, with an empty cache and no network.
        real_get_file = keras.utils.get_file
        cache_dir = self.get_temp_dir()

        def get_file_with_empty_cache(*args, **kwargs):
            return real_get_file(*args, cache_dir=cache_dir, **kwargs)

        no_network = urllib.error.URLError(
            socket.gaierror(-3, "Temporary failure in name resolution")
        )
        with (
            mock.patch.object(
                keras.utils, "get_file", get_file_with_empty_cache
            ),
            mock.patch.object(
                file_utils, "urlretrieve", side_effect=no_network
            ),
            self.assertRaisesRegex(
                RuntimeError,
                r"^Could not download the ImageNet weights for MobileNetV2 "
                r"\(alpha=0.35, 96 px\)",
            ) as raised,
        ):
            _build(weights="imagenet", resize_to=96)

        message = str(raised.exception)
        self.assertIn("`weights=None`", message)
        self.assertIn(
            "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_0.35_96_no_top.h5'",
            message,
        )
        self.assertIn("Temporary failure in name resolution", message)
        self.assertIn("URL fetch failure", str(raised.exception.__cause__))

    @parameterized.named_parameters(
        (
            "too_small",
            {"input_shape": (16, 16, 3)},
            "`input_shape` must be at least 32x32",
        ),
        (
            "grayscale",
            {"input_shape": (32, 32, 1)},
            "`input_shape` must have 3 channels",
        ),
        (
            "two_dimensions",
            {"input_shape": (32, 32)},
            "`input_shape` must be 3 positive",
        ),
        (
            "unknown_dimension",
            {"input_shape": tf.TensorShape([None, 32, 3])},
            "`input_shape` must be 3 positive",
        ),
        (
            "unknown_rank",
            {"input_shape": tf.TensorShape(None)},
            "`input_shape` must be 3 positive",
        ),
        (
            "one_class",
            {"num_classes": 1},
            "`num_classes` must be an integer >= 2",
        ),
        ("unknown_alpha", {"alpha": 0.4}, "`alpha` must be one of 0.35, 0.5"),
        (
            "tiny_resize",
            {"resize_to": 16},
            "`resize_to` must be an integer >= 32",
        ),
        (
            "zero_head_units",
            {"head_units": (0,)},
            "`head_units` must be a positive",
        ),
        (
            "dropout_one",
            {"dropout": 1.0},
            r"`dropout` must be a float in \[0, 1\)",
        ),
        (
            "zero_accumulation",
            {"accumulation_steps": 0},
            "`accumulation_steps` must be an integer >= 1. "
            "Received: accumulation_steps=0",
        ),
        (
            "missing_weights_file",
            {"weights": "/nonexistent.h5"},
            "`weights` must be 'imagenet', None or the path",
        ),
        (
            "augmentation_not_a_layer",
            {"augmentation": "flip"},
            "`augmentation` must be a Keras layer",
        ),
    )
    def test_bad_argument_raises_value_error_naming_it(self, kwargs, message):
        with self.assertRaisesRegex(ValueError, "^" + message):
            _build(**kwargs)


class InferenceModeTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        # Keras 3 overrides the recorded training=False during fit
        # (keras-team/keras#20285): the reason InferenceMode exists.
        ("plain_keras_call", False, False),
        ("inference_mode", True, True),
    )
    def test_trainable_batchnorm_keeps_statistics_only_in_inference_mode(
        self, wrap, statistics_kept
    ):
        keras.utils.set_random_seed(0)
        block = keras.Sequential(
            [keras.Input((4,)), keras.layers.BatchNormalization()]
        )
        inputs = keras.Input((4,))
        if wrap:
            x = tfmemsafe.InferenceMode(block)(inputs)
        else:
            x = block(inputs, training=False)
        model = keras.Model(inputs, keras.layers.Dense(1)(x))
        model.compile(keras.optimizers.SGD(0.1), "mse")
        batchnorm = block.layers[0]
        x = np.random.default_rng(0).normal(3.0, 2.0, (32, 4))

        model.fit(x, x[:, :1], batch_size=8, verbose=0)

        self.assertEqual(
            np.all(batchnorm.moving_mean.numpy() == 0.0), statistics_kept
        )
        self.assertNotAllClose(batchnorm.gamma.numpy(), np.ones(4))

    def test_keras_round_trip_keeps_the_wrapped_layer(self):
        inputs = keras.Input((4,))
        layer = tfmemsafe.InferenceMode(keras.layers.Dense(2), name="wrapped")
        model = keras.Model(inputs, layer(inputs))
        path = os.path.join(self.get_temp_dir(), "wrapped.keras")
        model.save(path)

        restored = keras.saving.load_model(path).get_layer("wrapped")

        self.assertIsInstance(restored, tfmemsafe.InferenceMode)
        self.assertIsInstance(restored.layer, keras.layers.Dense)
        self.assertAllClose(restored.layer.kernel, layer.layer.kernel)


class UnfreezeTest(parameterized.TestCase, tf.test.TestCase):
    def _trainable_backbone_layers(self, backbone):
        return [
            layer.name
            for layer in backbone.layers
            if layer.trainable and layer.weights
        ]

    @parameterized.named_parameters(
        ("last_n_layers", {"last_n_layers": 12}, -12),
        ("from_layer", {"from_layer": "block_15_add"}, "block_15_add"),
        ("whole_backbone", {}, 0),
    )
    def test_unfreeze_makes_exactly_the_named_range_trainable(
        self, kwargs, first
    ):
        model = _build()
        backbone = _backbone(model)
        layers = [layer.name for layer in backbone.layers[1:]]
        start = layers.index(first) if isinstance(first, str) else first
        in_range = layers[start:]
        is_batchnorm = {
            layer.name: isinstance(layer, keras.layers.BatchNormalization)
            for layer in backbone.layers
        }

        summary = tfmemsafe.unfreeze(model, **kwargs)

        self.assertEqual(
            list(summary.layers),
            [name for name in in_range if not is_batchnorm[name]],
        )
        self.assertEqual(
            list(summary.frozen_batchnorm),
            [name for name in in_range if is_batchnorm[name]],
        )
        head = {v.path for v in model.get_layer("predictions").weights}
        unfrozen = {
            v.path
            for name in summary.layers
            for v in backbone.get_layer(name).weights
        }
        self.assertEqual(
            {v.path for v in model.trainable_weights}, head | unfrozen
        )
        self.assertEqual(
            summary.trainable_params,
            sum(int(np.prod(v.shape)) for v in backbone.trainable_weights),
        )
        self.assertGreater(summary.trainable_params, 0)
        self.assertIn("Recompile the model", str(summary))

    def test_unfreeze_again_with_a_smaller_range_freezes_the_rest(self):
        model = _build()
        backbone = _backbone(model)
        tfmemsafe.unfreeze(model, last_n_layers=40)
        summary = tfmemsafe.unfreeze(
            model, last_n_layers=3, keep_batchnorm_frozen=False
        )
        self.assertEqual(summary.layers, ("Conv_1", "Conv_1_bn", "out_relu"))
        self.assertEqual(summary.frozen_batchnorm, ())
        self.assertEqual(
            self._trainable_backbone_layers(backbone), ["Conv_1", "Conv_1_bn"]
        )

    def test_fine_tuning_after_round_trip_keeps_bn_in_inference_mode(self):
        # The backbone is called with training=False, so even unfrozen BN
        # layers keep their moving statistics, also after save and load.
        path = os.path.join(self.get_temp_dir(), "model.keras")
        _build().save(path)
        model = keras.saving.load_model(path)
        backbone = _backbone(model)
        summary = tfmemsafe.unfreeze(
            model, from_layer="block_16_expand", keep_batchnorm_frozen=False
        )
        before = _values(backbone.weights)
        _compile(model, learning_rate=0.01)
        model.fit(_images(16), _labels(16), batch_size=8, verbose=0)

        for path, value in _values(backbone.weights).items():
            layer = path.split("/")[-2]
            if "moving" in path or layer not in summary.layers:
                self.assertAllEqual(value, before[path], msg=path)
            else:
                self.assertNotAllClose(value, before[path], msg=path)

    @parameterized.named_parameters(
        (
            "both_given",
            {"last_n_layers": 3, "from_layer": "Conv_1"},
            "Give at most one of `last_n_layers` and `from_layer`",
        ),
        (
            "zero_layers",
            {"last_n_layers": 0},
            "`last_n_layers` must be an integer from 1 to the backbone's "
            "153 layers",
        ),
        (
            "too_many_layers",
            {"last_n_layers": 154},
            "`last_n_layers` must be an integer from 1",
        ),
        (
            "unknown_layer",
            {"from_layer": "block_99"},
            "`from_layer` must name a layer of the backbone "
            "'mobilenetv2_0.35_32'",
        ),
    )
    def test_bad_argument_raises_value_error_naming_it(self, kwargs, message):
        model = _untouched_model()
        with self.assertRaisesRegex(ValueError, "^" + message):
            tfmemsafe.unfreeze(model, **kwargs)
        self.assertLen(model.trainable_weights, 2)  # Unchanged.


class CacheFeaturesTest(parameterized.TestCase, tf.test.TestCase):
    def test_cached_training_matches_uncached_training_and_round_trips(self):
        x, y = _images(32), _labels(32)
        cached = _build(dropout=0.0, head_units=(8,))
        plain = keras.models.clone_model(cached)
        plain.set_weights(cached.get_weights())
        _compile(cached)
        _compile(plain)

        features = tfmemsafe.cache_features(
            cached, x, y, batch_size=32, verbose=0
        )
        history = tfmemsafe.fit_head(
            cached, features, epochs=2, batch_size=8, shuffle=False, verbose=0
        )
        expected = plain.fit(
            x, y, epochs=2, batch_size=8, shuffle=False, verbose=0
        )

        self.assertAllClose(
            history.history["loss"], expected.history["loss"], atol=1e-5
        )
        for name in ("head_1", "predictions"):
            self.assertAllClose(
                cached.get_layer(name).get_weights(),
                plain.get_layer(name).get_weights(),
                atol=1e-5,
            )
        predictions = cached.predict(x, verbose=0)
        self.assertAllClose(predictions, plain.predict(x, verbose=0), atol=1e-5)
        path = os.path.join(self.get_temp_dir(), "cached.keras")
        cached.save(path)
        restored = keras.saving.load_model(path)
        self.assertAllClose(restored.predict(x, verbose=0), predictions)

    def test_cache_file_streams_the_same_features_as_memory(self):
        x, y = _images(20), _labels(20)
        weights = np.linspace(0.5, 1.5, 20).astype("float32")
        model = _build()
        path = os.path.join(self.get_temp_dir(), "features.tfrecord")
        dataset = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(8)

        on_disk = tfmemsafe.cache_features(
            model, dataset, cache_path=path, verbose=0
        )
        in_memory = tfmemsafe.cache_features(
            model, x, y, sample_weight=weights, batch_size=6, verbose=0
        )

        self.assertEqual(os.listdir(self.get_temp_dir()), ["features.tfrecord"])
        self.assertEqual(int(on_disk.cardinality()), 20)
        self.assertEqual(on_disk.element_spec, in_memory.element_spec)
        for streamed, held in zip(on_disk, in_memory, strict=True):
            # Batches of 8 and 6: kernels sum in other orders (up to 2e-5
            # apart with Eigen's, oneDNN off).
            self.assertAllClose(streamed[0], held[0], rtol=1e-4, atol=1e-4)
            self.assertAllEqual(streamed[1:], held[1:])
        _compile(model)
        history = tfmemsafe.fit_head(model, on_disk, epochs=2, verbose=0)
        self.assertLen(history.history["loss"], 2)

    def test_failed_caching_leaves_no_file_behind(self):
        # The second batch has the wrong image size, so the backbone fails
        # after the first batch was written.
        batches = [_images(2), _images(2, size=24)]
        dataset = tf.data.Dataset.from_generator(
            lambda: iter(batches),
            output_signature=tf.TensorSpec((None, None, None, 3), tf.uint8),
        )
        path = os.path.join(self.get_temp_dir(), "features.tfrecord")
        with self.assertRaisesRegex(
            ValueError,
            r"^`x` must hold images of shape \(32, 32, 3\), as the model's "
            r"input. Received a batch of shape \(2, 24, 24, 3\)",
        ):
            tfmemsafe.cache_features(
                _untouched_model(), dataset, cache_path=path, verbose=0
            )
        self.assertEqual(os.listdir(self.get_temp_dir()), [])

    def test_validation_images_are_cached_and_match_full_model_evaluate(self):
        model = _build(dropout=0.5)
        _compile(model)
        features = tfmemsafe.cache_features(
            model, _images(24), _labels(24), verbose=0
        )
        x_val, y_val = _images(10, seed=1), _labels(10, seed=1)

        history = tfmemsafe.fit_head(
            model, features, epochs=2, validation_data=(x_val, y_val), verbose=0
        )

        loss, accuracy = model.evaluate(x_val, y_val, verbose=0)
        self.assertAllClose(history.history["val_loss"][-1], loss, atol=1e-5)
        self.assertAllClose(history.history["val_accuracy"][-1], accuracy)

    def test_augmentation_cannot_be_cached(self):
        model = _build(
            augmentation=[
                keras.layers.RandomFlip("horizontal"),
                keras.layers.RandomRotation(0.1),
            ]
        )
        with self.assertRaisesRegex(
            ValueError,
            r"^Cannot cache the features of a model that augments its "
            r"input: 'random_flip\w*', 'random_rotation\w*' before",
        ):
            tfmemsafe.cache_features(model, _images(4), _labels(4))

    def test_unfrozen_backbone_cannot_be_cached(self):
        model = _build()
        tfmemsafe.unfreeze(model, last_n_layers=3)
        with self.assertRaisesRegex(
            ValueError,
            r"^Cannot cache features: everything before 'features' must be "
            r"frozen, but 1 weights are trainable",
        ):
            tfmemsafe.cache_features(model, _images(4), _labels(4))

    def test_fit_head_needs_a_compiled_model(self):
        model = _untouched_model()
        features = tfmemsafe.cache_features(
            model, _images(4), _labels(4), verbose=0
        )
        with self.assertRaisesRegex(ValueError, "^`model` must be compiled"):
            tfmemsafe.fit_head(model, features)

    def test_fit_head_refuses_data_that_are_not_features(self):
        model = _build()
        _compile(model)
        images = tf.data.Dataset.from_tensor_slices((_images(4), _labels(4)))
        with self.assertRaisesRegex(
            ValueError,
            r"^`features` must be an unbatched dataset from `cache_features`"
            r", whose elements start with features of shape \(1280,\)",
        ):
            tfmemsafe.fit_head(model, images)

    @parameterized.named_parameters(
        (
            "unknown_features_layer",
            {"features_layer": "pool"},
            "`features_layer` must name a layer of `model`",
        ),
        (
            "labels_with_dataset",
            {"y": np.zeros(4)},
            "`y` and `sample_weight` must be None when `x` is a dataset",
        ),
        (
            "zero_batch_size",
            {"batch_size": 0, "x": _images(4)},
            "`batch_size` must be an integer >= 1",
        ),
    )
    def test_bad_argument_raises_value_error_naming_it(self, kwargs, message):
        images = tf.data.Dataset.from_tensor_slices(_images(4)).batch(2)
        kwargs = {"x": images, **kwargs}
        with self.assertRaisesRegex(ValueError, "^" + message):
            tfmemsafe.cache_features(_untouched_model(), **kwargs, verbose=0)


if __name__ == "__main__":
    tf.test.main()
