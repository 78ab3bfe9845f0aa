"""End-to-end tests of the example scripts, on mock CIFAR-10 and digits.

Each script's `main` runs in this process with its flags set through
`flagsaver`, for one short epoch of a tiny network; what needs a fresh
process (a memory cap, a mixed-precision policy) runs in one.
"""

import csv
import json
import os
import socket
import sys
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import app
from absl import flags
from absl.testing import flagsaver
from absl.testing import parameterized
from matplotlib import image as mpimg

import tfmemsafe

_EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"
)
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import cifar10_cnn  # noqa: E402
import cifar10_dcgan  # noqa: E402
import cifar10_transfer  # noqa: E402

_SCRIPTS = {
    "cnn": cifar10_cnn,
    "transfer": cifar10_transfer,
    "dcgan": cifar10_dcgan,
}
# The smallest settings that still run every part of each script.
_TINY = {
    "cnn": {"filters": ["4", "8"]},
    "transfer": {"weights": "none", "alpha": "0.35", "resize_to": 32},
    "dcgan": {
        "latent_dim": 8,
        "generator_filters": 4,
        "discriminator_filters": 4,
        "sample_grid": 2,
    },
}
_SHORT = {"batch_size": "16", "epochs": 1, "steps_per_epoch": 3}
_MOCK_EXAMPLES = 48


def setUpModule():
    # pytest does not parse absl flags; the scripts read them.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _run(script: str, **overrides) -> dict:
    """Runs a script's main with tiny flags; returns its summary.json."""
    settings = {**_SHORT, **_TINY[script], **overrides}
    with flagsaver.flagsaver(**settings):
        _SCRIPTS[script].main(["program"])
    with open(os.path.join(settings["model_dir"], "summary.json")) as f:
        return json.load(f)


def _history(directory: str) -> list[dict]:
    with open(os.path.join(directory, "history.csv")) as f:
        return list(csv.DictReader(f))


def _run_cnn_as_a_worker(model_dir: str) -> dict:
    """In a worker process of a local cluster: the CNN script's main."""
    setUpModule()
    settings = {**_SHORT, **_TINY["cnn"], "dataset": "digits"}
    with flagsaver.flagsaver(**settings, model_dir=model_dir):
        cifar10_cnn.main(["program"])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    directory = (
        os.path.join(model_dir, f"worker_{index}") if index else model_dir
    )
    with open(os.path.join(directory, "summary.json")) as f:
        summary = json.load(f)
    return {"summary": summary, "files": sorted(os.listdir(directory))}


def _run_dcgan_in_mixed_precision(model_dir: str) -> dict:
    """In a fresh process: the DCGAN under mixed_float16 (global policy)."""
    sys.path.insert(0, _EXAMPLES)
    setUpModule()
    import cifar10_dcgan as dcgan

    settings = {
        **_SHORT,
        **_TINY["dcgan"],
        "dataset": "digits",
        "precision": "mixed_float16",
        "accumulation_steps": 2,
        "model_dir": model_dir,
    }
    with flagsaver.flagsaver(**settings):
        dcgan.main(["program"])
        gan = dcgan.DCGAN(
            generator=dcgan.build_generator(8, 4),
            discriminator=dcgan.build_discriminator(4),
        )
        gan.compile(keras.optimizers.Adam(), keras.optimizers.Adam())
    return {
        "policy": keras.config.dtype_policy().name,
        "optimizers": [
            type(gan.generator_optimizer).__name__,
            type(gan.discriminator_optimizer).__name__,
        ],
    }


class ExamplesTest(parameterized.TestCase, tf.test.TestCase):
    def tearDown(self):
        keras.backend.clear_session()
        super().tearDown()

    def _model_dir(self) -> str:
        return self.create_tempdir().full_path

    @parameterized.named_parameters(
        ("digits_checkpointed_accumulating", "digits", True, 2),
        ("mock_cifar10", "cifar10", False, 1),
    )
    def test_cnn_trains_evaluates_and_writes_its_outputs(
        self, dataset, checkpointing, accumulation_steps
    ):
        model_dir = self._model_dir()
        with tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES):
            summary = _run(
                "cnn",
                dataset=dataset,
                checkpointing=checkpointing,
                accumulation_steps=accumulation_steps,
                model_dir=model_dir,
            )
        accuracy = summary["results"]["test accuracy"]
        self.assertBetween(accuracy, 0.0, 1.0)
        (run,) = summary["runs"]
        self.assertEqual(run["epochs"], 1)
        self.assertEqual(run["batch_size"], 16)
        self.assertEqual(run["accumulation_steps"], accumulation_steps)
        self.assertEqual(run["oom_recoveries"], [])
        self.assertGreater(run["peak_memory_mb"]["CPU:0"], 0)
        # On every kind of CPU (tfmemsafe sets the BFC allocator).
        self.assertEqual(run["memory_source"]["CPU:0"], "allocator")
        self.assertLen(_history(model_dir), 1)
        self.assertGreater(mpimg.imread(f"{model_dir}/memory.png").size, 0)

        model = keras.saving.load_model(f"{model_dir}/model.keras")
        self.assertIsInstance(model, tfmemsafe.AccumulatingModel)
        self.assertEqual(model.accumulation_steps, accumulation_steps)
        wrapped = [
            layer
            for layer in model.layers
            if isinstance(layer, tfmemsafe.Checkpointed)
        ]
        self.assertEqual(bool(wrapped), checkpointing)
        images = np.zeros((2, 32, 32, 3), np.uint8)
        self.assertEqual(model.predict(images, verbose=0).shape, (2, 10))

    def test_auto_batch_size_is_searched_and_reported(self):
        model_dir = self._model_dir()
        with tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES):
            # The whole split is one batch: no `steps_per_epoch` of 3.
            summary = _run(
                "cnn",
                dataset="cifar10",
                batch_size="auto",
                steps_per_epoch=None,
                model_dir=model_dir,
            )
        # Without a memory limit in reach, the search stops at the number
        # of training samples.
        self.assertEqual(summary["runs"][0]["batch_size"], _MOCK_EXAMPLES)

    def test_transfer_caches_features_then_fine_tunes_on_mock_cifar10(self):
        model_dir = self._model_dir()
        with tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES):
            summary = _run(
                "transfer",
                dataset="cifar10",
                cache_features=True,
                fine_tune_epochs=1,
                fine_tune_layers=10,
                model_dir=model_dir,
            )
        frozen, fine_tuning = summary["runs"]
        self.assertEqual(frozen["name"], "frozen backbone")
        self.assertEqual(fine_tuning["name"], "fine-tuning")
        self.assertEqual(fine_tuning["batch_size"], 16)
        self.assertBetween(summary["results"]["test accuracy"], 0.0, 1.0)
        # One history for both phases, the fine-tuning epoch numbered on.
        epochs = [row["epoch"] for row in _history(model_dir)]
        self.assertEqual(epochs, ["0", "1"])
        for phase in ("frozen_backbone", "fine-tuning"):
            self.assertTrue(os.path.isfile(f"{model_dir}/memory_{phase}.png"))
        model = keras.saving.load_model(f"{model_dir}/model.keras")
        trainable = {w.path for w in model.trainable_weights}
        self.assertTrue(any("block_16" in path for path in trainable))
        self.assertFalse(any("block_1_" in path for path in trainable))

    def test_transfer_trains_the_head_on_digits_images(self):
        model_dir = self._model_dir()
        summary = _run("transfer", dataset="digits", model_dir=model_dir)
        (run,) = summary["runs"]
        self.assertEqual(run["name"], "frozen backbone")
        self.assertEqual(run["batch_size"], 16)
        self.assertEqual(run["epochs"], 1)
        self.assertTrue(os.path.isfile(f"{model_dir}/memory.png"))
        model = keras.saving.load_model(f"{model_dir}/model.keras")
        self.assertEmpty(model.get_layer("backbone").trainable_weights)

    @parameterized.named_parameters(
        ("digits", "digits", 1), ("mock_cifar10", "cifar10", 2)
    )
    def test_dcgan_trains_both_networks_and_writes_sample_grids(
        self, dataset, accumulation_steps
    ):
        model_dir = self._model_dir()
        with tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES):
            summary = _run(
                "dcgan",
                dataset=dataset,
                epochs=2,
                accumulation_steps=accumulation_steps,
                model_dir=model_dir,
            )
        for loss in ("discriminator loss", "generator loss"):
            self.assertTrue(np.isfinite(summary["results"][loss]))
        self.assertEqual(summary["runs"][0]["epochs"], 2)
        for epoch in (1, 2):
            grid = mpimg.imread(f"{model_dir}/samples_epoch_{epoch:03d}.png")
            # 2x2 images of 32 pixels with 2-pixel gaps.
            self.assertEqual(grid.shape[:2], (2 * 34 + 2, 2 * 34 + 2))
        generator = keras.saving.load_model(f"{model_dir}/generator.keras")
        images = generator.predict(np.zeros((3, 8), np.float32), verbose=0)
        self.assertEqual(images.shape, (3, 32, 32, 3))
        self.assertAllInRange(images, -1.0, 1.0)
        self.assertTrue(os.path.isfile(f"{model_dir}/discriminator.keras"))

    def test_dcgan_under_mixed_precision_uses_loss_scale_optimizers(self):
        model_dir = self._model_dir()
        result = tfmemsafe.testing.run_in_subprocess(
            _run_dcgan_in_mixed_precision, args=[model_dir]
        )
        self.assertEqual(result["policy"], "mixed_float16")
        self.assertEqual(result["optimizers"], ["LossScaleOptimizer"] * 2)
        with open(f"{model_dir}/summary.json") as f:
            summary = json.load(f)
        for loss in ("discriminator loss", "generator loss"):
            self.assertTrue(np.isfinite(summary["results"][loss]))
        self.assertEqual(summary["runs"][0]["accumulation_steps"], 2)

    def test_memory_cap_reruns_the_script_and_recovers_from_oom(self):
        # Filters 8,16 at batch 1024 run out of the 210 MB cap; 512 fits.
        model_dir = self._model_dir()
        summary = _run(
            "cnn",
            dataset="digits",
            filters=["8", "16"],
            batch_size="1024",
            steps_per_epoch=1,
            memory_cap_mb=210,
            # A real error to recover from: the pre-flight check would
            # start at a size predicted to fit (planning_test tests it).
            preflight=False,
            model_dir=model_dir,
        )
        (run,) = summary["runs"]
        (event,) = run["oom_recoveries"]
        # With `steps_per_epoch`, the batch is kept and split in its step.
        self.assertEqual(event["batch_size_before"], 1024)
        self.assertEqual(event["batch_size_after"], 1024)
        self.assertGreaterEqual(event["split_into"], 2)
        self.assertEqual(run["memory_limit_mb"]["CPU:0"], 210)
        self.assertLess(run["peak_memory_mb"]["CPU:0"], 210)

    @parameterized.named_parameters(
        ("cnn", "cnn"), ("transfer", "transfer"), ("dcgan", "dcgan")
    )
    def test_offline_cifar10_exits_with_both_ways_out(self, script):
        unreachable = socket.gaierror(-2, "Name or service not known")
        with (
            mock.patch.object(socket, "getaddrinfo", side_effect=unreachable),
            self.assertRaises(SystemExit) as caught,
        ):
            _run(
                script,
                dataset="cifar10",
                data_dir=self.create_tempdir().full_path,
                model_dir=self._model_dir(),
            )
        message = str(caught.exception.code)
        self.assertStartsWith(message, "error: CIFAR-10 is not prepared in")
        self.assertIn("--data_dir", message)
        self.assertIn("--dataset=digits", message)
        self.assertIn("Name or service not known", message)

    def test_cnn_runs_as_two_workers_when_tf_config_is_set(self):
        model_dir = self._model_dir()
        chief, other = tfmemsafe.testing.run_workers(
            _run_cnn_as_a_worker,
            2,
            args=[model_dir],
            env={"CUDA_VISIBLE_DEVICES": ""},
            timeout=300,
        )
        self.assertEqual(
            os.path.dirname(chief["summary"]["outputs"][0]), model_dir
        )
        self.assertEqual(
            os.path.dirname(other["summary"]["outputs"][0]),
            os.path.join(model_dir, "worker_1"),
        )
        for worker in (chief, other):
            self.assertIn("model.keras", worker["files"])
            self.assertIn("history.csv", worker["files"])
        # One model trained together: the same result on both workers.
        self.assertEqual(
            chief["summary"]["results"], other["summary"]["results"]
        )
        # The chief's epoch backup is removed when training completes.
        self.assertFalse(os.path.exists(os.path.join(model_dir, "backup")))

    @parameterized.named_parameters(
        ("batch_size", "cnn", {"batch_size": "0"}, r"--batch_size must be"),
        ("words", "dcgan", {"batch_size": "big"}, r"--batch_size must be"),
        ("filters", "cnn", {"filters": ["8", "x"]}, r"--filters must be"),
        (
            "too_many_blocks",
            "cnn",
            {"filters": ["4"] * 6},
            r"--filters can list at most 5",
        ),
        (
            "augmented_cache",
            "transfer",
            {"cache_features": True, "augment": True},
            r"--augment cannot be used with --cache_features",
        ),
        (
            "auto_batch_cache",
            "transfer",
            {"cache_features": True, "batch_size": "auto"},
            r"--batch_size=auto searches",
        ),
        (
            "fine_tune_layers_alone",
            "transfer",
            {"fine_tune_layers": 5},
            r"--fine_tune_layers only applies to fine-tuning",
        ),
        (
            "missing_weights_file",
            "transfer",
            {"weights": "/no/such/weights.h5"},
            r"--weights must be imagenet, none or the path",
        ),
    )
    def test_bad_flag_combination_raises_usage_error(
        self, script, overrides, pattern
    ):
        with self.assertRaisesRegex(app.UsageError, pattern):
            _run(script, model_dir=self._model_dir(), **overrides)

    def test_words_that_are_not_flags_raise_usage_error(self):
        with self.assertRaisesRegex(app.UsageError, r"Expected only flags"):
            cifar10_cnn.main(["program", "digits"])


if __name__ == "__main__":
    tf.test.main()
