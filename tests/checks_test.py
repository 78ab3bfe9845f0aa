"""Tests for the argument checks every public function shares.

Integers may be Python or NumPy integers, as Keras accepts them; a lone
callback may stand where a list is expected; bad values get Keras-style
messages naming the argument.
"""

import re

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe


def _dense_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)]
    )
    model.compile("sgd", "sparse_categorical_crossentropy")
    return model


def _table(rows=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


class _EpochCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


class IntegerArgumentTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("int64", np.int64), ("int32", np.int32), ("uint16", np.uint16)
    )
    def test_fit_accepts_numpy_integers_as_keras_does(self, integer):
        model = _dense_model()
        history = tfmemsafe.fit(
            model,
            _table(),
            batch_size=integer(16),
            epochs=integer(2),
            min_batch_size=integer(2),
            max_retries=integer(3),
            verbose=0,
        )
        self.assertEqual(history.epoch, [0, 1])
        self.assertEqual(int(model.optimizer.iterations), 8)
        self.assertIsInstance(history.batch_size, int)

    def test_evaluate_predict_and_search_accept_numpy_integers(self):
        model = _dense_model()
        x, y = _table()
        loss = tfmemsafe.evaluate(model, (x, y), batch_size=np.int64(16))
        self.assertAllClose(loss, model.evaluate(x, y, verbose=0))
        self.assertEqual(
            tfmemsafe.predict(model, x, batch_size=np.int64(16)).shape,
            (64, 2),
        )
        found = tfmemsafe.find_max_batch_size(
            model, (x, y), start=np.int64(8), max_batch_size=np.int64(16)
        )
        self.assertEqual(found, 16)

    def test_accumulation_and_monitor_accept_numpy_integers(self):
        model = tfmemsafe.with_gradient_accumulation(
            _dense_model(), np.int64(2)
        )
        self.assertEqual(model.accumulation_steps, 2)
        self.assertIsInstance(model.accumulation_steps, int)
        monitor = tfmemsafe.MemoryMonitor(every_n_batches=np.int64(2))
        self.assertEqual(monitor.every_n_batches, 2)

    @parameterized.named_parameters(
        ("bool", True),
        ("float", 16.0),
        ("zero", 0),
        ("numpy_zero", np.int64(0)),
        ("string", "big"),
    )
    def test_fit_refuses_a_batch_size_of_no_kind_naming_every_kind(self, value):
        with self.assertRaisesRegex(
            ValueError,
            r"^`batch_size` must be an integer >= 1, 'auto' or None\. "
            "Received: batch_size=" + re.escape(repr(value)),
        ):
            tfmemsafe.fit(_dense_model(), _table(), batch_size=value)


class MinBatchSizeTest(tf.test.TestCase):
    def test_fit_refuses_a_floor_above_the_batch_size_naming_both(self):
        with self.assertRaisesRegex(
            ValueError,
            r"^`min_batch_size` must be <= `batch_size`, the batch size to "
            r"start at. Received: min_batch_size=64, batch_size=32",
        ):
            tfmemsafe.fit(
                _dense_model(), _table(), batch_size=32, min_batch_size=64
            )

    def test_fit_refuses_a_floor_above_the_validation_batch_size(self):
        with self.assertRaisesRegex(
            ValueError,
            r"^`min_batch_size` must be <= `validation_batch_size`.*"
            r"validation_batch_size=8",
        ):
            tfmemsafe.fit(
                _dense_model(),
                _table(),
                batch_size=32,
                validation_data=_table(),
                validation_batch_size=8,
                min_batch_size=16,
            )

    def test_evaluate_and_predict_refuse_a_floor_above_the_batch_size(self):
        model = _dense_model()
        x, y = _table()
        with self.assertRaisesRegex(ValueError, r"^`min_batch_size` must"):
            tfmemsafe.evaluate(model, (x, y), batch_size=8, min_batch_size=9)
        with self.assertRaisesRegex(ValueError, r"^`min_batch_size` must"):
            tfmemsafe.predict(model, x, batch_size=8, min_batch_size=9)

    def test_a_floor_equal_to_the_batch_size_is_accepted(self):
        history = tfmemsafe.fit(
            _dense_model(),
            _table(),
            batch_size=16,
            min_batch_size=16,
            verbose=0,
        )
        self.assertEqual(history.batch_size, 16)


class CallbackArgumentTest(tf.test.TestCase):
    def test_fit_accepts_a_lone_callback(self):
        counter = _EpochCounter()
        tfmemsafe.fit(
            _dense_model(), _table(), epochs=2, callbacks=counter, verbose=0
        )
        self.assertEqual(counter.epochs, 2)

    def test_evaluate_and_predict_accept_a_lone_callback(self):
        model = _dense_model()
        x, y = _table()
        counter = _Counter()
        tfmemsafe.evaluate(model, (x, y), callbacks=counter, verbose=0)
        tfmemsafe.predict(model, x, callbacks=counter, verbose=0)
        self.assertEqual(counter.ends, ["test", "predict"])

    def test_refuses_what_is_not_a_callback_naming_the_argument(self):
        with self.assertRaisesRegex(TypeError, r"^`callbacks` must be"):
            tfmemsafe.fit(_dense_model(), _table(), callbacks=3, verbose=0)
        with self.assertRaisesRegex(TypeError, r"^`callbacks` must be"):
            tfmemsafe.fit(
                _dense_model(), _table(), callbacks=["csv.log"], verbose=0
            )


class ChoiceArgumentTest(tf.test.TestCase):
    def test_plan_refuses_a_checkpointing_of_no_kind_naming_each_kind(self):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        with self.assertRaisesRegex(
            ValueError,
            r"^`checkpointing` must be one of True, False, 'auto'\. "
            r"Received: checkpointing='yes'$",
        ):
            tfmemsafe.plan(model, np.ones((8, 4)), checkpointing="yes")


class _Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_test_end(self, logs=None):
        self.ends.append("test")

    def on_predict_end(self, logs=None):
        self.ends.append("predict")


class ModelArgumentTest(tf.test.TestCase):
    def test_every_function_refuses_a_non_model_with_type_error(self):
        calls = {
            "fit": lambda: tfmemsafe.fit("model", _table()),
            "evaluate": lambda: tfmemsafe.evaluate("model", _table()),
            "predict": lambda: tfmemsafe.predict("model", _table()[0]),
            "with_gradient_accumulation": (
                lambda: tfmemsafe.with_gradient_accumulation("model", 2)
            ),
        }
        for name, call in calls.items():
            with self.subTest(name):
                with self.assertRaisesRegex(
                    TypeError, r"^`model` must be a keras.Model"
                ):
                    call()


if __name__ == "__main__":
    tf.test.main()
