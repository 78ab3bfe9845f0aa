"""Each private Keras name `tfmemsafe._compat` reads, checked against the
installed Keras: a release that moves one fails here, loudly, before it
changes what tfmemsafe does."""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _compat


def _nested():
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))


class PrivateNamesTest(tf.test.TestCase):
    def test_nested_layers_reach_inside_a_nested_model(self):
        self.assertTrue(hasattr(keras.layers.Layer, "_flatten_layers"))
        names = [
            type(layer).__name__ for layer in _compat.nested_layers(_nested())
        ]
        self.assertIn("BatchNormalization", names)
        self.assertIn("Dropout", names)

    def test_own_non_trainable_variables_are_the_moving_statistics(self):
        layer = keras.layers.BatchNormalization()
        layer.build((None, 3))
        self.assertTrue(hasattr(layer, "_non_trainable_variables"))
        names = {v.name for v in _compat.own_non_trainable_variables(layer)}
        self.assertEqual(names, {"moving_mean", "moving_variance"})

    def test_seed_generator_states_of_a_dropout(self):
        layer = keras.layers.Dropout(0.5)
        self.assertTrue(hasattr(layer, "_seed_generators"))
        (state,) = _compat.seed_generator_states(layer)
        before = np.array(state.numpy())
        layer(tf.ones((2, 3)), training=True)
        self.assertNotAllEqual(before, state.numpy())

    def test_a_keras_mask_is_read(self):
        from keras.src.backend import get_keras_mask  # noqa: F401

        masked = keras.layers.Masking(0.0)(tf.constant([[[0.0], [1.0]]]))
        self.assertTrue(_compat.has_keras_mask(masked))
        self.assertFalse(_compat.has_keras_mask(tf.ones((1, 2))))


class FallbackTest(tf.test.TestCase):
    """Where a name is gone, a warning, and the reading that refuses."""

    def setUp(self):
        super().setUp()
        _compat._warned.clear()  # noqa: SLF001

    def test_a_missing_walk_warns_and_gives_the_top_layers(self):
        class Bare:
            layers = ["a", "b"]

        with self.assertWarnsRegex(RuntimeWarning, "_flatten_layers"):
            self.assertEqual(_compat.nested_layers(Bare()), ["a", "b"])

    def test_a_missing_mask_reader_takes_every_output_as_masked(self):
        with (
            mock.patch.dict("sys.modules", {"keras.src.backend": None}),
            mock.patch.object(_compat, "_version", return_value=(3, 20)),
            self.assertWarnsRegex(RuntimeWarning, "get_keras_mask"),
        ):
            self.assertTrue(_compat.has_keras_mask(tf.ones((1, 2))))


if __name__ == "__main__":
    tf.test.main()
