"""Datasets for the examples: CIFAR-10 through TFDS, and offline digits.

Both return an *unbatched* `tf.data.Dataset` of `(image, label)` with
images as uint8 in 0..255 and labels as int64, so that `tfmemsafe.fit` can
batch it at any size (`batch_size="auto"` tries several) and models do
their own scaling. Training splits are shuffled every epoch.
"""

from __future__ import annotations

import socket
import urllib.parse

import numpy as np
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe.errors import DatasetUnavailableError

_CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
_SPLITS = ("train", "test")
_SHUFFLE_BUFFER = 10_000
_CROP_PADDING = 4


def cifar10(
    split: str = "train",
    *,
    data_dir: str | None = None,
    image_size: int | None = None,
    augment: bool = False,
    shuffle: bool | None = None,
) -> tf.data.Dataset:
    """CIFAR-10 from `tensorflow_datasets`, unbatched.

    Downloads and prepares the dataset into `data_dir` the first time.
    When it is not there and cannot be downloaded (no network), this fails
    at once with `DatasetUnavailableError`, which names the two ways out,
    instead of after minutes of download retries.

    Args:
        split: str. `"train"` or `"test"` (or any TFDS split string, such
            as `"train[:10%]"`). Defaults to `"train"`.
        data_dir: str. Where TFDS keeps prepared datasets. Defaults to
            `None`, TFDS' default (`~/tensorflow_datasets`).
        image_size: int. Resize images to this square size. Defaults to
            `None`, the original 32x32.
        augment: bool. Random horizontal flips and random crops after
            padding by 4 pixels (a different draw every epoch). Defaults to
            `False`.
        shuffle: bool. Shuffle every epoch. Defaults to `None`: shuffle the
            training split only.

    Returns:
        An unbatched `tf.data.Dataset` of `(uint8 image, int64 label)`.

    Raises:
        DatasetUnavailableError: If CIFAR-10 is not prepared in `data_dir`
            and cannot be downloaded.

    Example:
    >>> train = tfmemsafe.data.cifar10("train", augment=True)
    >>> tfmemsafe.fit(model, train, batch_size=256, epochs=10)
    """
    import tensorflow_datasets as tfds

    builder = tfds.builder("cifar10", data_dir=data_dir)
    if not builder.is_prepared():
        _download(builder, data_dir)
    dataset = builder.as_dataset(split=split, as_supervised=True)
    return _pipeline(
        dataset,
        training=_is_training(split),
        image_size=image_size,
        augment=augment,
        shuffle=shuffle,
        flip=True,
    )


def digits(
    split: str = "train",
    *,
    image_size: int = 32,
    augment: bool = False,
    shuffle: bool | None = None,
    test_fraction: float = 0.2,
) -> tf.data.Dataset:
    """Handwritten digits that ship with scikit-learn, shaped like CIFAR-10.

    1,797 real 8x8 grey images of the digits 0-9, scaled to 0..255,
    upsampled to `image_size` and repeated over 3 channels, split into
    train and test the same way every time (stratified, seed 0). Needs no
    network, so it stands in for CIFAR-10 on offline machines; accuracy on
    it means something (a small CNN reaches over 90%).

    Args:
        split: str. `"train"` or `"test"`. Defaults to `"train"`.
        image_size: int. Square output size. Defaults to 32.
        augment: bool. Random crops after padding (shifts of up to 4
            pixels at 32x32). No flips: a mirrored digit is another symbol.
            Defaults to `False`.
        shuffle: bool. Shuffle every epoch. Defaults to `None`: shuffle the
            training split only.
        test_fraction: float. The share of images held out for `"test"`.
            Defaults to 0.2 (360 test images).

    Returns:
        An unbatched `tf.data.Dataset` of `(uint8 image, int64 label)`.

    Example:
    >>> train = tfmemsafe.data.digits("train")
    >>> int(train.cardinality())
    1437
    """
    _checks.one_of("split", split, _SPLITS)
    if not 0 < test_fraction < 1:
        raise ValueError(
            "`test_fraction` must be between 0 and 1. "
            f"Received: test_fraction={test_fraction!r}"
        )
    images, labels = _digits_arrays(split, test_fraction)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    return _pipeline(
        dataset,
        training=split == "train",
        image_size=image_size,
        augment=augment,
        shuffle=shuffle,
        flip=False,
        source_size=8,
    )


def _digits_arrays(split: str, test_fraction: float):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    train_x, test_x, train_y, test_y = train_test_split(
        images,
        bunch.target.astype(np.int64),
        test_size=test_fraction,
        random_state=0,
        stratify=bunch.target,
    )
    if split == "train":
        return train_x[..., np.newaxis], train_y
    return test_x[..., np.newaxis], test_y


def _pipeline(
    dataset: tf.data.Dataset,
    *,
    training: bool,
    image_size: int | None,
    augment: bool,
    shuffle: bool | None,
    flip: bool,
    source_size: int | None = None,
) -> tf.data.Dataset:
    if image_size is not None and (
        isinstance(image_size, bool)
        or not isinstance(image_size, int)
        or image_size < 8
    ):
        raise ValueError(
            "`image_size` must be an integer >= 8 or None. "
            f"Received: image_size={image_size!r}"
        )
    size = image_size or source_size
    shuffle = training if shuffle is None else shuffle

    def prepare(image, label):
        if size is not None and image.shape[0] != size:
            image = tf.image.resize(image, (size, size), method="bilinear")
            image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), "uint8")
        if image.shape[-1] == 1:
            image = tf.image.grayscale_to_rgb(image)
        return image, tf.cast(label, tf.int64)

    # Cache the decoded originals (CIFAR-10's are 150 MB), not resized
    # copies, which can be many times larger.
    dataset = dataset.cache()
    if shuffle:
        dataset = dataset.shuffle(
            _SHUFFLE_BUFFER, reshuffle_each_iteration=True
        )
    dataset = dataset.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    if augment:
        dataset = dataset.map(
            lambda image, label: (_augment(image, flip), label),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    return dataset.prefetch(tf.data.AUTOTUNE)


def _augment(image: tf.Tensor, flip: bool) -> tf.Tensor:
    height, width, channels = image.shape
    padded = tf.image.pad_to_bounding_box(
        image,
        _CROP_PADDING,
        _CROP_PADDING,
        height + 2 * _CROP_PADDING,
        width + 2 * _CROP_PADDING,
    )
    image = tf.image.random_crop(padded, (height, width, channels))
    if flip:
        image = tf.image.random_flip_left_right(image)
    return image


def _is_training(split: str) -> bool:
    return split.split("[")[0].strip() == "train"


def _unavailable_message(data_dir, cause: str) -> str:
    where = data_dir or "the TFDS default (~/tensorflow_datasets)"
    return (
        f"CIFAR-10 is not prepared in {where} and could not be downloaded "
        f"({cause}). Either pass `data_dir` (`--data_dir`) pointing at a "
        "copy prepared on a machine with network access "
        "(`tfds.builder('cifar10', data_dir=...).download_and_prepare()`), "
        "or use the offline digits dataset (`tfmemsafe.data.digits`, "
        "`--dataset=digits`)."
    )


def _download(builder, data_dir) -> None:
    if not _download_is_mocked(builder):
        host = urllib.parse.urlparse(_CIFAR10_URL).hostname
        try:
            socket.getaddrinfo(host, 443)
        except OSError as err:
            raise DatasetUnavailableError(
                _unavailable_message(data_dir, f"cannot resolve {host}: {err}")
            ) from err
    try:
        builder.download_and_prepare()
    except (OSError, RuntimeError) as err:
        # requests' ConnectionError is an OSError; TFDS raises others as
        # RuntimeError subclasses (checksums, extraction).
        raise DatasetUnavailableError(
            _unavailable_message(data_dir, f"{type(err).__name__}: {err}")
        ) from err


def _download_is_mocked(builder) -> bool:
    # Under `tfds.testing.mock_data` nothing is downloaded, so there is no
    # network to check for.
    method = type(builder).download_and_prepare
    return getattr(method, "__module__", "").startswith(
        "tensorflow_datasets.testing"
    )
