"""Tests for tfmemsafe.runtime: configuration at import and by hand."""

from unittest import mock

import runtime_children
import tensorflow as tf
from absl.testing import parameterized

from tfmemsafe import runtime
from tfmemsafe import testing


def _import_with(env, **kwargs):
    env = {
        "TFMEMSAFE_AUTOCONFIGURE": "",
        "TFMEMSAFE_MEMORY_GROWTH": "",
        "TFMEMSAFE_PRECISION": "",
        **env,
    }
    return testing.run_in_subprocess(
        runtime_children.import_and_report, kwargs=kwargs, env=env, timeout=120
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


class ConfigureArgumentsTest(parameterized.TestCase, tf.test.TestCase):
    def test_unknown_precision_raises(self):
        with self.assertRaisesRegex(
            ValueError, r"`precision` must be one of .* precision='fp8'"
        ):
            runtime.configure(precision="fp8")

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


if __name__ == "__main__":
    tf.test.main()
