"""Tests for tfmemsafe.recovery (the planner): batch sizes predicted to fit.

`fit`'s pre-flight check and the jump after an out-of-memory error, in
`fit`, `evaluate` and `find_max_batch_size`. `RealCapTest` runs each
scenario in its own process under a real allocator cap, all at once (their
ten-second allocator waits overlap), and counts the allocator's own
out-of-memory reports in the child's standard error.
"""

import concurrent.futures
import dataclasses
import os
import re
from unittest import mock

# The CPU allocator keeps statistics only with BFC (or oneDNN) on; it must
# be chosen before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import _models  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import parameterized  # noqa: E402

import tfmemsafe  # noqa: E402
from tfmemsafe import memory  # noqa: E402
from tfmemsafe import testing  # noqa: E402
from tfmemsafe.planning import _size_planner as _planner  # noqa: E402

# Under this cap the conv net trains at 512 and runs out at 1024.
_CAP_MB = 300


def _conv_net():
    return testing.reference_model("conv_net", (32, 32, 3))


def _images(rows):
    x = np.random.default_rng(0).normal(size=(rows, 32, 32, 3))
    x = x.astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")
    return x, y


def _repeated(rows, times):
    """A callable `batch_size -> dataset` of `rows` images `times` over."""
    dataset = tf.data.Dataset.from_tensor_slices(_images(rows))
    return lambda batch_size: dataset.repeat(times).batch(batch_size)


def _counting_allocator_failures(run):
    """Runs `run()`; returns its result and the allocator's failures."""
    with testing.AllocatorFailures() as failures:
        result = run()
    return result, failures.count


def eightfold_batch_under_cap(preflight):
    """`fit` asked for 4096, eight times the 512 that fits."""
    model = tfmemsafe.with_gradient_accumulation(_conv_net(), 1)
    history, failures = _counting_allocator_failures(
        lambda: tfmemsafe.fit(
            model,
            _repeated(2048, 4),
            batch_size=4096,
            preflight=preflight,
            verbose=0,
        )
    )
    return {
        "events": [dataclasses.asdict(e) for e in history.oom_events],
        "texts": [str(e) for e in history.oom_events],
        "failures": failures,
        "accumulation_steps": model.accumulation_steps,
        "batch_size": history.batch_size,
        # One update per 4096 samples: two in the epoch of 8192.
        "iterations": int(model.optimizer.iterations),
        "loss": history.history["loss"],
    }


def evaluation_under_cap():
    """`evaluate` at eight times what fits."""
    model = _conv_net()
    data = _repeated(2048, 4)
    logs, failures = _counting_allocator_failures(
        lambda: tfmemsafe.evaluate(
            model, data, batch_size=8192, return_dict=True, verbose=0
        )
    )
    reference = model.evaluate(data(256), return_dict=True, verbose=0)
    return {
        "failures": failures,
        "loss": logs["loss"],
        "reference_loss": reference["loss"],
    }


def search_under_cap():
    """`find_max_batch_size` on the GRU, whose estimate's size trains
    without running out (in some processes with less than the headroom
    free, and the search goes below it): its steps are sequential and its
    data (token ids, one batch prefetched) small. The conv net's is not
    (`recovery_test`'s search on it lets the `fit` after it recover
    once): under this cap its estimate's size peaks at 92% of the limit
    up to over it, from process to process."""
    model = testing.reference_model("gru", (None,))
    with _models.absl_messages("INFO") as messages:
        size, failures = _counting_allocator_failures(
            lambda: tfmemsafe.find_max_batch_size(
                model, testing.random_data((64,), tokens=True)
            )
        )
    return {
        "size": size,
        "failures": failures,
        "tried": [m for m in messages if "(tried" in m],
    }


class RealCapTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        scenarios = {
            "preflight": (eightfold_batch_under_cap, [True]),
            "no_preflight": (eightfold_batch_under_cap, [False]),
            "evaluation": (evaluation_under_cap, []),
            "search": (search_under_cap, []),
        }
        cls._pool = concurrent.futures.ThreadPoolExecutor(len(scenarios))
        cls._results = {
            name: cls._pool.submit(
                testing.run_with_memory_cap,
                target,
                _CAP_MB,
                args=args,
                # Counts of out-of-memory errors hang on the conv net's
                # peak at 512, which default inter-op threads move.
                env=_models.ONE_STREAM,
            )
            for name, (target, args) in scenarios.items()
        }

    @classmethod
    def tearDownClass(cls):
        cls._pool.shutdown(wait=True)
        super().tearDownClass()

    def result(self, name):
        return self._results[name].result()

    def test_preflight_starts_at_a_size_that_fits_without_any_oom(self):
        result = self.result("preflight")
        self.assertEqual(result["failures"], 0, msg=result)
        [event] = result["events"]
        self.assertEqual(event["phase"], "preflight")
        self.assertEqual(event["batch_size_before"], 4096)
        self.assertEqual(event["batch_size_after"], 4096)
        # 1024 runs out under the cap; 512 fits.
        self.assertIn(event["split_into"], (8, 16, 32))
        self.assertIn("predicted against 90% of 300.0 MiB", event["error"])
        self.assertStartsWith(
            result["texts"][0], "epoch 1, pre-flight check: its batch split"
        )

    def test_preflight_keeps_the_effective_batch(self):
        result = self.result("preflight")
        [event] = result["events"]
        self.assertEqual(event["accumulation_steps"], 1)
        self.assertEqual(result["accumulation_steps"], 1)
        self.assertEqual(result["batch_size"], 4096)
        self.assertEqual(result["iterations"], 2)
        self.assertTrue(np.isfinite(result["loss"]).all())

    def test_without_preflight_one_oom_splits_into_what_fits(self):
        result = self.result("no_preflight")
        self.assertEqual(result["failures"], 1, msg=result)
        [event] = result["events"]
        self.assertEqual(event["phase"], "training")
        self.assertEqual(event["batch_size_before"], 4096)
        self.assertEqual(event["batch_size_after"], 4096)
        self.assertGreaterEqual(event["split_into"], 8)
        self.assertIn("OOM when allocating", event["error"])
        self.assertEqual(result["accumulation_steps"], 1)
        self.assertEqual(result["iterations"], 2)

    def test_evaluate_splits_after_one_oom(self):
        result = self.result("evaluation")
        self.assertEqual(result["failures"], 1, msg=result)
        self.assertAllClose(result["loss"], result["reference_loss"], rtol=1e-4)

    def test_find_max_batch_size_starts_at_the_estimate_without_oom(self):
        result = self.result("search")
        self.assertEqual(result["failures"], 0, msg=result)
        # The estimate's size first, which trains with the headroom in most
        # processes; where its peak read higher than the headroom allows
        # (it moves between processes, one stream or not), the search goes
        # below it without running out and ends at a size that trained.
        size = result["size"]
        (line,) = result["tried"]
        self.assertStartsWith(line, f"tfmemsafe.find_max_batch_size: {size} ")
        tried = [int(n) for n in re.findall(r"\d+", line.split("(tried")[1])]
        self.assertEqual(tried[-1], size, msg=line)
        self.assertGreaterEqual(tried[0], size, msg=line)
        self.assertBetween(size, 768, 1280)


class PreflightTest(parameterized.TestCase, tf.test.TestCase):
    def test_a_batch_that_fits_trains_exactly_as_without_preflight(self):
        if tfmemsafe.memory_info("CPU:0").peak_bytes is None:
            self.skipTest("CPU:0 keeps no allocator statistics here")
        x, y = _images(64)
        runs = []
        for preflight in (True, False):
            model = _conv_net()
            history = tfmemsafe.fit(
                model,
                (x, y),
                batch_size=16,
                epochs=2,
                preflight=preflight,
                verbose=0,
            )
            runs.append((model, history))
        (with_check, history), (without, plain) = runs
        self.assertEqual(history.oom_events, [])
        self.assertEqual(history.batch_size, 16)
        self.assertAllClose(history.history["loss"], plain.history["loss"])
        for a, b in zip(
            with_check.variables + with_check.optimizer.variables,
            without.variables + without.optimizer.variables,
            strict=True,
        ):
            self.assertAllEqual(a, b)

    def test_without_statistics_fit_trains_with_no_estimate(self):
        result = testing.run_in_subprocess(
            _fit_without_statistics,
            env={
                "TF_CPU_ALLOCATOR_USE_BFC": "false",
                "TF_ENABLE_ONEDNN_OPTS": "0",
                "CUDA_VISIBLE_DEVICES": "",
            },
        )
        self.assertEqual(result["events"], 0)
        self.assertEqual(result["epochs"], [0])

    def test_no_probe_runs_when_off_or_far_from_the_limit(self):
        if tfmemsafe.memory_info("CPU:0").peak_bytes is None:
            self.skipTest("CPU:0 keeps no allocator statistics here")
        x, y = _images(64)
        passes = {}
        for memory_estimate in (True, False):
            # Counts samples through the model in a variable it does not
            # own, so no probe can put the count back.
            counter = tf.Variable(0.0, trainable=False)

            def count(inputs, counter=counter):
                counter.assign_add(tf.cast(tf.shape(inputs)[0], "float32"))
                return inputs

            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((32, 32, 3)),
                    keras.layers.Lambda(count),
                    keras.layers.GlobalAveragePooling2D(),
                    keras.layers.Dense(4),
                ]
            )
            model.compile("adam", "sparse_categorical_crossentropy")
            tfmemsafe.fit(
                model,
                (x, y),
                batch_size=32,
                memory_estimate=memory_estimate,
                verbose=0,
            )
            passes[memory_estimate] = int(counter.numpy())
        self.assertEqual(passes[False], 64)
        # Batch 32 of this model is far from the limit: the static bound
        # says so, and the pre-flight check runs no probe either.
        self.assertEqual(passes[True], 64)

    @parameterized.parameters("preflight", "memory_estimate")
    def test_switches_must_be_bools(self, name):
        x, y = _images(8)
        with self.assertRaisesRegex(
            ValueError, rf"^`{name}` must be True or False\. Received: "
        ):
            tfmemsafe.fit(_conv_net(), (x, y), **{name: "yes"})


def _fit_without_statistics():
    x, y = _images(32)
    history = tfmemsafe.fit(_conv_net(), (x, y), batch_size=8, verbose=0)
    return {"events": len(history.oom_events), "epochs": history.epoch}


def _predicted_beside_the_data(data_mib):
    """The planner's prediction at 64 beside `data_mib` of arrays, for an
    estimate whose probes counted them: before and after the run's
    tensors are made, and what is in use then."""
    from tfmemsafe import _sources
    from tfmemsafe.planning import _size_planner as _planner

    x = np.ones((data_mib * 2**18, 1), "float64")  # Cast: a copy.
    source = _sources.source_for((x, x), "x", labelled=True)
    made = tfmemsafe.MemoryEstimate(
        device="CPU:0",
        limit_bytes=_CAP_MB * 2**20,
        fixed_bytes=(20 + 2 * data_mib) * 2**20,
        per_sample_bytes=2**20,
        measurements=((8, (28 + 2 * data_mib) * 2**20),),
        data_bytes=source.resident_bytes(),
    )
    before = _planner._predicted_peak(made, 64, source)
    held_before = tfmemsafe.memory_info("CPU:0").current_bytes
    source.tensors()
    after = _planner._predicted_peak(made, 64, source)
    held_after = tfmemsafe.memory_info("CPU:0").current_bytes
    return {
        "before": before,
        "after": after,
        "held_before": held_before,
        "held_after": held_after,
        "data": source.resident_bytes(),
        "counted": made.data_bytes,
    }


def _large_arrays_under_the_cap():
    """96 MiB of images under a 300 MB cap: a standalone estimate on them,
    then `fit` at 256 (a peak of about 212 MiB) with its pre-flight check."""
    x, y = _images(8192)
    made = tfmemsafe.estimate_memory(_conv_net(), (x, y), batch_sizes=(8, 32))
    history = tfmemsafe.fit(
        _conv_net(), (x, y), batch_size=256, steps_per_epoch=2, verbose=0
    )
    return {
        "data_bytes": made.data_bytes,
        "fixed_bytes": made.fixed_bytes,
        "events": [event.error for event in history.oom_events],
        "epochs": history.epoch,
    }


class DataCountedOnceTest(tf.test.TestCase):
    def test_large_arrays_are_neither_copied_nor_counted_twice(self):
        # Before: the probes gathered from a copy of the data's tensors
        # that a `map` captured (copied again when its iterator was made),
        # so the standalone estimate ran out and the process ended
        # (SIGSEGV); and the pre-flight check, counting the data in the
        # line and again in use, cut 256, which trains, to 64.
        result = testing.run_with_memory_cap(
            _large_arrays_under_the_cap, _CAP_MB, env=_models.ONE_STREAM
        )
        # What converting them added to the allocator (nothing where a
        # tensor uses NumPy's buffer in place), counted in the line.
        self.assertBetween(result["data_bytes"], 0, 2 * 97 * 2**20)
        self.assertGreater(result["fixed_bytes"], result["data_bytes"])
        self.assertEqual(result["events"], [])
        self.assertEqual(result["epochs"], [0])

    def test_data_the_probes_counted_is_not_counted_again_beside_them(self):
        result = testing.run_with_memory_cap(
            _predicted_beside_the_data, _CAP_MB, args=[48]
        )
        own = (20 + 2 * 48 + 64) * 2**20  # The line at 64, the data in it.
        # The data once, in the line: not among what is held once its
        # tensors are made (96 MiB as float32), and nothing subtracted
        # for it before.
        self.assertGreater(
            result["held_after"] - result["held_before"], 90 * 2**20
        )
        self.assertAllClose(
            result["before"], own + result["held_before"], atol=2**20
        )
        # After: the line's data swapped for what converting it added to
        # the allocator (chunks, 128 MiB here), held not counted again.
        self.assertAllClose(
            result["after"],
            own - result["counted"] + result["held_after"],
            atol=2**20,
        )


class PeakWindowTest(tf.test.TestCase):
    def test_a_measurement_inside_keeps_the_peak_outside(self):
        device = "CPU:0"
        if memory.memory_info(device).peak_bytes is None:
            self.skipTest("CPU:0 keeps no allocator statistics here.")
        # Against what is in use already: earlier tests in this process
        # may have left tensors alive.
        in_use = memory.memory_info(device, include_limit=False).current_bytes
        memory.reset_peak_memory(device)
        big = tf.ones((16, 1024, 1024))  # 64 MiB
        del big
        window = memory.PeakWindow([device])
        window.reset()
        small = tf.ones((1024,))
        del small
        self.assertLess(window.peak_bytes(device) - in_use, 32 * 2**20)
        self.assertGreaterEqual(
            memory.memory_info(device).peak_bytes - in_use, 64 * 2**20
        )
        memory.reset_peak_memory(device)
        self.assertLess(
            memory.memory_info(device).peak_bytes - in_use, 32 * 2**20
        )

    def test_fits_within_is_the_one_rule(self):
        self.assertTrue(memory.fits_within(90, 100))
        self.assertFalse(memory.fits_within(91, 100))
        self.assertTrue(memory.fits_within(50, 100, headroom=0.5))
        self.assertEqual(memory.usable_bytes(200), 180)


class MeasuredBeatsPredictedTest(tf.test.TestCase):
    def test_a_size_the_finder_trained_is_not_cut_by_a_noisy_estimate(self):
        # Pins the estimate's noise: it predicts that nothing fits, as a
        # noisy one did for a size that trains (448 -> 112 under a cap).
        pessimistic = tfmemsafe.MemoryEstimate(
            device="CPU:0",
            limit_bytes=2**30,
            fixed_bytes=2 * 2**30,
            per_sample_bytes=2**20,
            measurements=((8, 2 * 2**30), (16, 2 * 2**30 + 2**23)),
        )
        model = _models.dense_model()
        data = _models.table()
        with mock.patch.object(
            _planner.estimate_lib, "estimate_source", return_value=pessimistic
        ):
            found = tfmemsafe.find_max_batch_size(
                model, data, max_batch_size=128
            )
            history = tfmemsafe.fit(
                model,
                data,
                batch_size=found,
                validation_data=data,
                verbose=0,
            )
        self.assertEqual(found, 128)
        self.assertEqual(history.batch_size, 128)
        self.assertEqual(history.oom_events, [])

    def test_fit_trains_at_the_size_the_finder_found(self):
        # Under a real cap the pre-flight check's estimate can predict a
        # size that trains not to fit; what the finder measured wins.
        result = testing.run_with_memory_cap(
            _find_then_fit, 250, env=_models.ONE_STREAM
        )
        self.assertEqual(result["fit_batch_size"], result["found"])
        self.assertEqual(result["events"], [])
        self.assertEqual(result["validation_fit_batch_size"], result["found"])


def _find_then_fit():
    x, y = testing.random_images(1024, classes=4)  # The net's 4 outputs.
    model = testing.reference_model("conv_net", (32, 32, 3))
    found = tfmemsafe.find_max_batch_size(model, (x, y), max_batch_size=512)
    history = tfmemsafe.fit(model, (x, y), batch_size=found, verbose=0)
    validated = tfmemsafe.fit(
        model,
        (x, y),
        batch_size=found,
        validation_data=(x[:256], y[:256]),
        verbose=0,
    )
    return {
        "found": found,
        "fit_batch_size": history.batch_size,
        "validation_fit_batch_size": validated.batch_size,
        "events": [str(e) for e in history.oom_events + validated.oom_events],
    }


if __name__ == "__main__":
    tf.test.main()
