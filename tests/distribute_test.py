"""Tests for training beyond one machine: MultiWorkerMirroredStrategy.

Each test starts a cluster of two worker processes on localhost with
`tfmemsafe.testing.run_workers` (free loopback ports, TF_CONFIG, CPU
only). Workers that outlive the test's timeout are killed.
"""

import shutil
import tempfile

import _models
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import distribute
from tfmemsafe import testing
from tfmemsafe.recovery import _backup

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


def _model(accumulation_steps):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
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
    }


def _train_both_ways(multi_worker, epochs=2):
    """Trains with model.fit and with tfmemsafe.fit; reports both."""
    strategy = _strategy(multi_worker)
    x, y = _data()
    with strategy.scope():
        keras_model = _model(accumulation_steps=2)
        ours = _model(accumulation_steps=2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(_GLOBAL_BATCH)
        .with_options(options)
    )
    keras_history = keras_model.fit(dataset, epochs=epochs, verbose=0)
    our_history = tfmemsafe.fit(
        ours,
        (x, y),
        batch_size=_GLOBAL_BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )
    return {
        "model.fit": _report(keras_model, keras_history),
        "tfmemsafe.fit": _report(ours, our_history),
        "worker": distribute.worker_index(strategy),
        "multi_worker": distribute.is_multi_worker(strategy),
    }


def _plain_keras_model_fit():
    """What Keras 3 does with a plain keras.Model under the strategy."""
    import keras

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
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
            _train_both_ways, args=[False], env=_CPU_ONLY, timeout=_TIMEOUT
        )
        cls.workers = testing.run_workers(
            _train_both_ways, 2, args=[True], env=_CPU_ONLY, timeout=_TIMEOUT
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

    def test_keras_alone_still_fails_here(self):
        # When this fails, Keras has fixed the upstream bug and the
        # workaround in tfmemsafe.distribute can go.
        errors = testing.run_workers(
            _plain_keras_model_fit, 2, env=_CPU_ONLY, timeout=_TIMEOUT
        )
        for error in errors:
            self.assertIsNotNone(error)
            self.assertIn("PerReplica", error)


def _train_with_backup(batch_size, backup_dir, hog_mb=0, epochs=3):
    """Trains a conv net; worker 1 fills its memory at epoch 1 if asked."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    hog = _models.MemoryHog(hog_mb, distribute.worker_index(strategy))
    x, y = _models.worker_images()
    with strategy.scope():
        model = _models.worker_conv_net()
    try:
        history = tfmemsafe.fit(
            model,
            (x, y),
            batch_size=batch_size,
            epochs=epochs,
            callbacks=[
                distribute.MultiWorkerBackupAndRestore(backup_dir),
                hog,
            ],
            shuffle=False,
            verbose=0,
        )
    except tfmemsafe.OutOfMemoryError as err:
        return {"error": str(err)}
    return {
        "loss": history.history["loss"],
        "finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
    }


class MultiWorkerOutOfMemoryTest(tf.test.TestCase):
    def test_one_workers_oom_stops_all_and_a_restart_resumes(self):
        backup_dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, backup_dir, ignore_errors=True)
        capped = testing.memory_cap_environment(300)
        failed = testing.run_workers(
            _train_with_backup,
            2,
            args=[64, backup_dir],
            kwargs={"hog_mb": 290},
            env=_CPU_ONLY,
            worker_env=[{}, capped],
            timeout=_TIMEOUT,
        )
        for result in failed:
            self.assertIn("Out of memory on worker 1 of 2", result["error"])
            self.assertIn("MultiWorkerBackupAndRestore", result["error"])
        # Worker 0 stopped on worker 1's report (which names worker 1),
        # not after its own collective timed out.
        self.assertEqual(failed[0]["error"], failed[1]["error"])
        resumed = testing.run_workers(
            _train_with_backup,
            2,
            args=[32, backup_dir],
            env=_CPU_ONLY,
            timeout=_TIMEOUT,
        )
        for result in resumed:
            # Epoch 0 was backed up before the OOM; epochs 1 and 2 remain.
            self.assertLen(result["loss"], 2)
            self.assertTrue(result["finite"])


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


class StoredDecisionTest(tf.test.TestCase):
    """The size a stopped job stores with its backup, read on restart."""

    def _decisions(self, planned):
        import keras

        backup = keras.callbacks.BackupAndRestore(self.get_temp_dir())
        return _backup.Decisions([backup], planned=planned)

    def test_a_memory_plan_applies_in_proportion_to_the_new_plan(self):
        # Stopped at 146 (the first bucket's batch), halved to 73; the
        # restart planned 150 for the first bucket.
        self._decisions(planned=True).store(146, [146, 73], 4)
        tried, steps, _ = self._decisions(planned=True).load(150)
        self.assertEqual((tried, steps), ([150, 75], 4))

    def test_another_batch_size_or_kind_of_run_ignores_the_stored_one(self):
        self._decisions(planned=False).store(256, [256, 128], None)
        with self.assertLogs(level="WARNING") as logs:
            self.assertIsNone(self._decisions(planned=False).load(512))
            self.assertIsNone(self._decisions(planned=True).load(256))
        self.assertIn("decided for batch_size=256", logs.output[0])
        self.assertIn("this run asks for auto", logs.output[1])
        tried, _, _ = self._decisions(planned=False).load(256)
        self.assertEqual(tried, [256, 128])


if __name__ == "__main__":
    tf.test.main()
