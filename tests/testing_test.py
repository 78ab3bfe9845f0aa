"""Tests for tfmemsafe.testing: subprocesses and a real allocator OOM."""

import os
import tempfile

import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing


def _train_conv_net(batch_size, steps=2):
    """Trains a small conv net; returns the final loss."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.random((batch_size * steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch_size * steps)
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


def _not_json():
    return object()


def _raise_value_error():
    raise ValueError("the child's own message")


class MemoryCapTest(parameterized.TestCase, tf.test.TestCase):
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

    def test_timeout_kills_the_child(self):
        with self.assertRaisesRegex(
            testing.SubprocessError, r"killed by signal"
        ) as caught:
            testing.run_in_subprocess("time:sleep", args=[60], timeout=1)
        self.assertIn("still running after 1 s", caught.exception.stderr)

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


if __name__ == "__main__":
    tf.test.main()
