"""Tests of `tfmemsafe.SplitBatchOnOOM` in plain `model.fit`, `evaluate`
and `predict`.

Most tests run out of memory at once, from inside the compiled step, with
`_models.RunsOutAbove` (a batch of more than some rows raises the
allocator's error); `RealCapTest` runs the same under a capped allocator
in child processes.
"""

import concurrent.futures
import csv
import gc
import os
import tempfile
import time

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing
from tfmemsafe.recovery import _output_losses
from tfmemsafe.recovery._micro_batch_size import MicroBatchSize

_ROWS = 200
_MIB = 2**20


def _features(rows=_ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")
    return x, y


def _classifier(
    runs_out_above=None,
    loss=None,
    regularized=False,
    batch_norm=False,
    accumulation_steps=None,
    optimizer=None,
    **compile_kwargs,
):
    """6 -> 16 (ReLU) -> 3 logits, seeded; the first layer a
    `RunsOutAbove(runs_out_above)`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = _models.RunsOutAbove(runs_out_above)(inputs)
    regularizer = keras.regularizers.L2(1e-2) if regularized else None
    hidden = keras.layers.Dense(
        16,
        activation="relu",
        kernel_regularizer=regularizer,
        activity_regularizer=regularizer,
    )(hidden)
    if batch_norm:
        hidden = keras.layers.BatchNormalization()(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    if accumulation_steps is None:
        model = keras.Model(inputs, outputs)
    else:
        model = tfmemsafe.AccumulatingModel(
            inputs, outputs, accumulation_steps=accumulation_steps
        )
    model.compile(
        optimizer or keras.optimizers.Adam(1e-2),
        loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def _two_outputs(runs_out_above=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = _models.RunsOutAbove(runs_out_above)(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(hidden)
    model = keras.Model(
        inputs,
        {
            "classes": keras.layers.Dense(3, name="classes")(hidden),
            "value": keras.layers.Dense(1, name="value")(hidden),
        },
    )
    model.compile(
        keras.optimizers.Adam(1e-2),
        loss={
            "classes": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True
            ),
            "value": "mse",
        },
        loss_weights={"classes": 1.0, "value": 0.5},
    )
    return model


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def _generator(x, y, batch_size):
    while True:
        for start in range(0, len(x), batch_size):
            end = start + batch_size
            yield x[start:end], y[start:end]


def _fit_arguments(kind, x, y, batch_size, **extra):
    """`model.fit` keyword arguments giving `x, y` as `kind` of data."""
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=batch_size, shuffle=False, **extra)
    if kind == "tensors":
        return dict(
            x=tf.constant(x),
            y=tf.constant(y),
            batch_size=batch_size,
            shuffle=False,
            **extra,
        )
    if kind == "dataset":
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        return dict(x=data, shuffle=False, **extra)
    if kind == "py_dataset":
        # Keras from 3.16 shuffles a PyDataset's batches unless told not to.
        return dict(x=_Batches(x, y, batch_size), shuffle=False, **extra)
    if kind == "generator":
        steps = -(-len(x) // batch_size)
        return dict(
            x=_generator(x, y, batch_size),
            steps_per_epoch=steps,
            shuffle=False,
            **extra,
        )
    raise ValueError(kind)


class _Batches_seen(keras.callbacks.Callback):
    """Records every callback call with its epoch or batch."""

    def on_train_begin(self, logs=None):
        self.calls = []

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch, round(float(logs["loss"]), 5)))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, sorted(logs)))


class ExactSplitTest(parameterized.TestCase, tf.test.TestCase):
    """A split batch makes the whole batch's update, to rounding."""

    def _compare(self, build, fit_kwargs, runs_out_above=20):
        reference = build(None)
        expected = reference.fit(verbose=0, **fit_kwargs()).history
        model = build(runs_out_above)
        split = tfmemsafe.SplitBatchOnOOM()
        history = model.fit(verbose=0, callbacks=[split], **fit_kwargs())
        self.assertNotEmpty(split.oom_events)
        self.assertAllClose(
            reference.get_weights(), model.get_weights(), atol=1e-6
        )
        self.assertEqual(expected.keys(), history.history.keys())
        for name, values in expected.items():
            self.assertAllClose(values, history.history[name], atol=1e-5)
        return model, split

    @parameterized.named_parameters(
        ("arrays", "arrays"),
        ("tensors", "tensors"),
        ("dataset", "dataset"),
        ("py_dataset", "py_dataset"),
        ("generator", "generator"),
    )
    def test_every_data_kind_matches_the_whole_batch(self, kind):
        x, y = _features()
        _, split = self._compare(
            _classifier, lambda: _fit_arguments(kind, x, y, 64, epochs=2)
        )
        event = split.oom_events[0]
        self.assertEqual(
            (event.epoch, event.step, event.phase), (0, 0, "training")
        )
        self.assertEqual(event.batch_size_after, 64)
        self.assertGreater(event.split_into, 1)

    @parameterized.named_parameters(
        ("sample_weight", dict(sample_weight=True)),
        ("class_weight", dict(class_weight={0: 1.0, 1: 2.0, 2: 0.5})),
        ("validation_split", dict(validation_split=0.25, validation_freq=2)),
        ("initial_epoch", dict(initial_epoch=1)),
    )
    def test_fit_arguments_match_the_whole_batch(self, extra):
        x, y = _features()
        if extra.pop("sample_weight", False):
            extra["sample_weight"] = np.linspace(0.1, 2.0, _ROWS)
        self._compare(
            _classifier,
            lambda: _fit_arguments("arrays", x, y, 64, epochs=3, **extra),
        )

    @parameterized.named_parameters(
        ("mean", dict(reduction="mean")),
        (
            "mean_with_sample_weight_unweighted",
            dict(reduction="mean_with_sample_weight"),
        ),
    )
    def test_averaging_reductions_match_the_whole_batch(self, loss_kwargs):
        x, y = _features()
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, **loss_kwargs
        )
        self._compare(
            lambda rows: _classifier(rows, loss=loss),
            lambda: _fit_arguments("arrays", x, y, 64, epochs=2),
        )

    def test_regularization_matches_the_whole_batch(self):
        x, y = _features()
        self._compare(
            lambda rows: _classifier(rows, regularized=True),
            lambda: _fit_arguments("arrays", x, y, 64, epochs=2),
        )

    @parameterized.named_parameters(
        # Keras weights each call of its step by the rows its static
        # shapes show: unknown (a weight of 1) for arrays, 64 for batches
        # dropping their remainder.
        ("rows_unknown", False),
        ("rows_static", True),
    )
    def test_multi_output_losses_match_the_whole_batch(self, static):
        x, y = _features()
        targets = {"classes": y, "value": x[:, :1]}
        weights = np.linspace(0.5, 1.5, len(y)).astype("float32")
        if static:
            batches = tf.data.Dataset.from_tensor_slices((x, targets, weights))
            batches = batches.batch(64, drop_remainder=True)
            arguments = lambda: dict(  # noqa: E731
                x=batches, validation_data=batches, epochs=2, shuffle=False
            )
        else:
            arguments = lambda: dict(  # noqa: E731
                x=x,
                y=targets,
                sample_weight=weights,
                batch_size=64,
                epochs=2,
                shuffle=False,
                validation_split=0.25,
            )
        # Every log, each output's own loss (`classes_loss`) and the
        # validation's (`val_classes_loss`, split by evaluation) included.
        self._compare(_two_outputs, arguments)

    def test_a_mean_named_otherwise_is_left_as_keras_counts_it(self):
        class Renamed(keras.metrics.Mean):
            """A `Mean` of a Keras that named its variables otherwise."""

            def __init__(self):
                keras.metrics.Metric.__init__(self, name="renamed")
                self.total = self.add_variable((), "zeros", name="sum")
                self.count = self.add_variable((), "zeros", name="n")

        _output_losses._warned = False
        with self.assertLogs(level="WARNING") as logs:
            self.assertIsNone(_output_losses._total_and_count(Renamed()))
        self.assertIn("['n', 'sum'], not 'total' and 'count'", logs.output[0])

    def test_multi_output_evaluation_matches_the_whole_batch(self):
        x, y = _features()
        targets = {"classes": y, "value": x[:, :1]}
        expected = _two_outputs(None).evaluate(
            x, targets, batch_size=64, verbose=0, return_dict=True
        )
        split = tfmemsafe.SplitBatchOnOOM()
        found = _two_outputs(20).evaluate(
            x,
            targets,
            batch_size=64,
            verbose=0,
            return_dict=True,
            callbacks=[split],
        )
        self.assertNotEmpty(split.oom_events)
        self.assertEqual(expected.keys(), found.keys())
        for name, value in expected.items():
            self.assertAllClose(value, found[name], atol=1e-5, msg=name)

    def test_loss_scale_optimizer_matches_the_whole_batch(self):
        x, y = _features()
        self._compare(
            lambda rows: _classifier(
                rows,
                optimizer=keras.optimizers.LossScaleOptimizer(
                    keras.optimizers.Adam(1e-2)
                ),
            ),
            lambda: _fit_arguments("arrays", x, y, 64, epochs=2),
        )

    def test_steps_per_execution_matches_the_whole_batch(self):
        x, y = _features()
        model, _ = self._compare(
            lambda rows: _classifier(rows, steps_per_execution=4),
            lambda: _fit_arguments("arrays", x, y, 16, epochs=2),
            runs_out_above=10,
        )
        self.assertEqual(int(model.optimizer.iterations), 2 * 13)

    def test_accumulating_model_counts_a_split_batch_once(self):
        x, y = _features()
        model, _ = self._compare(
            lambda rows: _classifier(rows, accumulation_steps=2),
            lambda: _fit_arguments("arrays", x, y, 64, epochs=2),
        )
        # 4 batches an epoch, windows of 2: 2 updates an epoch.
        self.assertEqual(int(model.optimizer.iterations), 4)

    def test_sparse_embedding_gradients_match_the_whole_batch(self):
        rng = np.random.default_rng(0)
        tokens = rng.integers(1, 50, size=(_ROWS, 7)).astype("int32")
        y = (tokens[:, 0] > 25).astype("int32")

        def build(rows):
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((7,), dtype="int32"),
                    _models.RunsOutAbove(rows),
                    keras.layers.Embedding(50, 8),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(2),
                ]
            )
            model.compile(
                keras.optimizers.Adam(1e-2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            return model

        self._compare(
            build, lambda: _fit_arguments("arrays", tokens, y, 64, epochs=2)
        )

    def test_evaluate_and_predict_match_the_whole_batch(self):
        x, y = _features()
        reference = _classifier(None)
        model = _classifier(20)
        split = tfmemsafe.SplitBatchOnOOM()
        self.assertAllClose(
            reference.evaluate(x, y, batch_size=64, verbose=0),
            model.evaluate(x, y, batch_size=64, verbose=0, callbacks=[split]),
            atol=1e-6,
        )
        self.assertEqual(split.oom_events[0].phase, "evaluation")
        self.assertAllClose(
            reference.predict(x, batch_size=64, verbose=0),
            model.predict(x, batch_size=64, verbose=0, callbacks=[split]),
            atol=1e-6,
        )
        self.assertEqual(split.oom_events[0].phase, "prediction")

    def test_predicts_with_a_model_never_compiled(self):
        x, _ = _features()
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        self.assertAllClose(
            model.predict(x, batch_size=64, verbose=0),
            model.predict(
                x,
                batch_size=64,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM(micro_batch_size=16)],
            ),
        )


class FitTest(parameterized.TestCase, tf.test.TestCase):
    """`tfmemsafe.fit` takes `model.fit`'s arguments and data."""

    def test_takes_model_fits_arguments_in_its_order(self):
        x, y = _features()
        history = tfmemsafe.fit(_classifier(), x, y, 64, 2, 0)
        self.assertIsInstance(history, tfmemsafe.FitHistory)
        self.assertLen(history.history["loss"], 2)
        self.assertEqual(history.batch_size, 64)

    def test_history_has_what_callbacks_add_to_the_logs(self):
        x, y = _features()
        scheduler = keras.callbacks.LearningRateScheduler(lambda e, r: r / 2)
        history = tfmemsafe.fit(
            _classifier(), x, y, 64, 2, 0, callbacks=[scheduler]
        )
        self.assertLen(history.history["learning_rate"], 2)
        self.assertLess(
            history.history["learning_rate"][1],
            history.history["learning_rate"][0],
        )

    def test_evaluate_and_predict_take_their_models_arguments(self):
        x, y = _features()
        model = _classifier()
        weights = np.linspace(0.5, 1.5, len(y)).astype("float32")
        self.assertAllClose(
            tfmemsafe.evaluate(model, x, y, 64, 0, weights),
            model.evaluate(x, y, 64, 0, weights),
        )
        self.assertAllClose(
            tfmemsafe.evaluate(model, (x, y), batch_size=64, verbose=0),
            model.evaluate(x, y, 64, 0),
        )
        self.assertAllClose(
            tfmemsafe.predict(model, x, 64, 0, steps=2),
            model.predict(x, 64, 0, steps=2),
        )

    @parameterized.named_parameters(
        ("py_dataset", "py_dataset"), ("generator", "generator")
    )
    def test_data_only_keras_reads_is_split_in_the_step(self, kind):
        x, y = _features()
        reference = _classifier(None)
        reference.fit(verbose=0, **_fit_arguments(kind, x, y, 64, epochs=2))
        model = _classifier(20)
        history = tfmemsafe.fit(
            model, verbose=0, **_fit_arguments(kind, x, y, 64, epochs=2)
        )
        self.assertNotEmpty(history.oom_events)
        self.assertTrue(all(e.split_into for e in history.oom_events))
        self.assertAllClose(
            reference.get_weights(), model.get_weights(), atol=1e-6
        )

    @parameterized.named_parameters(
        ("exact", False, 1), ("batch_normalization", True, 0)
    )
    def test_the_pre_flight_check_splits_only_where_exact(
        self, batch_norm, preflight_events
    ):
        from unittest import mock

        x, y = _features()
        whole = _classifier(batch_norm=batch_norm)
        whole.fit(x, y, batch_size=64, shuffle=False, verbose=0)
        model = _classifier(batch_norm=batch_norm)
        # As if the estimate predicted that a quarter of the batch fits.
        with mock.patch.object(
            tfmemsafe.planning.SizePlanner,
            "halvings",
            return_value=(2, "predicted over the limit"),
        ):
            history = tfmemsafe.fit(
                model,
                x,
                y,
                batch_size=64,
                shuffle=False,
                verbose=0,
                split_batch_norm=False,
            )
        events = [e for e in history.oom_events if e.phase == "preflight"]
        self.assertLen(events, preflight_events)
        self.assertAllClose(whole.get_weights(), model.get_weights(), atol=1e-6)

    def test_steps_per_epoch_trains_every_example_once(self):
        x, y = _features(256)
        ids = np.arange(256, dtype="float32")[:, None]
        data = tf.data.Dataset.from_tensor_slices((np.hstack([ids, x]), y))
        model = _counting_model(256, 8)
        history = tfmemsafe.fit(
            model,
            data.batch(16).repeat(),
            epochs=4,
            steps_per_epoch=4,
            verbose=0,
        )
        self.assertNotEmpty(history.oom_events)
        self.assertAllEqual(model.layers[1].seen.numpy(), np.ones(256))

    def test_auto_batch_size_on_a_generator_is_refused(self):
        x, y = _features()
        with self.assertRaisesRegex(ValueError, "`batch_size='auto'` needs"):
            tfmemsafe.fit(
                _classifier(),
                _generator(x, y, 64),
                batch_size="auto",
                steps_per_epoch=2,
            )


class _CountsExamples(keras.layers.Layer):
    """Counts, in training, how often each example id (input column 0)
    went through it."""

    def __init__(self, examples, **kwargs):
        super().__init__(**kwargs)
        self.examples = examples

    def build(self, input_shape):
        self.seen = self.add_weight(
            shape=(self.examples,), initializer="zeros", trainable=False
        )

    def call(self, inputs, training=False):
        if training:
            ids = tf.cast(inputs[:, 0], tf.int32)
            self.seen.assign_add(
                tf.math.bincount(
                    ids,
                    minlength=self.examples,
                    maxlength=self.examples,
                    dtype=self.seen.dtype,
                )
            )
        return inputs[:, 1:]


def _counting_model(examples, runs_out_above):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((7,)),
            _models.RunsOutAbove(runs_out_above),
            _CountsExamples(examples),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class EveryExampleOnceTest(parameterized.TestCase, tf.test.TestCase):
    """Each example is trained once per epoch, as `model.fit` trains it."""

    def _seen(self, data, epochs, runs_out_above, **fit_kwargs):
        model = _counting_model(256, runs_out_above)
        split = tfmemsafe.SplitBatchOnOOM()
        model.fit(
            data,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[split],
            **fit_kwargs,
        )
        if runs_out_above is not None:
            self.assertNotEmpty(split.oom_events)
        return model.layers[1].seen.numpy()

    def _rows(self):
        x, y = _features(256)
        ids = np.arange(256, dtype="float32")[:, None]
        return tf.data.Dataset.from_tensor_slices((np.hstack([ids, x]), y))

    @parameterized.named_parameters(("no_oom", None), ("split", 8))
    def test_steps_per_epoch_keeps_one_iterator_across_epochs(self, rows):
        data = self._rows().batch(16).repeat()
        seen = self._seen(data, 4, rows, steps_per_epoch=4)
        self.assertAllEqual(seen, np.ones(256))

    def test_a_shuffle_buffer_smaller_than_the_data(self):
        data = self._rows().shuffle(64, seed=1).batch(16)
        self.assertAllEqual(self._seen(data, 2, 8), np.full(256, 2.0))

    def test_a_random_augmentation_with_a_split(self):
        def augment(features, label):
            noise = tf.random.uniform(tf.shape(features[1:]), -0.1, 0.1)
            return tf.concat([features[:1], features[1:] + noise], 0), label

        data = self._rows().map(augment).batch(32)
        self.assertAllEqual(self._seen(data, 2, 8), np.full(256, 2.0))


class AccumulationWindowTest(tf.test.TestCase):
    def test_unknown_length_makes_the_updates_of_known_length(self):
        x, y = _features(192)
        known = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        unknown = known.filter(lambda *_: True)
        self.assertEqual(unknown.cardinality(), tf.data.UNKNOWN_CARDINALITY)
        iterations = []
        for data in (known, unknown):
            model = _classifier(20, accumulation_steps=3)
            model.fit(
                data,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
            )
            iterations.append(int(model.optimizer.iterations))
        self.assertEqual(iterations, [4, 4])


class CallbacksTest(tf.test.TestCase):
    def test_callbacks_see_each_batch_once_in_order(self):
        x, y = _features()
        recorders = [_Batches_seen(), _Batches_seen()]
        for recorder, rows in zip(recorders, (None, 20), strict=True):
            _classifier(rows).fit(
                x,
                y,
                batch_size=64,
                epochs=2,
                validation_split=0.2,
                shuffle=False,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM(), recorder],
            )
        self.assertEqual(recorders[0].calls, recorders[1].calls)

    def test_keras_callbacks_work_as_without_an_oom(self):
        x, y = _features()
        rows = []
        for runs_out_above in (None, 20):
            with tempfile.TemporaryDirectory() as directory:
                log = os.path.join(directory, "log.csv")
                _classifier(runs_out_above).fit(
                    x,
                    y,
                    batch_size=64,
                    epochs=4,
                    validation_split=0.2,
                    shuffle=False,
                    verbose=0,
                    callbacks=[
                        tfmemsafe.SplitBatchOnOOM(),
                        keras.callbacks.CSVLogger(log),
                        keras.callbacks.EarlyStopping(patience=1),
                        keras.callbacks.ReduceLROnPlateau(patience=1),
                        keras.callbacks.ModelCheckpoint(
                            os.path.join(directory, "best.keras")
                        ),
                        keras.callbacks.BackupAndRestore(
                            os.path.join(directory, "backup")
                        ),
                        tfmemsafe.MemoryMonitor(),
                    ],
                )
                with open(log) as f:
                    rows.append(
                        [
                            {
                                k: round(float(v), 4)
                                for k, v in row.items()
                                if not k.startswith("memory")
                            }
                            for row in csv.DictReader(f)
                        ]
                    )
                self.assertTrue(
                    os.path.exists(os.path.join(directory, "best.keras"))
                )
        self.assertEqual(rows[0], rows[1])


class InstallTest(tf.test.TestCase):
    """The callback's functions stand in for Keras' only during its run."""

    def test_a_model_not_built_yet_trains(self):
        x, y = _features()
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [_models.RunsOutAbove(20), keras.layers.Dense(3)]
        )
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        split = tfmemsafe.SplitBatchOnOOM()
        model.predict(x, batch_size=16, verbose=0, callbacks=[split])
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[split])
        self.assertNotEmpty(split.oom_events)
        model.fit(x[:16], y[:16], batch_size=16, verbose=0)

    def test_an_error_outside_its_functions_leaves_keras_in_charge(self):
        x, y = _features()

        class Fails(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                raise RuntimeError("a callback's own error")

        model = _classifier(20)
        with self.assertRaisesRegex(RuntimeError, "a callback's own error"):
            model.fit(
                x,
                y,
                batch_size=64,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM(), Fails()],
            )
        # Plain Keras again: the batch that runs out is not split.
        with self.assertRaises(tf.errors.UnknownError):
            model.fit(x, y, batch_size=64, verbose=0)
        # And a new callback installs as on a fresh model.
        split = tfmemsafe.SplitBatchOnOOM()
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[split])
        self.assertNotEmpty(split.oom_events)

    def test_run_eagerly_runs_eagerly(self):
        class NeedsEager(keras.layers.Layer):
            def call(self, inputs):
                inputs.numpy()  # Only an eager tensor has it.
                return inputs

            def compute_output_shape(self, input_shape):
                return input_shape

        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((6,)), NeedsEager(), keras.layers.Dense(3)]
        )
        model.compile("adam", "mse", run_eagerly=True)
        x, _ = _features()
        history = model.fit(
            x,
            np.zeros((_ROWS, 3)),
            batch_size=64,
            verbose=0,
            callbacks=[tfmemsafe.SplitBatchOnOOM()],
        )
        self.assertLen(history.history["loss"], 1)

    def test_a_run_that_split_frees_its_gradient_sums(self):
        x, y = _features()
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                _models.RunsOutAbove(20),
                keras.layers.Dense(512),
                keras.layers.Dense(512),
                keras.layers.Dense(3),
            ]
        )
        model.compile("adam", "mse")
        y = np.zeros((_ROWS, 3))
        model.fit(x, y, batch_size=16, verbose=0)  # Builds the optimizer.
        in_use = []
        for _ in range(3):
            model.fit(
                x,
                y,
                batch_size=64,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
            )
            gc.collect()
            in_use.append(tfmemsafe.memory_info("CPU:0").current_bytes)
        gradient_bytes = sum(
            int(np.prod(v.shape)) * 4 for v in model.trainable_variables
        )
        # A run that kept its sums would hold one more gradient each time
        # (TensorFlow keeps every graph of `ReplicaContext.all_reduce`).
        self.assertLess(in_use[2] - in_use[0], gradient_bytes)


class RefusedTest(parameterized.TestCase, tf.test.TestCase):
    """What cannot be split exactly stops with `OutOfMemoryError`, saying
    why, the model as before the batch."""

    def _refused(self, model, pattern, **fit_kwargs):
        x, y = _features()
        fit_kwargs = {"x": x, "y": y, "batch_size": 64, **fit_kwargs}
        before = model.get_weights()
        with self.assertRaisesRegex(tfmemsafe.OutOfMemoryError, pattern):
            model.fit(
                shuffle=False,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
                **fit_kwargs,
            )
        self.assertAllClose(before, model.get_weights())
        # Keras' own step is back: a batch that fits trains.
        model.fit(x[:16], y[:16], batch_size=16, verbose=0)

    def test_sum_reduction(self):
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"
        )
        self._refused(_classifier(20, loss=loss), "reduction='sum'")

    def test_mean_with_sample_weight_and_sample_weights(self):
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        )
        self._refused(
            _classifier(20, loss=loss),
            "mean_with_sample_weight",
            sample_weight=np.linspace(0.1, 2.0, _ROWS),
        )

    def test_batch_normalization(self):
        self._refused(_classifier(20, batch_norm=True), "normalizes each")

    def test_run_eagerly(self):
        self._refused(_classifier(20, run_eagerly=True), "runs eagerly")

    def test_masked_outputs(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                _models.RunsOutAbove(20),
                keras.layers.Reshape((6, 1)),
                keras.layers.Masking(0.0),
                keras.layers.Dense(3),
            ]
        )
        model.compile("adam", "mse")
        x, _ = _features()
        before = model.get_weights()
        with self.assertRaisesRegex(tfmemsafe.OutOfMemoryError, "mask"):
            model.fit(
                x,
                np.zeros((_ROWS, 6, 3)),
                batch_size=64,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
            )
        self.assertAllClose(before, model.get_weights())

    @parameterized.named_parameters(
        ("sum_reduction", {"reduction": "sum"}, {}, "reduction='sum'"),
        ("batch_normalization", {}, {"batch_norm": True}, "normalizes each"),
    )
    def test_micro_batches_asked_for_from_the_start_are_not_inexact(
        self, loss_kwargs, model_kwargs, pattern
    ):
        # `micro_batch_size` (fit's pre-flight check, a plan) splits from
        # the first step, before any error: only where that is exact.
        x, y = _features()
        loss = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, **loss_kwargs
        )
        whole = _classifier(loss=loss, **model_kwargs)
        whole.fit(x, y, batch_size=64, shuffle=False, verbose=0)
        model = _classifier(loss=loss, **model_kwargs)
        split = tfmemsafe.SplitBatchOnOOM(micro_batch_size=16)
        with self.assertLogs(level="WARNING") as logs:
            model.fit(
                x, y, batch_size=64, shuffle=False, verbose=0, callbacks=[split]
            )
        self.assertAllClose(whole.get_weights(), model.get_weights())
        self.assertRegex("\n".join(logs.output), pattern)

    def test_batch_normalization_split_from_the_start_when_asked(self):
        x, y = _features()
        whole = _classifier(batch_norm=True)
        whole.fit(x, y, batch_size=64, shuffle=False, verbose=0)
        model = _classifier(batch_norm=True)
        split = tfmemsafe.SplitBatchOnOOM(
            micro_batch_size=16, split_batch_norm=True
        )
        model.fit(
            x, y, batch_size=64, shuffle=False, verbose=0, callbacks=[split]
        )
        # Each micro-batch normalized by its own statistics: not the same.
        self.assertNotAllClose(whole.get_weights(), model.get_weights())

    def test_batch_normalization_split_when_asked(self):
        x, y = _features()
        model = _classifier(20, batch_norm=True)
        split = tfmemsafe.SplitBatchOnOOM(split_batch_norm=True)
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[split])
        self.assertNotEmpty(split.oom_events)

    def test_a_micro_batch_of_one_that_runs_out(self):
        model = _classifier(0)
        x, y = _features()
        with self.assertRaisesRegex(tfmemsafe.OutOfMemoryError, "one example"):
            model.fit(
                x,
                y,
                batch_size=64,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
            )

    def test_other_errors_pass_through(self):
        keras.utils.set_random_seed(0)

        class Fails(keras.layers.Layer):
            def call(self, inputs):
                tf.debugging.assert_less(tf.reduce_max(inputs), -100.0)
                return inputs

        model = keras.Sequential(
            [keras.Input((6,)), Fails(), keras.layers.Dense(3)]
        )
        model.compile("adam", "mse")
        x, _ = _features()
        with self.assertRaises(tf.errors.InvalidArgumentError):
            model.fit(
                x,
                np.zeros((_ROWS, 3)),
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM()],
            )

    @parameterized.parameters(None, 8)
    def test_an_error_in_the_step_reads_as_under_keras_own(self, rows):
        # Not wrapped by AutoGraph as "in user code", with frames of
        # tfmemsafe's: Keras does not convert its step either.
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        x, y = np.ones((32, 5), "float32"), np.ones((32, 2), "float32")
        with self.assertRaises(ValueError) as keras_own:
            model.fit(x, y, verbose=0)
        with self.assertRaises(ValueError) as split:
            model.fit(
                x,
                y,
                verbose=0,
                callbacks=[tfmemsafe.SplitBatchOnOOM(micro_batch_size=rows)],
            )
        self.assertEqual(str(split.exception), str(keras_own.exception))

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "`grow_back_after` must"):
            tfmemsafe.SplitBatchOnOOM(grow_back_after=0)
        with self.assertRaisesRegex(ValueError, "`split_batch_norm` must"):
            tfmemsafe.SplitBatchOnOOM(split_batch_norm="yes")
        with self.assertRaisesRegex(
            ValueError,
            r"^`min_micro_batch_size` must be <= `micro_batch_size`.*"
            r"Received: min_micro_batch_size=8, micro_batch_size=4",
        ):
            tfmemsafe.SplitBatchOnOOM(
                micro_batch_size=4, min_micro_batch_size=8
            )


class _TwoOptimizers(keras.Model):
    """A GAN-shaped model: its own `train_step` makes two updates, each
    with an optimizer of its own."""

    def __init__(self, runs_out_above, optimizer=keras.optimizers.SGD):
        super().__init__(name="two_optimizers")
        self.guard = _models.RunsOutAbove(runs_out_above)
        self.first = keras.layers.Dense(4)
        self.second = keras.layers.Dense(1)
        # Built at their first `apply`, as in Keras' GAN guide.
        self.first_optimizer = optimizer(1e-2)
        self.second_optimizer = optimizer(1e-2)
        self.rows_seen = keras.metrics.Sum(name="rows_seen")

    def build(self, input_shape):
        self.first.build(input_shape)
        self.second.build((*input_shape[:-1], 4))

    def call(self, inputs):
        return self.second(self.first(self.guard(inputs)))

    def train_step(self, data):
        x, y = data
        for optimizer, layer in (
            (self.first_optimizer, self.first),
            (self.second_optimizer, self.second),
        ):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x) - y))
            gradients = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(gradients, layer.trainable_variables)
        self.rows_seen.update_state(tf.cast(tf.shape(x)[0], tf.float32))
        return {"loss": loss, "rows_seen": self.rows_seen.result()}

    @property
    def metrics(self):
        return [self.rows_seen]


class CustomTrainStepTest(tf.test.TestCase):
    def test_each_micro_batch_is_a_call_of_the_models_own_step(self):
        x, _ = _features()
        y = x[:, :1]
        model = _TwoOptimizers(20)
        model.build((None, 6))
        model.compile()
        split = tfmemsafe.SplitBatchOnOOM()
        history = model.fit(
            x, y, batch_size=64, verbose=0, shuffle=False, callbacks=[split]
        )
        self.assertNotEmpty(split.oom_events)
        # Every row once; each micro-batch its own two updates.
        self.assertEqual(history.history["rows_seen"], [_ROWS])
        calls = int(model.first_optimizer.iterations)
        self.assertEqual(int(model.second_optimizer.iterations), calls)
        self.assertGreaterEqual(calls, 3 * 2 + 1)
        # Said as it is: each micro-batch made its own update.
        self.assertIn("each its own update", str(split.oom_events[0]))
        self.assertFalse(split.oom_events[0].one_update)

    def test_micro_batches_from_the_start_are_not_its_steps_calls(self):
        x, _ = _features()
        y = x[:, :1]
        model = _TwoOptimizers(10**6)
        model.build((None, 6))
        model.compile()
        split = tfmemsafe.SplitBatchOnOOM(micro_batch_size=16)
        with self.assertLogs(level="WARNING") as logs:
            model.fit(
                x, y, batch_size=64, verbose=0, shuffle=False, callbacks=[split]
            )
        # Whole batches: one update of each optimizer a batch.
        self.assertEqual(int(model.first_optimizer.iterations), 4)
        self.assertEqual(int(model.second_optimizer.iterations), 4)
        self.assertRegex("\n".join(logs.output), "its own `train_step`")

    def test_variables_given_to_a_lazy_optimizer_as_a_generator(self):
        x, _ = _features()
        y = x[:, :1]

        class GeneratorStep(keras.Model):
            def __init__(self):
                super().__init__(name="generator_step")
                self.dense = keras.layers.Dense(1)
                self.own_optimizer = keras.optimizers.SGD(1e-2)

            def call(self, inputs):
                return self.dense(inputs)

            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(self(x) - y))
                variables = self.dense.trainable_variables
                self.own_optimizer.apply(
                    tape.gradient(loss, variables), (v for v in variables)
                )
                return {"loss": loss}

        def fitted(callbacks):
            keras.utils.set_random_seed(2)
            model = GeneratorStep()
            model.compile()
            model.fit(x, y, batch_size=64, verbose=0, callbacks=callbacks)
            return model

        reference = fitted([])
        model = fitted([tfmemsafe.SplitBatchOnOOM()])
        self.assertAllClose(reference.get_weights(), model.get_weights())

    def test_optimizers_its_own_step_builds_train_as_without(self):
        x, _ = _features()
        y = x[:, :1]

        def fitted(callbacks):
            keras.utils.set_random_seed(1)
            model = _TwoOptimizers(10**6, keras.optimizers.Adam)
            model.compile()
            model.fit(
                x,
                y,
                batch_size=64,
                verbose=0,
                shuffle=False,
                callbacks=callbacks,
            )
            return model

        reference = fitted([])
        model = fitted([tfmemsafe.SplitBatchOnOOM()])
        self.assertEqual(int(model.first_optimizer.iterations), 4)
        self.assertAllClose(reference.get_weights(), model.get_weights())
        # And where the first step, which builds them, runs out.
        model = _TwoOptimizers(20, keras.optimizers.Adam)
        model.compile()
        split = tfmemsafe.SplitBatchOnOOM()
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[split])
        self.assertNotEmpty(split.oom_events)
        self.assertGreater(int(model.first_optimizer.iterations), 4)


class MirroredStrategyTest(tf.test.TestCase):
    def test_split_under_two_replicas_matches_the_whole_batch(self):
        result = testing.run_in_subprocess(_mirrored_split)
        self.assertNotEmpty(result["events"])
        self.assertAllClose(result["reference"], result["split"], atol=1e-6)
        # Evaluation and prediction of the same weights, split by replica.
        self.assertAllClose(*result["evaluated"], atol=1e-4)
        self.assertAllClose(*result["predicted"], atol=1e-4)
        # `micro_batch_size` counts rows of the global batch, as
        # `batch_size` does: each replica trains its share of them.
        self.assertEqual(result["preset_events"], [])
        self.assertAllClose(result["reference"], result["preset"], atol=1e-6)

    def test_one_replica_running_out_in_its_backward_pass_is_split(self):
        # The other replica's gradients exist long before: the step is
        # still unchanged, so it is split, not given up as "inside the
        # update".
        result = testing.run_in_subprocess(_mirrored_late_backward_oom)
        self.assertIsNone(result["error"])
        self.assertNotEmpty(result["events"])
        self.assertEqual(result["iterations"], 1)


class _SecondReplicaRunsOutLate(keras.layers.Layer):
    """Passes its input through; its gradient, on the second replica
    and on more than `rows` rows, waits 2 s and then runs out of memory."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, inputs):
        context = tf.distribute.get_replica_context()
        if context is None:  # Keras' symbolic build.
            return inputs
        replica = context.replica_id_in_sync_group

        def check(replica, count):
            if int(replica) == 1 and int(count) > self.rows:
                time.sleep(2)
                raise tf.errors.ResourceExhaustedError(
                    None, None, "OOM when allocating tensor (backward)"
                )
            return np.float32(0.0)

        @tf.custom_gradient
        def identity(x):
            def backward(upstream):
                zero = tf.py_function(
                    check, [replica, tf.shape(x)[0]], tf.float32
                )
                zero.set_shape(())
                return upstream + zero

            return tf.identity(x), backward

        return identity(inputs)

    def compute_output_shape(self, input_shape):
        return input_shape


def _mirrored_late_backward_oom():
    strategy = _models.mirrored_on_two_cpus()
    x, y = _features(64)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                _SecondReplicaRunsOutLate(8),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            "adam",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    split = tfmemsafe.SplitBatchOnOOM()
    error = None
    try:
        model.fit(x, y, batch_size=64, verbose=0, callbacks=[split])
    except tfmemsafe.OutOfMemoryError as err:
        error = str(err)
    return {
        "error": error,
        "events": [str(event) for event in split.oom_events],
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def _mirrored_split():
    """Whole batches; split after running out; and, in micro-batches of 20
    rows of the global batch from the first step, 10 of each replica's 32,
    which fit."""
    strategy = _models.mirrored_on_two_cpus()
    x, y = _features()
    weights, events, evaluated, predicted = [], [], [], []
    for rows, micro in ((None, None), (10, None), (10, 20)):
        with strategy.scope():
            model = _classifier(rows)
        split = tfmemsafe.SplitBatchOnOOM(micro_batch_size=micro)
        model.fit(
            x,
            y,
            batch_size=64,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[split],
        )
        weights.append([w.tolist() for w in model.get_weights()])
        events.append([str(event) for event in split.oom_events])
        if micro is None:
            evaluated.append(
                model.evaluate(
                    x, y, batch_size=64, verbose=0, callbacks=[split]
                )
            )
            predicted.append(
                model.predict(
                    x, batch_size=64, verbose=0, callbacks=[split]
                ).tolist()
            )
    return {
        "reference": weights[0],
        "split": weights[1],
        "events": events[1],
        "evaluated": evaluated,
        "predicted": predicted,
        "preset": weights[2],
        "preset_events": events[2],
    }


def _above(rows):
    """A step's bytes over what was in use: 60 MiB whatever the rows (a
    convolution's workspace) and 0.25 MiB a row."""
    return (60 + rows / 4) * _MIB


class MicroBatchSizeTest(parameterized.TestCase, tf.test.TestCase):
    """The counter's decisions, from measurements given to it."""

    def test_halves_without_statistics(self):
        size = MicroBatchSize(grow_back_after=2, limit_bytes=None)
        self.assertEqual(size.rows_for(64), 64)
        self.assertEqual(size.ran_out(64, None), 32)
        self.assertIsNone(size.probe_rows())
        self.assertEqual(size.ran_out(32, None), 16)
        self.assertIsNone(size.ran_out(1, None))

    def test_a_batch_8x_too_large_costs_one_error(self):
        size = MicroBatchSize(100, limit_bytes=1000 * _MIB)
        # Nothing measured: a probe of a sixteenth, then sized from it.
        size.ran_out(1024, 100 * _MIB)
        self.assertEqual(size.probe_rows(), 64)
        size.measured(64, 100 * _MIB + 64 * _MIB, 100 * _MIB)
        self.assertIsNone(size.probe_rows())
        # 900 MiB usable, 100 in use: 800 rows of 1 MiB.
        self.assertEqual(size.rows_for(1024), 800)

    def test_jumps_by_a_measured_line(self):
        size = MicroBatchSize(100, limit_bytes=1000 * _MIB)
        size.measured(32, 150 * _MIB + 32 * _MIB, 100 * _MIB)  # 50 fixed.
        size.measured(128, 150 * _MIB + 128 * _MIB, 100 * _MIB)
        # (900 - 100 - 50) MiB at 1 MiB a row.
        self.assertEqual(size.ran_out(1024, 100 * _MIB), 750)

    def test_one_size_measured_is_probed_before_smaller_ones(self):
        # One size alone cannot tell `_above`'s two parts apart.
        size = MicroBatchSize(100, limit_bytes=1000 * _MIB)
        size.measured(1024, 100 * _MIB + _above(1024), 100 * _MIB)
        in_use = 700 * _MIB  # 200 of the 900 usable are free.
        # Through the origin, 200 MiB would take 640 rows (260 MiB).
        rows = size.ran_out(1024, in_use)
        self.assertEqual(size.probe_rows(), 64)
        size.measured(64, in_use + _above(64), in_use)
        self.assertIsNone(size.probe_rows())
        # By the line through both: (200 - 60) MiB at 0.25 MiB a row.
        self.assertLess(size.rows, rows)
        self.assertEqual(size.rows, 560)

    def test_a_probe_that_ran_out_is_not_tried_again(self):
        size = MicroBatchSize(100, limit_bytes=1000 * _MIB)
        size.measured(256, 100 * _MIB + _above(256), 100 * _MIB)
        in_use = 850 * _MIB  # 50 of the 900 usable are free.
        size.ran_out(256, in_use)
        self.assertEqual(size.probe_rows(), 16)
        # The probe runs out too: every later attempt starts smaller.
        for failed in (16, 8, 4, 2):
            next_rows = size.ran_out(failed, in_use)
            first = size.probe_rows() or size.rows_for(256)
            self.assertLess(first, failed)
            self.assertLess(next_rows, failed)
        self.assertIsNone(size.ran_out(1, in_use))

    def test_memory_held_past_the_headroom_leaves_what_is_free(self):
        size = MicroBatchSize(100, limit_bytes=1000 * _MIB)
        size.measured(100, 300 * _MIB, 200 * _MIB)  # 1 MiB a row.
        # 950 MiB held: none of the 900 usable is left; half the 50 MiB
        # free.
        self.assertEqual(size.ran_out(256, 950 * _MIB), 25)

    def test_a_grow_back_that_ran_out_waits_twice_as_long(self):
        # As when another process holds memory that no reading shows.
        size = MicroBatchSize(2, limit_bytes=1000 * _MIB)
        size.measured(100, 200 * _MIB, 100 * _MIB)  # 1 MiB a row.
        # Predicted to fit, 512 ran out: the prediction is wrong, halve.
        self.assertEqual(size.ran_out(512, 100 * _MIB), 256)
        for wait in (2, 4, 8):
            for _ in range(wait - 1):
                size.trained()
                self.assertIsNone(size.grow_back_rows(100 * _MIB))
            size.trained()
            self.assertEqual(size.grow_back_rows(100 * _MIB), 512)
            self.assertEqual(size.ran_out(512, 100 * _MIB), 256)
        # The memory was freed: it grows back and stays.
        for _ in range(16):
            size.trained()
        self.assertEqual(size.grow_back_rows(100 * _MIB), 512)
        size.grew_back(512, 512)
        self.assertEqual(size.rows_for(512), 512)

    @parameterized.parameters(100 * _MIB, None)
    def test_a_size_that_keeps_running_out_is_tried_ever_more_rarely(
        self, in_use
    ):
        # Batches of 512 run out at every step but a grow-back's (memory
        # that something else holds between them).
        size = MicroBatchSize(
            2, limit_bytes=None if in_use is None else 1000 * _MIB
        )
        if in_use is not None:
            size.measured(100, 200 * _MIB, 100 * _MIB)  # 1 MiB a row.
        errors = []
        for step in range(64):
            grown = size.grow_back_rows(in_use)
            if grown is not None:
                size.grew_back(grown, 512)  # The grow-back's step trains.
            elif size.rows_for(512) == 512:
                errors.append(step)
                size.ran_out(512, in_use)
            size.trained()
        # The first error; then one at the step after each grow-back,
        # which come after 2, 4, 8 and 16 clean steps.
        self.assertEqual(errors, [0, 3, 8, 17, 34])

    def test_grows_back_after_clean_steps_when_predicted_to_fit(self):
        size = MicroBatchSize(3, limit_bytes=1000 * _MIB)
        size.measured(64, 164 * _MIB, 100 * _MIB)
        size.ran_out(1024, 700 * _MIB)  # Something held 600 MiB more.
        self.assertEqual(size.rows, 200)
        for _ in range(3):
            self.assertIsNone(size.grow_back_rows(700 * _MIB))
            size.trained()
        self.assertIsNone(size.grow_back_rows(700 * _MIB))  # 400 won't fit.
        self.assertEqual(size.grow_back_rows(100 * _MIB), 400)

    def test_without_statistics_a_failed_grow_back_waits_twice_as_long(self):
        size = MicroBatchSize(2, limit_bytes=None)
        size.ran_out(64, None)
        size.trained()
        size.trained()
        self.assertEqual(size.grow_back_rows(None), 64)
        size.ran_out(64, None)  # Still does not fit.
        for _ in range(3):
            size.trained()
            self.assertIsNone(size.grow_back_rows(None))
        size.trained()
        self.assertEqual(size.grow_back_rows(None), 64)


# Under a capped allocator (`RealCapTest`): a conv net whose batch of
# 1024 32x32 images runs out of the cap and whose micro-batches fit.
_CAP_MB = 150
_IMAGES = 2048
_BATCH = 1024


def _images():
    x = np.random.default_rng(0).normal(size=(_IMAGES, 32, 32, 3))
    x = x.astype("float32")
    means = x.mean(axis=(1, 2))
    y = (means[:, 0] > 0).astype("int32") + 2 * (means[:, 1] > 0)
    return x, y


def _conv_net(accumulation_steps=None):
    if accumulation_steps is None:
        return testing.reference_model("conv_net", (32, 32, 3), metrics=None)
    model = _models.worker_conv_net()
    model.accumulation_steps = accumulation_steps
    return model


def _listed(model):
    return [w.tolist() for w in model.get_weights()]


def _capped_fit(kinds, accumulation_steps=None, callback=True):
    """`model.fit` of the conv net on each kind of data in `kinds`, with
    `SplitBatchOnOOM` (or not): the weights, events and calls seen."""
    x, y = _images()
    results = {}
    for kind in kinds:
        model = _conv_net(accumulation_steps)
        split = tfmemsafe.SplitBatchOnOOM()
        recorder = _Batches_seen()
        model.fit(
            verbose=0,
            callbacks=[split, recorder] if callback else [recorder],
            **_fit_arguments(kind, x, y, _BATCH, epochs=2),
        )
        results[kind] = {
            "weights": _listed(model),
            "events": [str(event) for event in split.oom_events],
            "calls": [list(call) for call in recorder.calls],
        }
    return results


def _references():
    """The runs without the callback (uncapped), in one process."""
    return {
        "reference": _capped_fit(
            ["arrays", "py_dataset", "dataset", "generator"], None, False
        ),
        "reference_accumulating": _capped_fit(["arrays"], 2, False),
    }


def _capped_mirrored(callback=True):
    strategy = _models.mirrored_on_two_cpus()
    x, y = _images()
    with strategy.scope():
        model = _conv_net()
    split = tfmemsafe.SplitBatchOnOOM()
    model.fit(
        x,
        y,
        batch_size=_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[split] if callback else [],
    )
    return {
        "weights": _listed(model),
        "events": [str(event) for event in split.oom_events],
    }


def _capped_one_example_too_many():
    """A model one example of which does not fit: 16 rows run out, and so
    does one."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(4),
            # 256 MiB a row, and no weight of that size.
            keras.layers.Lambda(
                lambda t: tf.reduce_mean(
                    tf.tile(t, [1, 16 * 2**20]), axis=1, keepdims=True
                )
            ),
        ]
    )
    model.compile("adam", "mse")
    x = np.ones((16, 32), "float32")
    before = _listed(model)
    try:
        model.fit(
            x,
            np.zeros((16, 1)),
            batch_size=16,
            verbose=0,
            callbacks=[tfmemsafe.SplitBatchOnOOM()],
        )
    except tfmemsafe.OutOfMemoryError as err:
        return {
            "error": str(err),
            "cause": type(err.__cause__).__name__,
            "unchanged": before == _listed(model),
        }
    return {"error": None}


class RealCapTest(tf.test.TestCase):
    """A real `ResourceExhaustedError` from a capped CPU allocator, in
    plain `model.fit` with the callback; beside the same runs uncapped
    without it."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # Side by side, each in its own process: most of their time is
        # the allocator's ten-second waits, which need no CPU.
        capped = {
            "arrays": (_capped_fit, (["arrays", "py_dataset"],)),
            "dataset": (_capped_fit, (["dataset", "generator"],)),
            "accumulating": (_capped_fit, (["arrays"], 2)),
            "mirrored": (_capped_mirrored, ()),
            "too_big": (_capped_one_example_too_many, ()),
        }
        uncapped = {
            "references": (_references, ()),
            "reference_mirrored": (_capped_mirrored, (False,)),
        }
        cls._pool = concurrent.futures.ThreadPoolExecutor(
            len(capped) + len(uncapped)
        )
        cls._results = {
            name: cls._pool.submit(
                testing.run_with_memory_cap, target, _CAP_MB, args=args
            )
            for name, (target, args) in capped.items()
        }
        cls._results.update(
            {
                name: cls._pool.submit(
                    testing.run_in_subprocess, target, args=args
                )
                for name, (target, args) in uncapped.items()
            }
        )

    @classmethod
    def tearDownClass(cls):
        cls._pool.shutdown(wait=True)
        super().tearDownClass()

    def result(self, name):
        return self._results[name].result()

    def _matches_the_reference(self, result, reference):
        self.assertNotEmpty(result["events"], msg=result["events"])
        self.assertIn("micro-batches for one update", result["events"][0])
        for got, expected in zip(
            result["weights"], reference["weights"], strict=True
        ):
            self.assertAllClose(expected, got, atol=1e-5, rtol=1e-4)

    def test_every_data_kind_recovers_to_the_whole_batchs_weights(self):
        reference = self.result("references")["reference"]
        for name, kinds in (
            ("arrays", ("arrays", "py_dataset")),
            ("dataset", ("dataset", "generator")),
        ):
            result = self.result(name)
            for kind in kinds:
                with self.subTest(kind=kind):
                    self._matches_the_reference(result[kind], reference[kind])
                    # Each callback call once, as without running out.
                    self.assertEqual(
                        [call[:2] for call in result[kind]["calls"]],
                        [call[:2] for call in reference[kind]["calls"]],
                    )

    def test_accumulating_model_recovers_to_the_whole_batchs_weights(self):
        self._matches_the_reference(
            self.result("accumulating")["arrays"],
            self.result("references")["reference_accumulating"]["arrays"],
        )

    def test_mirrored_strategy_recovers_to_the_whole_batchs_weights(self):
        self._matches_the_reference(
            self.result("mirrored"), self.result("reference_mirrored")
        )

    def test_one_example_that_runs_out_stops_with_the_model_unchanged(self):
        result = self.result("too_big")
        self.assertIsNotNone(result["error"])
        self.assertIn("even as micro-batches of one example", result["error"])
        # Keras raises from `fit` with `from None`: the allocator's error
        # is named in the message.
        self.assertIn("OOM when allocating", result["error"])
        self.assertTrue(result["unchanged"])


if __name__ == "__main__":
    tf.test.main()
