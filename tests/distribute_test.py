"""Tests for training beyond one machine: MultiWorkerMirroredStrategy.

Each test starts a cluster of two worker processes on localhost with
`tfmemsafe.testing.run_workers` (free loopback ports, TF_CONFIG, CPU
only). Workers that outlive the test's timeout are killed.
"""

import _models
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import distribute
from tfmemsafe import testing

_GLOBAL_BATCH = 8
_SAMPLES = 72  # 9 global batches: windows of 2 leave one to flush.
_CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
_TIMEOUT = 300


def _strategy(multi_worker):
    if multi_worker:
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def _data():
    rng = np.random.default_rng(0)
    x = rng.random((_SAMPLES, 4)).astype("float32")
    y = rng.random((_SAMPLES, 1)).astype("float32")
    return x, y


def _model(accumulation_steps, runs_out_above=None):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = _models.RunsOutAbove(runs_out_above)(inputs)
    hidden = keras.layers.Dense(8, activation="relu")(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = tfmemsafe.AccumulatingModel(
        inputs, outputs, accumulation_steps=accumulation_steps
    )
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    return model


def _report(model, history):
    return {
        "loss": history.history["loss"],
        "mae": history.history["mae"],
        "weights": [w.tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "split_into": [
            event.split_into for event in getattr(history, "oom_events", [])
        ],
    }


def _train_every_way(multi_worker, epochs=2):
    """Trains with model.fit and with tfmemsafe.fit; on several workers
    also with tfmemsafe.fit where worker 1's replica runs out of memory on
    more than 2 rows (its 4 of each batch of 8), and Keras' own model.fit
    of a plain keras.Model. Reports each."""
    strategy = _strategy(multi_worker)
    worker = distribute.worker_index(strategy)
    report = {
        "model.fit": _keras_fit(strategy, epochs),
        "tfmemsafe.fit": _tfmemsafe_fit(strategy, epochs),
        "worker": worker,
        "multi_worker": distribute.is_multi_worker(strategy),
    }
    if multi_worker:
        report["split"] = _tfmemsafe_fit(
            strategy, epochs, runs_out_above=2 if worker == 1 else None
        )
        report["plain keras"] = _plain_keras_model_fit(strategy)
    return report


def _keras_fit(strategy, epochs):
    x, y = _data()
    with strategy.scope():
        model = _model(accumulation_steps=2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(_GLOBAL_BATCH)
        .with_options(options)
    )
    return _report(model, model.fit(dataset, epochs=epochs, verbose=0))


def _tfmemsafe_fit(strategy, epochs, runs_out_above=None):
    x, y = _data()
    with strategy.scope():
        model = _model(accumulation_steps=2, runs_out_above=runs_out_above)
    history = tfmemsafe.fit(
        model,
        (x, y),
        batch_size=_GLOBAL_BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return _report(model, history)


def _plain_keras_model_fit(strategy):
    """The first line of the error Keras 3 gives a plain keras.Model under
    the strategy, or `None`."""
    import keras

    x, y = _data()
    with strategy.scope():
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse")
    try:
        model.fit(x, y, batch_size=_GLOBAL_BATCH, epochs=1, verbose=0)
    except ValueError as err:
        return str(err).splitlines()[0]
    return None


class MultiWorkerTrainingTest(parameterized.TestCase, tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.reference = testing.run_in_subprocess(
            _train_every_way, args=[False], env=_CPU_ONLY, timeout=_TIMEOUT
        )
        cls.workers = testing.run_workers(
            _train_every_way, 2, args=[True], env=_CPU_ONLY, timeout=_TIMEOUT
        )

    def test_workers_know_their_place(self):
        self.assertFalse(self.reference["multi_worker"])
        self.assertEqual([w["worker"] for w in self.workers], [0, 1])
        self.assertTrue(all(w["multi_worker"] for w in self.workers))

    @parameterized.named_parameters(
        ("model_fit", "model.fit"), ("tfmemsafe_fit", "tfmemsafe.fit")
    )
    def test_two_workers_end_equal_to_one_process(self, how):
        expected = self.reference[how]
        for worker in self.workers:
            result = worker[how]
            for got, want in zip(
                result["weights"], expected["weights"], strict=True
            ):
                self.assertAllClose(got, want, atol=1e-5, rtol=1e-5)
            self.assertAllClose(result["loss"], expected["loss"], atol=1e-5)
            self.assertAllClose(result["mae"], expected["mae"], atol=1e-5)

    @parameterized.named_parameters(
        ("model_fit", "model.fit"), ("tfmemsafe_fit", "tfmemsafe.fit")
    )
    def test_accumulated_updates_are_counted_once_per_window(self, how):
        # 9 micro-batches an epoch in windows of 2: 4 full windows and one
        # flushed at the end of the epoch, over 2 epochs.
        for worker in self.workers:
            self.assertEqual(worker[how]["iterations"], 10)
        self.assertEqual(self.reference[how]["iterations"], 10)

    def test_one_workers_oom_splits_the_batch_alike_on_every_worker(self):
        expected = self.reference["model.fit"]
        for worker in self.workers:
            result = worker["split"]
            for got, want in zip(
                result["weights"], expected["weights"], strict=True
            ):
                self.assertAllClose(got, want, atol=1e-5, rtol=1e-5)
            self.assertAllClose(result["loss"], expected["loss"], atol=1e-5)
            self.assertEqual(result["iterations"], 10)
            self.assertNotEmpty(result["split_into"])
        self.assertEqual(
            self.workers[0]["split"]["split_into"],
            self.workers[1]["split"]["split_into"],
        )

    def test_keras_alone_still_fails_here(self):
        # When this fails, Keras has fixed the upstream bug and the
        # workaround in tfmemsafe.distribute can go.
        for worker in self.workers:
            self.assertIsNotNone(worker["plain keras"])
            self.assertIn("PerReplica", worker["plain keras"])


def _one_worker_stops_the_job():
    """Worker 1 runs out and stops the job while worker 0 waits for it in
    an all-reduce; each returns the error `stop_all_workers` gives it."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    if distribute.worker_index(strategy) == 1:
        err = tf.errors.ResourceExhaustedError(
            None, None, "OOM when allocating"
        )
        return str(distribute.stop_all_workers(err, 64, strategy))
    try:
        strategy.reduce(
            "SUM", strategy.run(lambda: tf.constant(1.0)), axis=None
        )
    except Exception as err:  # noqa: BLE001 (the error is the result)
        return str(distribute.stop_all_workers(err, 64, strategy))
    return "the all-reduce finished"


class StopAllWorkersTest(tf.test.TestCase):
    def test_one_worker_stops_every_worker_with_its_words(self):
        results = testing.run_workers(_one_worker_stops_the_job, 2, timeout=300)
        self.assertLen(results, 2)
        for result in results:
            self.assertStartsWith(
                result, "Out of memory on worker 1 of 2 at global batch size 64"
            )
            self.assertIn("(for example 32)", result)

    def test_alone_it_says_how_to_restart(self):
        err = tf.errors.ResourceExhaustedError(
            None, None, "OOM when allocating"
        )
        with self.assertLogs(level="WARNING"):
            stopped = distribute.stop_all_workers(err, 64)
        self.assertIsInstance(stopped, tfmemsafe.OutOfMemoryError)
        self.assertStartsWith(
            str(stopped),
            "Out of memory on worker 0 of 1 at global batch size 64",
        )


class HelpersTest(tf.test.TestCase):
    def test_one_process_is_not_multi_worker(self):
        self.assertFalse(distribute.is_multi_worker())
        self.assertEqual(distribute.worker_index(), 0)
        self.assertTrue(distribute.is_chief())
        mirrored = tf.distribute.MirroredStrategy(["CPU:0"])
        self.assertFalse(distribute.is_multi_worker(mirrored))

    def test_run_workers_refuses_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, r"`num_workers` must be"):
            testing.run_workers(_data, 0)
        with self.assertRaisesRegex(ValueError, r"`worker_env` must have"):
            testing.run_workers(_data, 2, worker_env=[{}])


if __name__ == "__main__":
    tf.test.main()
