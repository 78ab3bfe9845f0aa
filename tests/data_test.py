"""Tests for tfmemsafe.data: CIFAR-10 through TFDS, and offline digits."""

import socket
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl.testing import parameterized

from tfmemsafe import data
from tfmemsafe.errors import DatasetUnavailableError


def _labels(dataset):
    return np.array([int(label) for _, label in dataset])


class DigitsTest(parameterized.TestCase, tf.test.TestCase):
    def test_split_sizes_shapes_and_dtypes(self):
        train, test = data.digits("train"), data.digits("test")
        self.assertEqual(int(train.cardinality()), 1437)
        self.assertEqual(int(test.cardinality()), 360)
        image_spec, label_spec = train.element_spec
        self.assertEqual(image_spec.shape, (32, 32, 3))
        self.assertEqual(image_spec.dtype, tf.uint8)
        self.assertEqual(label_spec.dtype, tf.int64)

    def test_split_is_the_same_every_time_and_disjoint_in_content(self):
        first = _labels(data.digits("test"))
        second = _labels(data.digits("test"))
        self.assertAllEqual(first, second)
        self.assertCountEqual(np.unique(first), range(10))
        train_images = {
            image.numpy().tobytes() for image, _ in data.digits("train")
        }
        test_images = [
            image.numpy().tobytes() for image, _ in data.digits("test")
        ]
        overlap = sum(image in train_images for image in test_images)
        # sklearn's digits hold a few exact duplicates; a shared split
        # would overlap in hundreds.
        self.assertLess(overlap, 10)

    def test_training_split_is_reshuffled_each_epoch(self):
        train = data.digits("train")
        self.assertNotAllEqual(_labels(train), _labels(train))
        self.assertCountEqual(_labels(train), _labels(train))

    def test_images_use_the_full_uint8_range_on_three_equal_channels(self):
        image, _ = next(iter(data.digits("test")))
        image = image.numpy()
        self.assertGreater(image.max(), 200)
        self.assertEqual(image.min(), 0)
        self.assertAllEqual(image[..., 0], image[..., 2])

    def test_image_size(self):
        image, _ = next(iter(data.digits("test", image_size=16)))
        self.assertEqual(image.shape, (16, 16, 3))

    def test_augmentation_shifts_but_never_mirrors(self):
        plain = next(iter(data.digits("test")))[0].numpy()
        padded = np.pad(plain, ((4, 4), (4, 4), (0, 0)))
        shifts = [
            padded[dy : dy + 32, dx : dx + 32]
            for dy in range(9)
            for dx in range(9)
        ]
        augmented = [
            image.numpy()
            for image, _ in data.digits("test", augment=True).take(1).repeat(8)
        ]
        self.assertTrue(any((a != plain).any() for a in augmented))
        for image in augmented:
            self.assertTrue(any((image == s).all() for s in shifts))

    @parameterized.named_parameters(
        ("split", {"split": "validation"}, r"`split` must be one of"),
        ("fraction", {"test_fraction": 1.5}, r"`test_fraction` must be"),
        ("size", {"image_size": 4}, r"`image_size` must be an integer >= 8"),
    )
    def test_bad_arguments_raise(self, kwargs, pattern):
        with self.assertRaisesRegex(ValueError, pattern):
            data.digits(**kwargs)


class Cifar10Test(parameterized.TestCase, tf.test.TestCase):
    def test_mock_cifar10_gives_unbatched_uint8_images(self):
        with tfds.testing.mock_data(num_examples=12):
            train = data.cifar10("train", image_size=48, augment=True)
            batch = list(train.batch(4))
        self.assertLen(batch, 3)
        images, labels = batch[0]
        self.assertEqual(images.shape, (4, 48, 48, 3))
        self.assertEqual(images.dtype, tf.uint8)
        self.assertEqual(labels.dtype, tf.int64)

    def test_offline_fails_fast_with_both_ways_out(self):
        with (
            tempfile.TemporaryDirectory() as data_dir,
            mock.patch.object(
                socket,
                "getaddrinfo",
                side_effect=socket.gaierror(-2, "Name or service not known"),
            ),
        ):
            with self.assertRaisesRegex(
                DatasetUnavailableError,
                r"CIFAR-10 is not prepared in .* could not be downloaded",
            ) as caught:
                data.cifar10("train", data_dir=data_dir)
        message = str(caught.exception)
        self.assertIn("--data_dir", message)
        self.assertIn("--dataset=digits", message)
        self.assertIn("Name or service not known", message)
        self.assertIsInstance(caught.exception.__cause__, socket.gaierror)

    def test_failed_download_is_explained_and_chained(self):
        failure = ConnectionError("Max retries exceeded")
        with (
            tempfile.TemporaryDirectory() as data_dir,
            mock.patch.object(socket, "getaddrinfo", return_value=[]),
            mock.patch.object(
                tfds.core.DatasetBuilder,
                "download_and_prepare",
                side_effect=failure,
            ),
        ):
            with self.assertRaisesRegex(
                DatasetUnavailableError, r"ConnectionError: Max retries"
            ) as caught:
                data.cifar10("test", data_dir=data_dir)
        self.assertIs(caught.exception.__cause__, failure)


if __name__ == "__main__":
    tf.test.main()
