"""Tests for the fit path's owners: the size policy, the planner's facts,
where a run resumes, and what the user sees of each decision."""

import contextlib
import io
import re
from unittest import mock

import _models
import keras
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import memory
from tfmemsafe import testing
from tfmemsafe._sources import source_for
from tfmemsafe.recovery import _planner
from tfmemsafe.recovery import _policy


def _oom(point):
    return tf.errors.ResourceExhaustedError(
        None, None, f"OOM when allocating tensor (injected: {point})"
    )


class _Planner:
    """A planner that answers a fixed number of halvings."""

    def __init__(self, halvings, why="peak 9.0 MiB predicted"):
        self.answer = (halvings, why)
        self.asked = []

    def halvings(
        self,
        phase,
        source,
        batch_size,
        floor,
        *,
        largest_probe,
        just_failed=False,
    ):
        self.asked.append((phase, batch_size, largest_probe, just_failed))
        return self.answer


class SizePolicyTest(tf.test.TestCase):
    def test_validation_follows_training_until_it_fails_itself(self):
        policy = _policy.SizePolicy(
            _models.dense_model(),
            {"training": 64, "validation": None},
            min_batch_size=1,
            max_retries=None,
        )
        policy.halve("training", _oom(1))
        self.assertEqual(policy.tried("validation"), (64, 32))
        policy.halve("validation", _oom(2))
        policy.halve("training", _oom(3))
        self.assertEqual(policy.tried("training"), (64, 32, 16))
        self.assertEqual(policy.tried("validation"), (64, 32, 16))
        self.assertEqual(policy.batch_size("validation"), 16)

    def test_phases_share_one_retry_budget(self):
        policy = _policy.SizePolicy(
            _models.dense_model(),
            {"training": 64, "validation": 64},
            min_batch_size=1,
            max_retries=2,
        )
        policy.halve("training", _oom(1))
        policy.halve("validation", _oom(2))
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError,
            "Could not fit a training batch of 32 after trying 64, 32, "
            "and `max_retries` is used up",
        ) as caught:
            policy.halve("training", _oom(3))
        self.assertIsInstance(
            caught.exception.__cause__, tf.errors.ResourceExhaustedError
        )

    def test_the_jump_is_one_decision_at_the_final_size(self):
        model = _models.dense_model()
        policy = _policy.SizePolicy(
            model, {"training": 4096}, min_batch_size=1, max_retries=None
        )
        first = policy.halve("training", _oom(1))
        planner = _Planner(2)
        decision = policy.jump(first, planner, source=None)
        # Asked just after the error: the planner probes only with room.
        self.assertEqual(planner.asked, [("training", 2048, 2048, True)])
        self.assertEqual(
            (decision.batch_size_before, decision.batch_size_after),
            (4096, 512),
        )
        self.assertEqual(policy.tried("training"), (4096, 512))
        # What each update averages is said for the size training goes
        # on with, not for the halving before the jump.
        self.assertIn(
            "averages 512 samples instead of 4096", decision.describe()
        )
        self.assertEqual(policy.retries, 1)

    def test_accumulation_steps_keep_the_effective_batch(self):
        model = _models.dense_model(accumulation_steps=2)
        policy = _policy.SizePolicy(
            model, {"training": 256}, min_batch_size=1, max_retries=None
        )
        decision = policy.jump(
            policy.halve("training", _oom(1)), _Planner(1), source=None
        )
        self.assertEqual(model.accumulation_steps, 8)
        self.assertEqual(
            (
                decision.accumulation_steps_before,
                decision.accumulation_steps_after,
            ),
            (2, 8),
        )
        self.assertEqual(decision.effective_batch, "")

    def test_preflight_replaces_the_size_asked_for(self):
        model = _models.dense_model(accumulation_steps=1)
        policy = _policy.SizePolicy(
            model, {"training": 1024}, min_batch_size=1, max_retries=0
        )
        planner = _Planner(3)
        decision = policy.preflight(planner, source=None)
        self.assertEqual(planner.asked, [("training", 1024, 512, False)])
        self.assertEqual(policy.tried("training"), (128,))
        self.assertEqual(policy.requested("training"), 1024)
        self.assertEqual(policy.scaled_steps("training", 2), 16)
        self.assertEqual(model.accumulation_steps, 8)
        self.assertEqual(decision.batch_size_before, 1024)
        self.assertEqual(policy.retries, 0)

    def test_halving_stops_at_a_replica_per_sample_floor(self):
        policy = _policy.SizePolicy(
            _models.dense_model(),
            {"evaluation": 3},
            min_batch_size=3,
            max_retries=None,
        )
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError,
            "half of it would be below `min_batch_size`=3",
        ):
            policy.halve("evaluation", _oom(1))


class PlannerFactsTest(tf.test.TestCase):
    def _planner(self, model):
        # No estimate: only what was measured answers.
        return _planner.SizePlanner(model, "test", memory_estimate=False)

    def test_a_size_that_trained_is_not_halved(self):
        model = _models.dense_model()
        source = source_for(_models.table(), "data", labelled=True)
        planner = self._planner(model)
        planner.record_trained("training", source, 448)
        self.assertEqual(
            planner.halvings("training", source, 448, 1, largest_probe=224),
            (0, ""),
        )

    def test_facts_hold_for_every_source_of_the_same_shape(self):
        model = _models.dense_model()
        x, y = _models.table()
        first = source_for((x, y), "data", labelled=True)
        second = source_for(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16),
            "data",
            labelled=True,
        )
        self._planner(model).record_ran_out("training", first, 512)
        halvings, why = self._planner(model).halvings(
            "training", second, 1024, 1, largest_probe=512
        )
        self.assertEqual(halvings, 2)
        self.assertIn("batch size 512 ran out of memory", why)

    def test_facts_are_per_step_and_per_model(self):
        model = _models.dense_model()
        source = source_for(_models.table(), "data", labelled=True)
        self._planner(model).record_ran_out("training", source, 64)
        self.assertEqual(
            self._planner(model).halvings(
                "evaluation", source, 64, 1, largest_probe=32
            ),
            (0, ""),
        )
        self.assertEqual(
            self._planner(_models.dense_model()).halvings(
                "training", source, 64, 1, largest_probe=32
            ),
            (0, ""),
        )

    def test_a_newer_measurement_wins(self):
        model = _models.dense_model()
        source = source_for(_models.table(), "data", labelled=True)
        planner = self._planner(model)
        planner.record_trained("training", source, 256)
        planner.record_ran_out("training", source, 256)
        self.assertEqual(
            planner.halvings("training", source, 256, 1, largest_probe=128)[0],
            1,
        )
        planner.record_trained("training", source, 256)
        self.assertEqual(
            planner.halvings("training", source, 256, 1, largest_probe=128)[0],
            0,
        )


class PeakWindowTest(tf.test.TestCase):
    def test_a_measurement_inside_keeps_the_peak_outside(self):
        device = "CPU:0"
        if memory.memory_info(device).peak_bytes is None:
            self.skipTest("CPU:0 keeps no allocator statistics here.")
        # Against what is in use already: earlier tests in this process
        # may have left tensors alive (66 MiB in one CI run).
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


class _HoldAt(keras.callbacks.Callback):
    """Allocates `megabytes` for a moment after step `(epoch, step)`, so
    that the epoch's peak holds them."""

    def __init__(self, epoch, step, megabytes):
        super().__init__()
        self.point = (epoch, step)
        self.megabytes = megabytes
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.point:
            held = tf.ones((self.megabytes, 256, 1024))
            del held


class _EpochBegins(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.begins = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append(epoch)


class FitDecisionsTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(("first_step", 0), ("later_step", 3))
    def test_callbacks_see_a_resumed_epoch_begin_once(self, step):
        begins = _EpochBegins()
        history = _models.fit_running_out(
            _models.dense_model(),
            ("train", 1, step),
            callbacks=[begins],
            epochs=2,
            shuffle=False,
        )
        self.assertEqual(history.oom_events[0].resumed_at_step, step)
        self.assertEqual(begins.begins, [0, 1])
        self.assertEqual(history.epoch, [0, 1])

    def test_progress_of_a_resumed_epoch_ends_at_its_total(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            tfmemsafe.fit(
                _models.dense_model(),
                _models.table(),
                batch_size=32,
                epochs=1,
                shuffle=False,
                callbacks=[testing.SimulatedOutOfMemory(("train", 0, 3))],
                verbose=1,
            )
        text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())  # Colours.
        counts = re.findall(r"(\d+)/(\d+) ", text)
        self.assertNotEmpty(counts)
        for done, total in counts:
            self.assertLessEqual(int(done), int(total))
        # 3 steps of 32, then the other 160 samples in 10 steps of 16.
        self.assertEqual(counts[-1], ("13", "13"))

    def test_one_log_line_says_the_size_training_goes_on_with(self):
        with self.assertLogs(level="WARNING") as logs:
            history = tfmemsafe.fit(
                _models.dense_model(),
                _models.table(),
                batch_size=64,
                epochs=1,
                shuffle=False,
                memory_estimate=False,
                callbacks=[testing.SimulatedOutOfMemory(("train", 0, 1))],
                verbose=0,
            )
        # tfmemsafe's own lines; TensorFlow's retracing warning names a
        # tfmemsafe method once enough fits ran in this process.
        lines = [
            r.getMessage()
            for r in logs.records
            if r.getMessage().startswith("tfmemsafe")
        ]
        self.assertLen(lines, 1)
        self.assertIn("batch size 64 -> 32", lines[0])
        self.assertIn("averages 32 samples instead of 64", lines[0])
        self.assertIn("Resuming at step 1 of epoch 1", lines[0])
        self.assertEqual(history.batch_size, 32)

    def test_the_epoch_that_ran_out_reports_the_failed_step_peak(self):
        if memory.memory_info("CPU:0").peak_bytes is None:
            self.skipTest("CPU:0 keeps no allocator statistics here.")
        # Against what is in use already: earlier tests in this process
        # may have left tensors alive.
        in_use = memory.memory_info("CPU:0", include_limit=False).current_bytes
        monitor = tfmemsafe.MemoryMonitor(devices="CPU:0")
        # The epoch held 64 MiB before its step 2 ran out; estimating
        # after that runs probes of a few MiB, which reset the peak.
        history = _models.fit_running_out(
            _models.dense_model(),
            ("train", 0, 2),
            callbacks=[monitor, _HoldAt(0, 1, megabytes=64)],
            epochs=2,
            shuffle=False,
        )
        peaks = history.history["memory_peak_mb"]
        self.assertGreaterEqual(peaks[0], 64.0)
        self.assertLess(peaks[1], in_use / 2**20 + 64.0)

    def test_arrays_of_different_lengths_are_refused_as_keras_does(self):
        x, y = _models.table()
        with self.assertRaisesRegex(
            ValueError,
            "Data cardinality is ambiguous: the arrays of `x` must all "
            "hold the same number of samples. Received: x sizes: 256, y "
            "sizes: 200",
        ):
            tfmemsafe.fit(
                _models.dense_model(), (x, y[:200]), batch_size=32, shuffle=True
            )


def _pinned_estimate():
    """An estimate in which 64 fits 90% of 100 MiB and 128 does not."""
    return tfmemsafe.MemoryEstimate(
        device="CPU:0",
        limit_bytes=100 * 2**20,
        fixed_bytes=10 * 2**20,
        per_sample_bytes=2**20,
        measurements=((8, 18 * 2**20), (16, 26 * 2**20)),
    )


def _jump_with_a_pinned_estimate(replicas=1, free_bytes=None):
    """An OOM at 256, with the estimate pinned: one jump to 64 (with
    `free_bytes` free after the error, if given)."""
    if replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
    strategy = (
        tf.distribute.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
        if replicas > 1
        else tf.distribute.get_strategy()
    )
    with strategy.scope():
        model = _models.dense_model(accumulation_steps=1)
    # The static bound knows the real device (24 GiB, say) and would let
    # 128 through before the pinned estimate is asked: pinned off too; and
    # what this test process happens to hold would count beside the
    # prediction: pinned to nothing.
    with (
        mock.patch.object(
            _planner.estimate_lib,
            "estimate_source",
            return_value=_pinned_estimate(),
        ) as estimate_source,
        mock.patch.object(
            _planner.estimate_lib, "bound_terms", return_value=None
        ) as bound_terms,
        mock.patch.object(_planner.estimate_lib, "held_bytes", return_value=0),
        mock.patch.object(
            _planner.memory,
            "free_bytes",
            side_effect=lambda device: free_bytes,
        ),
    ):
        history = tfmemsafe.fit(
            model,
            _models.table(512),
            batch_size=256,
            preflight=False,
            shuffle=False,
            callbacks=[testing.SimulatedOutOfMemory(("train", 0, 1))],
            verbose=0,
        )
    return {
        "events": [
            (e.batch_size_before, e.batch_size_after, e.accumulation_steps)
            for e in history.oom_events
        ],
        "batch_size": history.batch_size,
        "iterations": int(model.optimizer.iterations.numpy()),
        "estimated": estimate_source.called,
        "bound_traced": bound_terms.called,
    }


class JumpTest(tf.test.TestCase):
    def test_one_error_jumps_to_the_largest_halving_predicted_to_fit(self):
        result = _jump_with_a_pinned_estimate()
        self.assertEqual(result["events"], [(256, 64, 4)])
        self.assertEqual(result["batch_size"], 64)
        # 512 samples of updates of 256: 2, whatever the micro-batches.
        self.assertEqual(result["iterations"], 2)

    def test_no_probe_or_data_read_while_the_memory_is_still_full(self):
        # Reading data or probing with the allocator full can end the
        # process inside TensorFlow: with less than the room to read data
        # free after the error, it halves once instead.
        result = _jump_with_a_pinned_estimate(free_bytes=2**20)
        self.assertFalse(result["estimated"])
        self.assertFalse(result["bound_traced"])
        self.assertEqual(result["events"], [(256, 128, 2)])
        self.assertEqual(result["iterations"], 2)

    def test_the_jump_is_the_same_under_a_mirrored_strategy(self):
        result = testing.run_in_subprocess(
            _jump_with_a_pinned_estimate, kwargs={"replicas": 2}, timeout=300
        )
        self.assertEqual(result["events"], [[256, 64, 4]])
        self.assertEqual(result["iterations"], 2)


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
        result = testing.run_with_memory_cap(_find_then_fit, 250)
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
