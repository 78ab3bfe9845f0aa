"""Tests for tfmemsafe.MemoryMonitor in real `fit` runs on the CPU."""

import csv
import functools
import glob
import math
import os
import sys
import tempfile
from unittest import mock

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import monitor as monitor_lib
from tfmemsafe import testing
from tfmemsafe.monitor import _memory_report
from tfmemsafe.monitor import _sample_writers

# TensorFlow's BFC allocator on the CPU: exact, repeatable peaks.
_BFC_ENV = {
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "CUDA_VISIBLE_DEVICES": "",
}


def _conv_net():
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def _data(count):
    rng = np.random.default_rng(0)
    x = rng.random((count, 32, 32, 3), dtype=np.float32)
    return x, rng.integers(0, 10, count)


# Work run in fresh processes (environment read at TensorFlow's import).


def _peaks_for_batch_sizes(batch_sizes):
    x, y = _data(256)
    peaks = {}
    for batch_size in batch_sizes:
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        history = _conv_net().fit(
            x, y, batch_size=batch_size, verbose=0, callbacks=[monitor]
        )
        peaks[str(batch_size)] = history.history["memory_peak_mb"][0]
    return peaks


class _AllocateInFirstEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 0 and batch == 0:
            big = tf.ones((40, 1024, 1024))  # 160 MiB, freed at once.
            del big


def _epoch_peaks_after_a_spike_in_the_first():
    x, y = _data(256)
    monitor = tfmemsafe.MemoryMonitor(verbose=0)
    history = _conv_net().fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        verbose=0,
        callbacks=[_AllocateInFirstEpoch(), monitor],
    )
    return history.history["memory_peak_mb"]


def _bfc_allocator_readings():
    # Before TensorFlow initialises its devices: two logical CPUs for the
    # MirroredStrategy run (the others, with no strategy, read CPU:0).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return {
        "peaks_by_batch_size": _peaks_for_batch_sizes([16, 256]),
        "epoch_peaks_after_spike": _epoch_peaks_after_a_spike_in_the_first(),
        "mirrored": _mirrored_fit(),
    }


@functools.cache
def _readings_in_a_bfc_process():
    """One fresh process for the tests that read exact, uncapped peaks."""
    return testing.run_in_subprocess(_bfc_allocator_readings, env=_BFC_ENV)


def _warnings_under_cap(warn_at_values):
    x, y = _data(512)
    warnings = []
    for warn_at in warn_at_values:
        with _models.absl_messages() as messages:
            _conv_net().fit(
                x,
                y,
                batch_size=256,
                epochs=2,
                verbose=0,
                callbacks=[tfmemsafe.MemoryMonitor(warn_at=warn_at)],
            )
        warnings.append([m for m in messages if m.startswith("MemoryMonitor")])
    return warnings


def _retry_after_oom():
    x, y = _data(1024)
    csv_path = os.path.join(tempfile.mkdtemp(), "memory.csv")
    monitor = tfmemsafe.MemoryMonitor(csv_path=csv_path, verbose=0)
    model = _conv_net()
    try:
        model.fit(x, y, batch_size=1024, verbose=0, callbacks=[monitor])
    except tf.errors.ResourceExhaustedError:
        oom = True
    else:
        oom = False
    peak_at_oom = tfmemsafe.memory_info("CPU:0").peak_mb
    x, y = x[:256], y[:256]
    history = model.fit(
        x, y, batch_size=64, epochs=2, verbose=0, callbacks=[monitor]
    )
    with open(csv_path) as f:
        csv_rows = len(list(csv.DictReader(f)))
    return {
        "oom": oom,
        "peak_at_oom": peak_at_oom,
        "history": history.history["memory_peak_mb"],
        "samples": [[s.epoch, s.batch, s.phase] for s in monitor.samples],
        "csv_rows": csv_rows,
    }


def _readings_under_a_300_mb_cap():
    return {
        "warnings": _warnings_under_cap([0.3, 0.9]),
        "retry_after_oom": _retry_after_oom(),
    }


@functools.cache
def _readings_in_a_capped_process():
    """One fresh process whose CPU allocator is capped at 300 MB."""
    return testing.run_with_memory_cap(_readings_under_a_300_mb_cap, 300)


def _mirrored_fit():
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = _conv_net()
    monitor = tfmemsafe.MemoryMonitor(verbose=0)
    x, y = _data(128)
    history = model.fit(x, y, batch_size=32, verbose=0, callbacks=[monitor])
    return {
        "logs": {k: v[0] for k, v in history.history.items()},
        "devices": sorted({s.device for s in monitor.samples}),
    }


def _fit_without_allocator_statistics():
    x, y = _data(128)
    monitor = tfmemsafe.MemoryMonitor()
    with _models.absl_messages() as messages:
        history = _conv_net().fit(
            x, y, batch_size=32, epochs=2, verbose=0, callbacks=[monitor]
        )
    return {
        "peaks": history.history["memory_peak_mb"],
        "sources": sorted({s.source for s in monitor.samples}),
        "positive": all(s.current_mb > 0 for s in monitor.samples),
        "summary": monitor.summary(),
        "warnings": messages,
    }


class _OneRunCallbackList(keras.callbacks.CallbackList):
    """Several `fit` calls as one run, as `tfmemsafe.fit` retries are."""

    started = False

    def on_train_begin(self, logs=None):
        if not self.started:
            self.started = True
            super().on_train_begin(logs)


class _FailOnce(keras.callbacks.Callback):
    """Raises an out-of-memory error once, at epoch 1, batch 2."""

    failed = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 2 and not self.failed:
            self.failed = True
            raise tf.errors.ResourceExhaustedError(None, None, "OOM")


class MemoryMonitorTest(parameterized.TestCase, tf.test.TestCase):
    def _fit(self, monitor, epochs=1, count=128, extra_callbacks=(), **kw):
        x, y = _data(count)
        return _conv_net().fit(
            x,
            y,
            batch_size=kw.pop("batch_size", 32),
            epochs=epochs,
            verbose=0,
            callbacks=[monitor, *extra_callbacks],
            **kw,
        )

    def test_epoch_logs_hold_positive_memory_every_epoch(self):
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        history = self._fit(monitor, epochs=3)
        peaks = history.history["memory_peak_mb"]
        currents = history.history["memory_current_mb"]
        self.assertLen(peaks, 3)
        self.assertLen(currents, 3)
        for peak, current in zip(peaks, currents, strict=True):
            self.assertGreater(current, 0)
            self.assertGreaterEqual(peak, current)
        # One device: no per-device keys.
        self.assertEmpty(
            [k for k in history.history if k.startswith("memory_peak_mb_")]
        )

    @parameterized.named_parameters(
        ("every_batch", 1), ("every_third", 3), ("every_fourth", 4)
    )
    def test_samples_follow_every_n_batches(self, every_n_batches):
        monitor = tfmemsafe.MemoryMonitor(
            every_n_batches=every_n_batches, verbose=0
        )
        # 7 training and 3 validation batches per epoch.
        x_val, y_val = _data(24)
        self._fit(
            monitor,
            epochs=2,
            count=56,
            batch_size=8,
            validation_data=(x_val, y_val),
        )
        counts = {}
        for sample in monitor.samples:
            key = (sample.phase, sample.epoch)
            counts[key] = counts.get(key, 0) + 1
        train, val = (
            math.ceil(7 / every_n_batches),
            math.ceil(3 / every_n_batches),
        )
        self.assertEqual(
            counts,
            {
                ("train", 0): train,
                ("train", 1): train,
                ("evaluate", 0): val,
                ("evaluate", 1): val,
            },
        )
        train_steps = [s.step for s in monitor.samples if s.phase == "train"]
        self.assertEqual(
            train_steps,
            [s for s in range(14) if s % 7 % every_n_batches == 0],
        )

    def test_callbacks_listed_after_it_see_the_memory_keys(self):
        csv_path = os.path.join(self.get_temp_dir(), "epochs.csv")
        csv_logger = keras.callbacks.CSVLogger(csv_path)
        # Stops after epoch 1 if and only if it can read memory_peak_mb.
        early_stopping = keras.callbacks.EarlyStopping(
            monitor="memory_peak_mb", mode="max", min_delta=1e9, patience=1
        )
        history = self._fit(
            tfmemsafe.MemoryMonitor(verbose=0),
            epochs=5,
            extra_callbacks=[csv_logger, early_stopping],
        )
        self.assertEqual(history.epoch, [0, 1])
        self.assertEqual(
            early_stopping.best, history.history["memory_peak_mb"][0]
        )
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertLen(rows, 2)
        self.assertAllClose(
            [float(row["memory_peak_mb"]) for row in rows],
            history.history["memory_peak_mb"],
        )

    def test_monitors_first_orders_a_plain_fit_list_for_its_keys(self):
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        csv_path = os.path.join(self.get_temp_dir(), "ordered.csv")
        csv_logger = keras.callbacks.CSVLogger(csv_path)
        ordered = monitor_lib.monitors_first([csv_logger, monitor])
        self.assertEqual(ordered, [monitor, csv_logger])
        x, y = _data(64)
        _conv_net().fit(x, y, batch_size=32, verbose=0, callbacks=ordered)
        with open(csv_path) as f:
            self.assertIn("memory_peak_mb", next(csv.DictReader(f)))

    def test_tfmemsafe_fit_puts_the_monitor_before_callbacks_using_it(self):
        # Listed last: tfmemsafe.fit moves it before the callbacks that read
        # memory_peak_mb; model.fit would not.
        csv_path = os.path.join(self.get_temp_dir(), "epochs.csv")
        csv_logger = keras.callbacks.CSVLogger(csv_path)
        early_stopping = keras.callbacks.EarlyStopping(
            monitor="memory_peak_mb", mode="max", min_delta=1e9, patience=1
        )
        x, y = _data(128)
        history = tfmemsafe.fit(
            _conv_net(),
            (x, y),
            batch_size=32,
            epochs=5,
            verbose=0,
            callbacks=[
                csv_logger,
                early_stopping,
                tfmemsafe.MemoryMonitor(verbose=0),
            ],
        )
        self.assertEqual(history.epoch, [0, 1])
        self.assertEqual(
            early_stopping.best, history.history["memory_peak_mb"][0]
        )
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertAllClose(
            [float(row["memory_peak_mb"]) for row in rows],
            history.history["memory_peak_mb"],
        )

    def test_reuse_across_fit_calls_starts_fresh(self):
        csv_path = os.path.join(self.get_temp_dir(), "memory.csv")
        monitor = tfmemsafe.MemoryMonitor(csv_path=csv_path, verbose=0)
        self._fit(monitor, epochs=3)
        history = self._fit(monitor, epochs=1, count=64)
        self.assertLen(history.history["memory_peak_mb"], 1)
        self.assertEqual(
            [(s.epoch, s.batch) for s in monitor.samples], [(0, 0), (0, 1)]
        )
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual([row["batch"] for row in rows], ["0", "1"])
        rows = [line.split()[0] for line in monitor.summary().splitlines()]
        self.assertEqual(rows[2:], ["0", "limit"])

    def test_retries_that_are_one_run_continue_the_readings(self):
        csv_path = os.path.join(self.get_temp_dir(), "memory.csv")
        monitor = tfmemsafe.MemoryMonitor(csv_path=csv_path, verbose=0)
        model = _conv_net()
        x, y = _data(128)
        callbacks = _OneRunCallbackList(
            [monitor, _FailOnce()], add_history=True, model=model
        )
        with self.assertRaises(tf.errors.ResourceExhaustedError):
            model.fit(
                x, y, batch_size=32, epochs=2, verbose=0, callbacks=callbacks
            )
        history = model.fit(
            x,
            y,
            batch_size=32,
            epochs=2,
            initial_epoch=1,
            verbose=0,
            callbacks=callbacks,
        )
        self.assertEqual(
            [(s.epoch, s.batch, s.step) for s in monitor.samples],
            [(0, b, b) for b in range(4)]
            + [(1, b, 4 + b) for b in range(3)]  # Failed at batch 2.
            + [(1, b, 7 + b) for b in range(4)],  # The resumed epoch.
        )
        self.assertLen(history.history["memory_peak_mb"], 2)
        rows = [line.split()[0] for line in monitor.summary().splitlines()]
        self.assertEqual(rows[2:], ["0", "1", "limit"])
        with open(csv_path) as f:
            self.assertLen(list(csv.DictReader(f)), 11)
        figure = monitor.plot()
        boundaries = [
            line.get_xdata()[0]
            for line in figure.axes[0].get_lines()
            if line.get_color() == "0.85"
        ]
        self.assertEqual(boundaries, [3.5, 6.5])

    def test_log_dir_gets_a_scalar_per_reading(self):
        log_dir = self.get_temp_dir()
        monitor = tfmemsafe.MemoryMonitor(log_dir=log_dir, verbose=0)
        self._fit(monitor, epochs=2, count=64)
        events = {}
        for path in glob.glob(os.path.join(log_dir, "memory", "events.*")):
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                for value in event.summary.value:
                    events.setdefault(value.tag, {})[event.step] = float(
                        tf.make_ndarray(value.tensor)
                    )
                    self.assertEqual(
                        value.metadata.plugin_data.plugin_name, "scalars"
                    )
        peaks = events["memory_peak_mb/train/CPU_0"]
        self.assertEqual(sorted(peaks), [0, 1, 2, 3])
        self.assertAllClose(
            [peaks[s.step] for s in monitor.samples],
            [s.peak_mb for s in monitor.samples],
        )
        self.assertLen(events["memory_current_mb/train/CPU_0"], 4)

    def test_csv_path_gets_a_row_per_reading(self):
        csv_path = os.path.join(self.get_temp_dir(), "sub", "memory.csv")
        monitor = tfmemsafe.MemoryMonitor(csv_path=csv_path, verbose=0)
        self._fit(monitor, epochs=2, count=64)
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(list(rows[0]), list(_sample_writers.CSV_FIELDS))
        self.assertEqual(
            [(r["epoch"], r["batch"], r["phase"]) for r in rows],
            [("0", "0", "train"), ("0", "1", "train")]
            + [("1", "0", "train"), ("1", "1", "train")],
        )
        self.assertAllClose(
            [float(r["peak_mb"]) for r in rows],
            [s.peak_mb for s in monitor.samples],
        )

    def test_evaluate_and_predict_outside_fit_add_their_readings(self):
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        x, y = _data(64)
        model = _conv_net()
        model.fit(x, y, batch_size=32, verbose=0, callbacks=[monitor])
        model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[monitor])
        model.predict(x, batch_size=16, verbose=0, callbacks=[monitor])
        phases = [(s.phase, s.epoch) for s in monitor.samples]
        self.assertEqual(
            phases,
            [("train", 0)] * 2
            + [("evaluate", None)] * 2
            + [("predict", None)] * 4,
        )
        rows = [line.split()[0] for line in monitor.summary().splitlines()]
        self.assertEqual(rows[2:], ["0", "evaluate", "predict", "limit"])

    def test_plot_writes_a_png(self):
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        self._fit(monitor, epochs=2, count=64)
        path = os.path.join(self.get_temp_dir(), "memory.png")
        figure = monitor.plot(path)
        with open(path, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        import matplotlib.image

        self.assertEqual(matplotlib.image.imread(path).shape, (450, 800, 4))
        legend = [t.get_text() for t in figure.axes[0].get_legend().texts]
        self.assertIn("CPU:0", legend)

    def test_plot_without_matplotlib_names_the_extra(self):
        monitor = tfmemsafe.MemoryMonitor(verbose=0)
        self._fit(monitor, count=32)
        hidden = {"matplotlib": None, "matplotlib.figure": None}
        with mock.patch.dict(sys.modules, hidden):
            with self.assertRaisesRegex(
                ImportError,
                r"`MemoryMonitor.plot\(\)` requires matplotlib.*"
                r"pip install tfmemsafe\[plot\]",
            ):
                monitor.plot()

    def test_plot_without_readings_says_which_phases_have_some(self):
        with self.assertRaisesRegex(ValueError, "`phase` has no readings"):
            tfmemsafe.MemoryMonitor().plot(phase="train")

    def test_summary_before_any_run_says_there_is_nothing(self):
        self.assertStartsWith(
            tfmemsafe.MemoryMonitor().summary(), "MemoryMonitor: no readings"
        )

    def test_device_that_does_not_exist_is_refused_when_training_starts(
        self,
    ):
        if tf.config.list_logical_devices("GPU"):
            self.skipTest("GPU:0 exists here")
        model = _conv_net()
        weights = [w.numpy() for w in model.weights]
        monitor = tfmemsafe.MemoryMonitor(devices=["CPU:0", "GPU:7"])
        x, y = _data(32)
        with self.assertRaisesRegex(
            ValueError,
            r"^`devices` must name devices that this process has; GPU:7 is "
            r"not among them \(CPU:0.*\). Received: devices=\['CPU:0', "
            r"'GPU:7'\]",
        ):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[monitor])
        self.assertAllClose([w.numpy() for w in model.weights], weights)
        with self.assertRaisesRegex(ValueError, r"^`devices` must name"):
            model.evaluate(x, y, verbose=0, callbacks=[monitor])

    def test_setup_declares_the_tensorboard_extra_keras_needs(self):
        # keras.callbacks.TensorBoard imports `tensorboard`, which
        # TensorFlow 2.21 no longer installs.
        import configparser

        setup = configparser.ConfigParser()
        setup.read(os.path.join(os.path.dirname(__file__), "..", "setup.cfg"))
        extras = setup["options.extras_require"]
        self.assertIn("tensorboard", extras["tensorboard"].split())

    def test_summary_of_a_run_without_readings_does_not_blame_the_user(self):
        text = _memory_report.summary(
            {}, {}, ["GPU:0: not monitored (no statistics)."], started=True
        )
        self.assertStartsWith(
            text,
            "MemoryMonitor: no readings: none of the monitored devices keeps "
            "memory statistics.",
        )
        self.assertNotIn("Pass it to fit()", text)
        self.assertIn("GPU:0: not monitored", text)

    @parameterized.named_parameters(
        ("zero_batches", {"every_n_batches": 0}, "`every_n_batches` must"),
        ("float_batches", {"every_n_batches": 2.0}, "`every_n_batches` must"),
        ("warn_above_one", {"warn_at": 1.5}, "`warn_at` must"),
        ("warn_at_zero", {"warn_at": 0}, "`warn_at` must"),
        ("bad_device", {"devices": "TPU"}, "`devices` must be None"),
        ("no_devices", {"devices": []}, "`devices` must name"),
        ("verbose_two", {"verbose": 2}, "`verbose` must be 0 or 1"),
    )
    def test_invalid_arguments_raise_keras_style_errors(self, kwargs, start):
        with self.assertRaisesRegex(ValueError, "^" + start):
            tfmemsafe.MemoryMonitor(**kwargs)

    def test_devices_are_normalised(self):
        monitor = tfmemsafe.MemoryMonitor(
            devices=["/job:localhost/replica:0/task:0/device:CPU:0", "cpu:0"]
        )
        self.assertEqual(monitor.devices, ["CPU:0"])

    # Fresh processes: allocator settings, logical devices, memory caps.

    def test_peak_grows_with_the_batch_size(self):
        peaks = _readings_in_a_bfc_process()["peaks_by_batch_size"]
        self.assertGreater(peaks["256"], 1.5 * peaks["16"])

    def test_each_epoch_has_its_own_peak(self):
        first, second = _readings_in_a_bfc_process()["epoch_peaks_after_spike"]
        # The epoch itself peaks near 80 MB.
        self.assertGreater(first, 160)
        self.assertLess(second, first - 60)

    def test_warning_fires_once_per_epoch_past_warn_at_of_the_cap(self):
        # The conv net at batch 256 peaks at about half of a 300 MB cap.
        low, high = _readings_in_a_capped_process()["warnings"]
        self.assertLen(low, 2)
        self.assertRegex(
            low[0],
            r"^MemoryMonitor: CPU:0 reached \d+\.\d MB in epoch 0 \(batch 0\), "
            r"\d+% of its 300\.0 MB limit",
        )
        self.assertIn("smaller batch size", low[0])
        self.assertIn("mixed precision", low[0])
        self.assertIn("in epoch 1", low[1])
        self.assertEmpty(high)

    def test_reuse_after_out_of_memory_keeps_only_the_retry(self):
        result = _readings_in_a_capped_process()["retry_after_oom"]
        self.assertTrue(result["oom"])
        self.assertLen(result["history"], 2)
        # Fresh peaks for the retry, not the failed attempt's. (Where the
        # failed attempt's peak stood when it ran out varies with the
        # allocator's fragmentation, so it is not compared with a figure.)
        self.assertLess(max(result["history"]), result["peak_at_oom"])
        self.assertEqual(
            result["samples"],
            [[epoch, batch, "train"] for epoch in (0, 1) for batch in range(4)],
        )
        self.assertEqual(result["csv_rows"], 8)

    def test_mirrored_strategy_reports_both_devices(self):
        result = _readings_in_a_bfc_process()["mirrored"]
        logs = result["logs"]
        self.assertEqual(result["devices"], ["CPU:0", "CPU:1"])
        for key in ("memory_peak_mb_cpu_0", "memory_peak_mb_cpu_1"):
            self.assertGreater(logs[key], 0)
            self.assertLessEqual(logs[key], logs["memory_peak_mb"])
        self.assertGreater(logs["memory_current_mb_cpu_1"], 0)

    def test_cpu_without_allocator_statistics_reads_labelled_rss(self):
        # Without oneDNN and the BFC allocator the CPU keeps no statistics:
        # the user opted out of the BFC allocator that tfmemsafe sets.
        result = testing.run_in_subprocess(
            _fit_without_allocator_statistics,
            env={
                "TF_ENABLE_ONEDNN_OPTS": "0",
                "CUDA_VISIBLE_DEVICES": "",
                "TFMEMSAFE_CPU_BFC_ALLOCATOR": "0",
                "TF_CPU_ALLOCATOR_USE_BFC": "",
            },
        )
        self.assertEqual(result["sources"], ["process_rss"])
        self.assertTrue(result["positive"])
        self.assertLen(result["peaks"], 2)
        self.assertGreater(min(result["peaks"]), 50)  # TF alone needs more.
        self.assertIn("process resident memory (RSS)", result["summary"])
        self.assertLen(result["warnings"], 1)
        self.assertIn("'process_rss'", result["warnings"][0])


if __name__ == "__main__":
    tf.test.main()
