"""Tests for tfmemsafe.testing: subprocesses and a real allocator OOM."""

import concurrent.futures
import os
import tempfile
import time
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing
from tfmemsafe.testing import _preloaded


def _train_conv_net(batch_size, steps=2):
    """Trains a small conv net; returns the final loss."""
    x, y = testing.random_images(batch_size * steps)
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = model.fit(x, y, batch_size=batch_size, verbose=0)
    return float(history.history["loss"][-1])


def _oom_then_recover():
    """Runs out of memory at batch 1024, then trains at 128 in-process."""
    import tensorflow as tf

    import tfmemsafe

    with testing.AllocatorFailures() as failures:
        try:
            _train_conv_net(1024)
        except tf.errors.ResourceExhaustedError as err:
            classified = tfmemsafe.is_oom_error(err)
        else:
            return {"oom": False}
    with testing.AllocatorFailures() as none:
        loss = _train_conv_net(128)
    return {
        "oom": True,
        "classified": classified,
        "loss": loss,
        "failures": failures.count,
        "failures_after": none.count,
    }


def _add(a, b, *, scale=1):
    return (a + b) * scale


def _environment(name):
    return os.environ.get(name)


def _sleep_then_return(seconds, value):
    time.sleep(seconds)
    return value


def _children_of(pid):
    """The pids of a process's children (Linux's /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # The parent's pid is the second field after the name.
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            children.append(int(entry))
    return children


def _crash():
    """Reads address 0: the process ends with SIGSEGV."""
    import ctypes

    ctypes.string_at(0)


def _not_json():
    return object()


def _raise_value_error():
    raise ValueError("the child's own message")


# Fresh children, and children forked from a server that has imported
# TensorFlow and Keras (this suite's default, see conftest.py).
_CHILD_KINDS = (("fresh", ""), ("forked", "1"))


def _preload(value, **env):
    return {"TFMEMSAFE_TESTING_PRELOAD": value, **env}


_KERAS_IMPORTED = "'keras' in __import__('sys').modules"


class MemoryCapTest(parameterized.TestCase, tf.test.TestCase):
    def test_capped_children_keep_the_allocator_dump_out_unless_asked(self):
        unset = {
            k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"
        }
        with mock.patch.dict(os.environ, unset, clear=True):
            quiet = testing.memory_cap_environment(100)
        with mock.patch.dict(os.environ, {"TF_CPP_MIN_LOG_LEVEL": "0"}):
            chosen = testing.memory_cap_environment(100)
        self.assertEqual(quiet["TF_CPP_MIN_LOG_LEVEL"], "1")
        self.assertNotIn("TF_CPP_MIN_LOG_LEVEL", chosen)
        self.assertEqual(chosen["TF_CPU_BFC_MEM_LIMIT_IN_MB"], "100")

    def test_real_oom_is_raised_back_and_classified(self):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"raised ResourceExhaustedError: .*OOM"
        ) as caught:
            testing.run_with_memory_cap(_train_conv_net, 300, args=[1024])
        error = caught.exception
        self.assertIsInstance(error.__cause__, tf.errors.ResourceExhaustedError)
        self.assertTrue(tfmemsafe.is_oom_error(error))
        self.assertIn("last lines of its stderr", str(error))
        self.assertNotEqual(error.returncode, 0)

    def test_process_trains_at_a_smaller_batch_after_an_oom(self):
        result = testing.run_with_memory_cap(_oom_then_recover, 300)
        self.assertTrue(result["oom"])
        self.assertTrue(result["classified"])
        self.assertTrue(result["loss"] > 0)
        # The allocator reported the failed allocation once, and none at
        # the smaller batch.
        self.assertEqual(result["failures"], 1)
        self.assertEqual(result["failures_after"], 0)

    def test_cap_environment_is_set_in_the_child(self):
        self.assertEqual(
            testing.run_with_memory_cap(
                _environment, 123, args=["TF_CPU_BFC_MEM_LIMIT_IN_MB"]
            ),
            "123",
        )

    @parameterized.named_parameters(
        ("zero", 0), ("negative", -5), ("float", 1.5), ("bool", True)
    )
    def test_bad_cap_raises(self, cap_mb):
        with self.assertRaisesRegex(ValueError, r"`cap_mb` must be an integer"):
            testing.run_with_memory_cap(_add, cap_mb, args=[1, 2])


class RunInSubprocessTest(parameterized.TestCase, tf.test.TestCase):
    def test_function_result_and_arguments_round_trip(self):
        self.assertEqual(
            testing.run_in_subprocess(_add, args=[2, 3], kwargs={"scale": 4}),
            20,
        )

    def test_string_target(self):
        self.assertEqual(
            testing.run_in_subprocess("operator:add", args=[2, 3]), 5
        )

    def test_script_target_returns_stdout(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "hello.py")
            with open(script, "w") as f:
                f.write("import sys\nprint('hello', *sys.argv[1:])\n")
            output = testing.run_in_subprocess(script, args=["a", 1])
        self.assertEqual(output.strip(), "hello a 1")

    def test_uncaptured_script_streams_and_still_reports_failure(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "exit.py")
            with open(script, "w") as f:
                f.write("import sys\nsys.exit(int(sys.argv[1]))\n")
            self.assertIsNone(
                testing.run_in_subprocess(
                    script, args=[0], capture_output=False
                )
            )
            with self.assertRaisesRegex(
                testing.SubprocessError, r"exited with code 4"
            ):
                testing.run_in_subprocess(
                    script, args=[4], capture_output=False
                )

    def test_failing_script_raises_with_its_error(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "fail.py")
            with open(script, "w") as f:
                f.write("raise KeyError('missing')\n")
            with self.assertRaisesRegex(
                testing.SubprocessError, r"raised KeyError"
            ) as caught:
                testing.run_in_subprocess(script)
        self.assertIsInstance(caught.exception.__cause__, KeyError)

    def test_child_exception_is_rebuilt(self):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"raised ValueError: the child's own"
        ) as caught:
            testing.run_in_subprocess(_raise_value_error)
        self.assertIsInstance(caught.exception.__cause__, ValueError)
        self.assertFalse(tfmemsafe.is_oom_error(caught.exception))

    @parameterized.named_parameters(*_CHILD_KINDS)
    def test_timeout_kills_the_child(self, preload):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"killed by signal"
        ) as caught:
            testing.run_in_subprocess(
                "time:sleep", args=[60], timeout=1, env=_preload(preload)
            )
        self.assertIn("still running after 1 s", caught.exception.stderr)

    @parameterized.named_parameters(*_CHILD_KINDS)
    def test_a_crash_shows_where_the_child_was(self, preload):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"killed by signal 11"
        ) as caught:
            testing.run_in_subprocess(_crash, env=_preload(preload))
        self.assertIn("Segmentation fault", caught.exception.stderr)
        self.assertIn("in _crash", caught.exception.stderr)

    def test_unserializable_result_is_reported(self):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"not JSON-serializable"
        ):
            testing.run_in_subprocess(_not_json)

    def test_local_functions_are_refused(self):
        def local():
            return 1

        with self.assertRaisesRegex(
            ValueError, r"`target` must be a module-level function"
        ):
            testing.run_in_subprocess(local)

    def test_missing_script_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"script not found"):
            testing.run_in_subprocess("/no/such/script.py")


class PreloadTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(*_CHILD_KINDS)
    def test_a_child_is_forked_with_keras_imported_only_if_asked(self, preload):
        env = _preload(preload)
        parent = testing.run_in_subprocess("os:getppid", env=env)
        imported = testing.run_in_subprocess(
            "builtins:eval", args=[_KERAS_IMPORTED], env=env
        )
        self.assertEqual(parent == os.getpid(), not preload)
        self.assertEqual(imported, bool(preload))

    def test_the_cap_applies_to_a_forked_child(self):
        result = testing.run_with_memory_cap(
            _oom_then_recover, 300, env=_preload("1")
        )
        self.assertTrue(result["oom"])
        self.assertTrue(result["classified"])
        self.assertEqual(result["failures_after"], 0)

    def test_each_environment_read_at_import_has_its_own_server(self):
        def server(**env):
            return testing.run_in_subprocess(
                "os:getppid", env=_preload("1", **env)
            )

        # The cap is read when TensorFlow makes its first device: one
        # server serves every cap. oneDNN's switch is read at import.
        capped = server(
            TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_BFC_MEM_LIMIT_IN_MB="1"
        )
        self.assertEqual(
            server(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_BFC_MEM_LIMIT_IN_MB="2"),
            capped,
        )
        self.assertNotEqual(server(TF_ENABLE_ONEDNN_OPTS="1"), capped)
        self.assertNotEqual(capped, os.getpid())

    def test_a_child_of_a_server_told_to_stop_still_returns(self):
        # One server at most: the second environment stops the first's,
        # which ends only once its running child has.
        first = ("KERAS_HOME", "/first")
        with mock.patch.object(_preloaded, "_MOST_SERVERS", 1):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                sleeping = pool.submit(
                    testing.run_in_subprocess,
                    _sleep_then_return,
                    args=[3, "done"],
                    env=_preload("1", **dict([first])),
                )
                # Its server is listed before it forks the child, and
                # forks it before another child can be asked for.
                deadline = time.monotonic() + 120
                while not any(first in key for key in _preloaded._servers):
                    self.assertLess(time.monotonic(), deadline)
                    time.sleep(0.05)
                other = testing.run_in_subprocess(
                    "os:getpid", env=_preload("1", KERAS_HOME="/nowhere")
                )
                self.assertEqual(sleeping.result(timeout=120), "done")
        self.assertIsInstance(other, int)

    def test_a_child_whose_server_dies_is_reported_killed(self):
        env = _preload("1", KERAS_HOME="/server-that-dies")
        testing.run_in_subprocess("os:getpid", env=env)  # Starts it.
        (server,) = [
            server
            for key, server in _preloaded._servers.items()
            if ("KERAS_HOME", "/server-that-dies") in key
        ]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            sleeping = pool.submit(
                testing.run_in_subprocess, "time:sleep", args=[60], env=env
            )
            # Killed once it has forked the child, however long that takes.
            deadline = time.monotonic() + 120
            while not _children_of(server.process.pid):
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.05)
            server.process.kill()
            with self.assertRaisesRegex(
                testing.SubprocessError, r"killed by signal 9"
            ):
                sleeping.result(timeout=30)

    def test_a_server_that_cannot_start_leaves_a_fresh_child_and_a_warning(
        self,
    ):
        env = _preload("1", KERAS_BACKEND="no_such_backend")
        with self.assertLogs(level="WARNING") as logs:
            parent = testing.run_in_subprocess("os:getppid", env=env)
        self.assertEqual(parent, os.getpid())
        self.assertIn("start afresh", "\n".join(logs.output))

    def test_a_forked_child_has_the_environment_it_asked_for(self):
        env = _preload("1", TFMEMSAFE_SOME_SETTING="x", TF_CONFIG="{}")
        self.assertEqual(
            testing.run_in_subprocess(
                _environment, args=["TFMEMSAFE_SOME_SETTING"], env=env
            ),
            "x",
        )
        self.assertEqual(
            testing.run_in_subprocess(
                _environment, args=["TF_CONFIG"], env=env
            ),
            "{}",
        )


class _Steps(keras.callbacks.Callback):
    """Records the `(epoch, step)` of every training step that ended."""

    def __init__(self):
        super().__init__()
        self.ended = []
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.ended.append((self.epoch, batch))


def _small_dense():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


class OutOfMemoryAboveTest(tf.test.TestCase):
    def test_batches_above_its_rows_run_out_inside_the_step(self):
        x = np.zeros((64, 4), "float32")
        model = keras.Sequential(
            [
                keras.Input((4,)),
                testing.OutOfMemoryAbove(8),
                keras.layers.Dense(1),
            ]
        )
        model.compile("sgd", "mse")
        with self.assertRaisesRegex(
            tf.errors.OpError, "OOM when allocating"
        ) as caught:
            model.fit(x, x[:, :1], batch_size=16, verbose=0)
        self.assertTrue(tfmemsafe.is_oom_error(caught.exception))
        history = tfmemsafe.fit(model, x, x[:, :1], batch_size=16, verbose=0)
        self.assertNotEmpty(history.oom_events)
        self.assertGreaterEqual(history.oom_events[0].split_into, 2)

    def test_round_trips_through_a_keras_file(self):
        model = keras.Sequential(
            [keras.Input((4,)), testing.OutOfMemoryAbove(8)]
        )
        path = self.get_temp_dir() + "/model.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertEqual(loaded.layers[0].rows, 8)

    def test_rows_must_be_an_integer(self):
        with self.assertRaisesRegex(ValueError, r"^`rows` must be an integer"):
            testing.OutOfMemoryAbove(-1)


class SimulatedOutOfMemoryTest(parameterized.TestCase, tf.test.TestCase):
    def test_raises_a_recognised_oom_once_at_the_given_step(self):
        x = np.zeros((64, 4), "float32")
        callback = testing.SimulatedOutOfMemory(("train", 1, 2))
        steps = _Steps()
        model = _small_dense()
        with self.assertRaisesRegex(
            tf.errors.ResourceExhaustedError, r"^OOM when allocating tensor"
        ) as caught:
            model.fit(
                x,
                x[:, :1],
                batch_size=16,
                epochs=2,
                callbacks=[callback, steps],
                verbose=0,
            )
        self.assertTrue(tfmemsafe.is_oom_error(caught.exception))
        # Raised before step 2 of epoch 1 ran.
        self.assertEqual(steps.ended[-1], (1, 1))
        self.assertLen(steps.ended, 4 + 2)
        # Spent: the same step goes through the second time.
        model.fit(x, x[:, :1], batch_size=16, callbacks=[callback], verbose=0)
        self.assertEmpty(callback.points)

    @parameterized.named_parameters(
        ("test", ("test", None, 1), "evaluate"),
        ("predict", ("predict", None, 1), "predict"),
        ("epoch_end", ("epoch_end", 0, None), "fit"),
    )
    def test_each_phase_raises_where_it_says(self, point, method):
        x = np.zeros((64, 4), "float32")
        model = _small_dense()
        callback = testing.SimulatedOutOfMemory(point)
        run = {
            "evaluate": lambda: model.evaluate(
                x, x[:, :1], batch_size=16, callbacks=[callback], verbose=0
            ),
            "predict": lambda: model.predict(
                x, batch_size=16, callbacks=[callback], verbose=0
            ),
            "fit": lambda: model.fit(
                x, x[:, :1], batch_size=16, callbacks=[callback], verbose=0
            ),
        }[method]
        with self.assertRaises(tf.errors.ResourceExhaustedError):
            run()
        run()  # Once only.

    def test_split_batch_on_oom_does_not_retry_an_error_of_a_callback(self):
        x = np.zeros((64, 4), "float32")
        with self.assertRaises(tf.errors.ResourceExhaustedError):
            tfmemsafe.fit(
                _small_dense(),
                (x, x[:, :1]),
                batch_size=16,
                epochs=2,
                callbacks=[testing.SimulatedOutOfMemory(("train", 1, 2))],
                verbose=0,
            )

    @parameterized.named_parameters(
        ("unknown_phase", ("validate", 0, 1)),
        ("short", ("train", 1)),
        ("not_a_tuple", "train"),
    )
    def test_bad_point_raises(self, point):
        with self.assertRaisesRegex(ValueError, r"^Each point must be"):
            testing.SimulatedOutOfMemory(point)


def _in_use_under_a_hold():
    """Memory in use at the start of each step of one epoch, with 4 MB
    left free from step 1 until step 2 begins."""
    in_use = []

    class InUse(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            info = tfmemsafe.memory.memory_info("CPU:0")
            in_use.append((info.current_bytes, info.limit_bytes))

    held = testing.HeldMemory(0, 1, leave_mb=4)
    model = _small_dense()
    x, y = np.zeros((32, 4), "float32"), np.zeros((32,), "int32")
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[held, InUse()])
    return in_use


class HeldMemoryTest(parameterized.TestCase, tf.test.TestCase):
    def test_fills_the_allocator_for_one_step(self):
        in_use = testing.run_with_memory_cap(_in_use_under_a_hold, 100)
        (before, limit), (held, _), (after, _), _ = in_use
        self.assertGreater(held, limit - 6 * 2**20)
        self.assertLess(before, limit / 2)
        self.assertLess(after, limit / 2)

    @parameterized.named_parameters(
        ("epoch", {"epoch": -1}, "epoch"),
        ("step", {"step": 1.5}, "step"),
        ("leave_mb", {"leave_mb": -4}, "leave_mb"),
    )
    def test_bad_argument_raises_value_error(self, kwargs, name):
        arguments = {"epoch": 0, "step": 1, **kwargs}
        with self.assertRaisesRegex(
            ValueError, rf"^`{name}` must be an integer >= 0"
        ):
            testing.HeldMemory(**arguments)


class ReferenceTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("conv_net", "conv_net", (24, 24, 3), 16 * 3 * 9 + 16),
        ("residual_net", "residual_net", (24, 24, 3), 16 * 3 * 9 + 16),
        ("mlp", "mlp", (256,), 256 * 1024 + 1024),
        (
            "accumulating_checkpointed_net",
            "accumulating_checkpointed_net",
            (24, 24, 3),
            16 * 3 * 9 + 16,
        ),
        ("gru", "gru", (64,), 2000 * 64 + 64 * 3 * 128),
        ("transformer", "transformer", (64,), 2000 * 64 + 4096 * 64),
    )
    def test_reference_model_is_seeded_and_compiled(
        self, name, shape, first_layer_parameters
    ):
        model = testing.reference_model(name)
        again = testing.reference_model(name)
        self.assertEqual(model.input_shape, (None, *shape))
        self.assertEqual(model.output_shape, (None, 4))
        self.assertEqual(
            int(np.prod(model.weights[0].shape))
            + int(np.prod(model.weights[1].shape)),
            first_layer_parameters,
        )
        self.assertIsInstance(model.optimizer, keras.optimizers.Adam)
        self.assertAllClose(float(model.optimizer.learning_rate), 3e-3)
        for a, b in zip(model.weights, again.weights, strict=True):
            self.assertAllEqual(a, b)
        if name in ("gru", "transformer"):  # Token ids, of any length.
            self.assertEqual(model.inputs[0].dtype, "int32")
            longer = testing.reference_model(name, (None,))
            self.assertEqual(longer(np.ones((2, 100), "int32")).shape, (2, 4))
        self.assertEqual(
            name == "accumulating_checkpointed_net",
            isinstance(model, tfmemsafe.AccumulatingModel),
        )

    def test_reference_model_takes_a_shape_and_metrics(self):
        model = testing.reference_model("conv_net", (32, 32, 3), metrics=None)
        self.assertEqual(model.input_shape, (None, 32, 32, 3))
        x, y = testing.random_images(8, classes=4)
        logs = model.evaluate(x, y, verbose=0, return_dict=True)
        self.assertEqual(list(logs), ["loss"])

    def test_unknown_reference_model_raises(self):
        with self.assertRaisesRegex(ValueError, r"^`name` must be one of"):
            testing.reference_model("vision_transformer")

    def test_bad_sequence_arguments_raise(self):
        with self.assertRaisesRegex(
            ValueError,
            r"^`input_shape` of the transformer must be at most 4096",
        ):
            testing.reference_model("transformer", (5000,))
        with self.assertRaisesRegex(ValueError, r"^`tokens` must be True or"):
            testing.random_data((8,), tokens="yes")

    def test_random_data_repeats_few_labelled_rows(self):
        data = testing.random_data((3,), rows=4)
        x, y = next(iter(data(8)))
        self.assertEqual(x.shape, (8, 3))
        self.assertAllEqual(x[:4], x[4:])
        self.assertAllEqual(y, tf.cast(x[:, 0] > 0, tf.int32))
        again, _ = next(iter(testing.random_data((3,), rows=4)(4)))
        self.assertAllEqual(x[:4], again)

    def test_random_data_of_tokens_are_ids_labelled_by_parity(self):
        x, y = next(iter(testing.random_data((16,), rows=4, tokens=True)(4)))
        self.assertEqual((x.shape, x.dtype), ((4, 16), tf.int32))
        self.assertTrue(bool(tf.reduce_all((x >= 1) & (x < 2000))))
        self.assertAllEqual(y, x[:, 0] % 2)
        model = testing.reference_model("transformer")
        data = testing.random_data((64,), tokens=True)(8).take(1)
        model.fit(data, shuffle=False, verbose=0)

    def test_random_images_are_seeded_uniform_images(self):
        x, y = testing.random_images(16, size=8, classes=4)
        self.assertEqual((x.shape, x.dtype), ((16, 8, 8, 3), np.float32))
        self.assertTrue(((x >= 0) & (x < 1)).all())
        self.assertTrue(((y >= 0) & (y < 4)).all())
        rng = np.random.default_rng(0)
        self.assertAllEqual(x, rng.random((16, 8, 8, 3), dtype=np.float32))
        self.assertAllEqual(y, rng.integers(0, 4, 16))

    def test_training_peak_bytes_reads_the_peak_or_none_on_oom(self):
        result = testing.run_with_memory_cap(_peaks_under_cap, 250)
        self.assertGreater(result["small"], 0)
        self.assertLess(result["small"], 250 * 1024 * 1024)
        self.assertIsNone(result["too_large"])
        self.assertTrue(result["fresh_train_function"])


def _peaks_under_cap():
    model = testing.reference_model("mlp")
    data = testing.random_data((256,))
    small = testing.training_peak_bytes(model, data, 64)
    fresh = model.train_function is None
    too_large = testing.training_peak_bytes(model, data, 65536)
    return {
        "small": small,
        "too_large": too_large,
        "fresh_train_function": fresh,
    }


if __name__ == "__main__":
    tf.test.main()
