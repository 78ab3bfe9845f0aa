"""Tests for tfmemsafe.runtime: configuration at import and by hand."""

import os
from unittest import mock

import _models
import import_order_children
import runtime_children
import tensorflow as tf
from absl.testing import parameterized

from tfmemsafe import memory
from tfmemsafe import runtime
from tfmemsafe import testing

_MB = 1024 * 1024

# What the children start from: nothing set by the user, and nothing
# imported (what happens at import is what they test). This process
# imported tfmemsafe, which set TF_CPU_ALLOCATOR_USE_BFC for itself; an
# empty value counts as unset, for TensorFlow too.
_UNSET = {
    "TFMEMSAFE_TESTING_PRELOAD": "",
    "TFMEMSAFE_AUTOCONFIGURE": "",
    "TFMEMSAFE_MEMORY_GROWTH": "",
    "TFMEMSAFE_PRECISION": "",
    "TFMEMSAFE_CPU_BFC_ALLOCATOR": "",
    "TF_CPU_ALLOCATOR_USE_BFC": "",
}


def _import_with(env, **kwargs):
    return testing.run_in_subprocess(
        runtime_children.import_and_report,
        kwargs=kwargs,
        env={**_UNSET, **env},
        timeout=120,
    )


def _in_child(target, onednn, env=(), **kwargs):
    env = {**_UNSET, "TF_ENABLE_ONEDNN_OPTS": onednn, **dict(env)}
    return testing.run_in_subprocess(
        target, kwargs=kwargs, env=env, timeout=120
    )


class _FakeGpu:
    def __init__(self, name):
        self.name = name
        self.device_type = "GPU"


class ImportConfigurationTest(parameterized.TestCase, tf.test.TestCase):
    def test_default_import_picks_float32_on_cpu_and_says_why(self):
        result = _import_with({})
        config = result["config"]
        self.assertEqual(result["policy"], "float32")
        self.assertEqual(config["dtype_policy"], "float32")
        self.assertEqual(config["precision"], "auto")
        self.assertTrue(config["memory_growth"])
        self.assertEqual(config["memory_growth_gpus"], [])
        self.assertIn("no GPU", config["reason"])
        self.assertTrue(config["cpu_bfc_allocator"])
        self.assertEqual(config["cpu_allocator"], "bfc")
        self.assertEqual(config["warnings"], [])

    @parameterized.named_parameters(
        ("mixed_float16", "mixed_float16"),
        ("mixed_bfloat16", "mixed_bfloat16"),
        ("float32", "float32"),
    )
    def test_precision_from_environment_sets_policy(self, precision):
        result = _import_with({"TFMEMSAFE_PRECISION": precision})
        self.assertEqual(result["policy"], precision)
        self.assertEqual(result["config"]["dtype_policy"], precision)
        self.assertEqual(result["config"]["reason"], "requested")

    def test_autoconfigure_off_leaves_runtime_alone(self):
        result = _import_with(
            {"TFMEMSAFE_AUTOCONFIGURE": "0", "TFMEMSAFE_PRECISION": "fp8"}
        )
        self.assertIsNone(result["config"])
        self.assertEqual(result["policy"], "float32")

    def test_memory_growth_off_from_environment(self):
        result = _import_with({"TFMEMSAFE_MEMORY_GROWTH": "false"})
        self.assertFalse(result["config"]["memory_growth"])

    def test_bad_environment_values_warn_and_fall_back(self):
        result = _import_with(
            {"TFMEMSAFE_PRECISION": "fp8", "TFMEMSAFE_MEMORY_GROWTH": "maybe"}
        )
        config = result["config"]
        self.assertEqual(config["dtype_policy"], "float32")
        self.assertTrue(config["memory_growth"])
        warnings = "\n".join(config["warnings"])
        self.assertIn("TFMEMSAFE_PRECISION='fp8'", warnings)
        self.assertIn("mixed_float16", warnings)
        self.assertIn("TFMEMSAFE_MEMORY_GROWTH='maybe'", warnings)

    def test_auto_keeps_a_policy_set_before_import(self):
        result = _import_with({}, set_policy_first="mixed_bfloat16")
        self.assertEqual(result["policy"], "mixed_bfloat16")
        self.assertIn("already set", result["config"]["reason"])

    def test_configure_again_is_idempotent_and_reports_afresh(self):
        result = testing.run_in_subprocess(
            runtime_children.configure_and_report,
            args=["mixed_bfloat16"],
            timeout=120,
        )
        self.assertEqual(result["first"], result["second"])
        self.assertEqual(result["current"], result["second"])
        self.assertEqual(result["policy"], "mixed_bfloat16")


# oneDNN off is the default on CPUs without AVX-512 VNNI/BF16 or AMX; on,
# on those that have them. Both are forced here, whatever this CPU is.
_CPU_KINDS = (("onednn_off", "0"), ("onednn_on", "1"))


class CpuAllocatorTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(*_CPU_KINDS)
    def test_import_gives_allocator_readings_on_both_cpu_kinds(self, onednn):
        result = _in_child(runtime_children.read_cpu_memory, onednn)
        self.assertEqual(result["config"]["cpu_allocator"], "bfc")
        self.assertIn(
            "set by tfmemsafe", result["config"]["cpu_allocator_reason"]
        )
        self.assertEqual(result["variable"], "true")
        self.assertIsNone(result["reason"])
        self.assertGreaterEqual(result["current_bytes"], 4 * _MB)
        self.assertGreaterEqual(result["peak_bytes"], result["current_bytes"])
        self.assertEqual(result["logged_warnings"], [])

    @parameterized.named_parameters(
        ("false", "false", "default"), ("true", "TRUE", "bfc")
    )
    def test_a_value_the_user_set_is_kept(self, value, allocator):
        result = _in_child(
            runtime_children.read_cpu_memory,
            "0",
            env={"TF_CPU_ALLOCATOR_USE_BFC": value},
        )
        config = result["config"]
        self.assertEqual(result["variable"], value)
        self.assertEqual(config["cpu_allocator"], allocator)
        self.assertIn("set before tfmemsafe", config["cpu_allocator_reason"])
        self.assertEqual(config["warnings"], [])
        self.assertEqual(result["current_bytes"] is None, value == "false")

    def test_opting_out_by_environment_leaves_the_default_allocator(self):
        result = _in_child(
            runtime_children.read_cpu_memory,
            "0",
            env={"TFMEMSAFE_CPU_BFC_ALLOCATOR": "0"},
        )
        self.assertFalse(result["config"]["cpu_bfc_allocator"])
        self.assertEqual(result["config"]["cpu_allocator"], "default")
        self.assertIn(result["variable"], (None, ""))
        self.assertIsNone(result["current_bytes"])
        self.assertIn("get_memory_info('CPU:0') failed", result["reason"])

    def test_configure_false_before_any_op_undoes_the_import(self):
        result = _in_child(
            runtime_children.read_cpu_memory, "0", configure_again=False
        )
        self.assertEqual(result["config"]["cpu_allocator"], "default")
        self.assertIn(result["variable"], (None, ""))
        self.assertIsNone(result["current_bytes"])

    def test_too_late_without_onednn_warns_once_with_what_to_do(self):
        result = _in_child(
            runtime_children.read_cpu_memory,
            "0",
            run_op_first=True,
            configure_again=True,
        )
        config = result["config"]
        self.assertEqual(config["cpu_allocator"], "default")
        self.assertIn(result["variable"], (None, ""))
        self.assertIsNone(result["current_bytes"])
        self.assertLen(config["warnings"], 1)
        self.assertIn("Import tfmemsafe before", config["warnings"][0])
        self.assertIn("TF_CPU_ALLOCATOR_USE_BFC=true", config["warnings"][0])
        # Logged by the import, not again by the second configure().
        self.assertEqual(result["logged_warnings"], config["warnings"])

    def test_too_late_with_onednn_keeps_its_allocator_quietly(self):
        result = _in_child(
            runtime_children.read_cpu_memory, "1", run_op_first=True
        )
        self.assertEqual(result["config"]["cpu_allocator"], "onednn")
        self.assertEqual(result["config"]["warnings"], [])
        self.assertIn(result["variable"], (None, ""))
        self.assertGreaterEqual(result["current_bytes"], 4 * _MB)

    @parameterized.named_parameters(*_CPU_KINDS)
    def test_memory_monitor_reads_the_allocator_by_default(self, onednn):
        result = _in_child(runtime_children.monitor_sources, onednn)
        self.assertIsNone(result["reason"])
        self.assertEqual(result["sources"], ["allocator"])
        self.assertGreater(result["memory_peak_mb"][0], 0)

    def test_no_64_gb_cap_on_a_larger_machine(self):
        with (
            mock.patch.dict(os.environ, _UNSET),
            mock.patch.object(runtime, "_environment_set", {}),
            mock.patch.object(
                runtime, "_cpu_device_exists", return_value=False
            ),
            _models.machine_memory(128 * 1024 * _MB),
        ):
            allocator, reason = runtime._set_cpu_allocator(True, [])
            self.assertEqual(
                runtime._set_cpu_allocator(True, []), (allocator, reason)
            )
            self.assertEqual(os.environ["TF_CPU_ALLOCATOR_USE_BFC"], "true")
            self.assertEqual(
                os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"], str(128 * 1024)
            )
            self.assertEqual(memory.memory_info("CPU:0").limit_mb, 128 * 1024)
        self.assertEqual(allocator, "bfc")
        self.assertIn("TF_CPU_BFC_MEM_LIMIT_IN_MB=131072", reason)

    def test_a_smaller_machine_gets_no_limit_variable(self):
        with (
            mock.patch.dict(os.environ, _UNSET),
            mock.patch.object(runtime, "_environment_set", {}),
            mock.patch.object(
                runtime, "_cpu_device_exists", return_value=False
            ),
            _models.machine_memory(16 * 1024 * _MB),
        ):
            os.environ.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
            runtime._set_cpu_allocator(True, [])
            self.assertNotIn("TF_CPU_BFC_MEM_LIMIT_IN_MB", os.environ)
            self.assertEqual(memory.memory_info("CPU:0").limit_mb, 16 * 1024)

    def test_an_empty_limit_variable_is_dropped(self):
        # TensorFlow would read it as a limit of 0 bytes and crash.
        with (
            mock.patch.dict(
                os.environ, {**_UNSET, "TF_CPU_BFC_MEM_LIMIT_IN_MB": " "}
            ),
            mock.patch.object(runtime, "_environment_set", {}),
            mock.patch.object(
                runtime, "_cpu_device_exists", return_value=False
            ),
        ):
            runtime._set_cpu_allocator(True, [])
            self.assertNotIn("TF_CPU_BFC_MEM_LIMIT_IN_MB", os.environ)


class ConfigureArgumentsTest(parameterized.TestCase, tf.test.TestCase):
    def test_unknown_precision_raises(self):
        with self.assertRaisesRegex(
            ValueError, r"`precision` must be one of .* precision='fp8'"
        ):
            runtime.configure(precision="fp8")

    def test_non_boolean_cpu_bfc_allocator_raises(self):
        with self.assertRaisesRegex(
            ValueError, r"`cpu_bfc_allocator` must be True or False\. .*'no'"
        ):
            runtime.configure(cpu_bfc_allocator="no")

    def test_non_boolean_memory_growth_raises(self):
        with self.assertRaisesRegex(
            ValueError, r"`memory_growth` must be True or False\. .*'yes'"
        ):
            runtime.configure(memory_growth="yes")


class PolicyChoiceTest(parameterized.TestCase, tf.test.TestCase):
    """The GPU branches, with device details faked: no GPU runs here."""

    def _choose(self, capabilities):
        gpus = [_FakeGpu(f"/physical_device:GPU:{i}") for i in range(2)]
        details = dict(zip([g.name for g in gpus], capabilities, strict=True))
        with mock.patch.object(
            tf.config.experimental,
            "get_device_details",
            lambda gpu: {"compute_capability": details[gpu.name]},
        ):
            return runtime._choose_policy("auto", gpus)

    def test_auto_picks_mixed_float16_when_every_gpu_has_tensor_cores(self):
        policy, reason = self._choose([(8, 0), (7, 0)])
        self.assertEqual(policy, "mixed_float16")
        self.assertIn(">= 7.0", reason)

    def test_auto_picks_float32_when_one_gpu_is_older(self):
        policy, reason = self._choose([(8, 6), (6, 1)])
        self.assertEqual(policy, "float32")
        self.assertIn("GPU:1 (compute capability 6.1)", reason)

    def test_auto_picks_float32_when_capability_is_unknown(self):
        policy, reason = self._choose([(8, 0), None])
        self.assertEqual(policy, "float32")
        self.assertIn("unknown", reason)

    def test_initialized_runtime_records_a_warning_instead_of_raising(self):
        gpu = _FakeGpu("/physical_device:GPU:0")
        error = RuntimeError(
            "Physical devices cannot be modified after being initialized"
        )
        warnings = []
        with (
            mock.patch.object(
                tf.config.experimental,
                "set_memory_growth",
                side_effect=error,
            ),
            mock.patch.object(
                tf.config.experimental, "get_memory_growth", return_value=False
            ),
        ):
            grown = runtime._set_memory_growth([gpu], warnings)
        self.assertEqual(grown, ())
        self.assertLen(warnings, 1)
        self.assertIn("TF_FORCE_GPU_ALLOW_GROWTH=true", warnings[0])
        self.assertIn("Import tfmemsafe before", warnings[0])

    def test_real_gpus_get_memory_growth(self):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            self.skipTest("needs a GPU")
        config = runtime.configure(precision="float32")
        self.assertLen(config.memory_growth_gpus, len(gpus))
        for gpu in gpus:
            self.assertTrue(tf.config.experimental.get_memory_growth(gpu))


class TensorFlowLogsTest(tf.test.TestCase):
    """TensorFlow's allocator dump stays out of sight when tfmemsafe is
    imported first; the one line that counts a failed allocation stays."""

    def _run(self, **kwargs):
        return testing.run_with_memory_cap(
            import_order_children.out_of_memory_lines,
            200,
            kwargs=kwargs,
            # Whatever this process was started with: tfmemsafe decides,
            # in a process that has not imported TensorFlow yet.
            env={"TF_CPP_MIN_LOG_LEVEL": "", "TFMEMSAFE_TESTING_PRELOAD": ""},
        )

    def test_importing_tfmemsafe_first_hides_the_allocator_dump(self):
        hidden, shown = (
            self._run(),
            self._run(tensorflow_first=True),
        )
        self.assertEqual(hidden["allocator_failures"], 1)
        self.assertEqual(shown["allocator_failures"], 1)
        self.assertIn("INFO hidden", hidden["tensorflow_logs"])
        self.assertIn("imported before tfmemsafe", shown["tensorflow_logs"])
        # The dump is one INFO line per bin and chunk: dozens even in a
        # fresh process, ~1,900 after training.
        self.assertLess(hidden["lines"], 20)
        self.assertGreater(shown["lines"], hidden["lines"] + 20)


if __name__ == "__main__":
    tf.test.main()
