"""Tests for tfmemsafe.memory: readings, limits and OOM detection."""

import os
from unittest import mock

import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import memory
from tfmemsafe import testing

_MB = 1024 * 1024


def _cpu_limit_under_cap():
    import tfmemsafe

    return tfmemsafe.memory_info("CPU:0").limit_bytes


class MemoryInfoTest(parameterized.TestCase, tf.test.TestCase):
    def test_cpu_readings_grow_after_allocating_a_tensor(self):
        before = tfmemsafe.memory_info("CPU:0")
        tensor = tf.ones((1024, 1024), dtype=tf.float32)  # 4 MiB
        after = tfmemsafe.memory_info("CPU:0")
        self.assertIsNone(after.reason)
        self.assertGreaterEqual(
            after.current_bytes - before.current_bytes, 4 * _MB
        )
        self.assertGreaterEqual(after.peak_bytes, after.current_bytes)
        self.assertGreater(after.limit_bytes, 0)
        self.assertAllClose(after.current_mb, after.current_bytes / _MB)
        del tensor

    def test_reset_peak_memory_brings_peak_down_to_current(self):
        big = tf.ones((2048, 2048))  # 16 MiB, then freed
        del big
        self.assertTrue(tfmemsafe.reset_peak_memory("CPU:0"))
        info = tfmemsafe.memory_info("CPU:0")
        self.assertEqual(info.peak_bytes, info.current_bytes)

    def test_default_device_is_cpu_without_gpus(self):
        if tf.config.list_logical_devices("GPU"):
            self.skipTest("this machine has a GPU")
        self.assertEqual(tfmemsafe.default_devices(), ["CPU:0"])
        self.assertEqual(tfmemsafe.memory_info().device, "CPU:0")

    def test_default_devices_under_a_strategy_are_its_replicas(self):
        strategy = tf.distribute.MirroredStrategy(["CPU:0"])
        with strategy.scope():
            self.assertEqual(tfmemsafe.default_devices(), ["CPU:0"])

    def test_missing_device_gives_none_fields_and_a_reason(self):
        info = tfmemsafe.memory_info("GPU:7")
        self.assertIsNone(info.current_bytes)
        self.assertIsNone(info.peak_bytes)
        self.assertIn("GPU:7", info.reason)
        self.assertFalse(tfmemsafe.reset_peak_memory("GPU:7"))

    def test_limit_is_the_allocator_cap_when_one_is_set(self):
        limit = testing.run_with_memory_cap(_cpu_limit_under_cap, 300)
        self.assertEqual(limit, 300 * _MB)

    @parameterized.named_parameters(
        ("short", "GPU:0", "GPU:0"),
        ("lower_case", "cpu:0", "CPU:0"),
        ("full", "/job:worker/replica:0/task:1/device:GPU:1", "GPU:1"),
        ("device_prefix", "/device:CPU:0", "CPU:0"),
    )
    def test_device_names_are_normalised(self, given, expected):
        self.assertEqual(memory.device_name(given), expected)

    def test_logical_device_objects_are_accepted(self):
        cpu = tf.config.list_logical_devices("CPU")[0]
        self.assertEqual(memory.device_name(cpu), "CPU:0")

    def test_bad_device_names_raise(self):
        with self.assertRaisesRegex(ValueError, r"`device` must name a device"):
            tfmemsafe.memory_info("GPU")
        with self.assertRaisesRegex(TypeError, r"`device` must be a device"):
            tfmemsafe.memory_info(0)


def _resource_exhausted(message="OOM when allocating tensor"):
    return tf.errors.ResourceExhaustedError(None, None, message)


class IsOomErrorTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("resource_exhausted", _resource_exhausted()),
        (
            "dst_tensor",
            tf.errors.InternalError(
                None, None, "Dst tensor is not initialized."
            ),
        ),
        (
            "xla_internal",
            tf.errors.InternalError(
                None,
                None,
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                "1.2GiB",
            ),
        ),
        (
            "xla_unknown",
            tf.errors.UnknownError(
                None, None, "Out of memory while trying to allocate 10 bytes"
            ),
        ),
    )
    def test_oom_errors_are_recognised(self, error):
        self.assertTrue(tfmemsafe.is_oom_error(error))

    @parameterized.named_parameters(
        ("value_error", ValueError("bad label shape")),
        ("internal_other", tf.errors.InternalError(None, None, "Bad op")),
        ("invalid_argument", tf.errors.InvalidArgumentError(None, None, "x")),
        ("keyboard_interrupt", KeyboardInterrupt()),
        ("none", None),
    )
    def test_other_errors_are_not_oom(self, error):
        self.assertFalse(tfmemsafe.is_oom_error(error))

    def test_oom_found_through_the_cause_chain(self):
        try:
            try:
                raise _resource_exhausted()
            except tf.errors.ResourceExhaustedError as err:
                raise RuntimeError("step 3 failed") from err
        except RuntimeError as wrapped:
            self.assertTrue(tfmemsafe.is_oom_error(wrapped))

    def test_oom_found_through_the_context_chain(self):
        try:
            try:
                raise _resource_exhausted()
            except tf.errors.ResourceExhaustedError:
                raise ValueError("while handling it")  # noqa: B904
        except ValueError as wrapped:
            self.assertTrue(tfmemsafe.is_oom_error(wrapped))

    def test_cyclic_chains_terminate(self):
        first, second = ValueError("a"), ValueError("b")
        first.__context__, second.__context__ = second, first
        self.assertFalse(tfmemsafe.is_oom_error(first))


class CpuLimitTest(tf.test.TestCase):
    """The CPU limit follows the allocator TensorFlow was told to use."""

    def _limit(self, environment, machine_bytes):
        with (
            mock.patch.dict(os.environ, environment),
            mock.patch.object(
                memory, "machine_memory_bytes", return_value=machine_bytes
            ),
        ):
            return memory.memory_info("CPU:0").limit_bytes

    def test_bfc_without_a_cap_stops_at_tensorflows_64_gb(self):
        limit = self._limit(
            {"TF_CPU_ALLOCATOR_USE_BFC": "true"}, 128 * 1024 * _MB
        )
        self.assertEqual(limit, 64 * 1024 * _MB)

    def test_bfc_without_a_cap_on_a_small_machine_is_the_machine(self):
        limit = self._limit({"TF_CPU_ALLOCATOR_USE_BFC": "1"}, 16 * 1024 * _MB)
        self.assertEqual(limit, 16 * 1024 * _MB)

    def test_bfc_cap_wins(self):
        limit = self._limit(
            {
                "TF_CPU_ALLOCATOR_USE_BFC": "true",
                "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300",
            },
            128 * 1024 * _MB,
        )
        self.assertEqual(limit, 300 * _MB)

    def test_other_allocators_get_the_whole_machine(self):
        limit = self._limit(
            {
                "TF_CPU_ALLOCATOR_USE_BFC": "false",
                "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300",
            },
            128 * 1024 * _MB,
        )
        self.assertEqual(limit, 128 * 1024 * _MB)


if __name__ == "__main__":
    tf.test.main()
