"""MobileNetV2's ImageNet weights: the sizes they exist for, the download."""

from __future__ import annotations

import os

import keras
import tensorflow as tf
from absl import logging

# Where Keras downloads MobileNetV2 weights from, and the sizes they exist for.
_WEIGHTS_URL = (
    "https://storage.googleapis.com/tensorflow/keras-applications/mobilenet_v2/"
)
_WEIGHTS_FILE = (
    "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_{}_{}_no_top.h5"
)
IMAGENET_SIZES = (96, 128, 160, 192, 224)
ALPHAS = (0.35, 0.5, 0.75, 1.0, 1.3, 1.4)


def check_weights(weights):
    """`weights` if it is "imagenet", `None` or an existing file's path."""
    if weights is None or weights == "imagenet":
        return weights
    if isinstance(weights, (str, os.PathLike)):
        path = os.fspath(weights)
        if tf.io.gfile.exists(path):
            return path
    raise ValueError(
        "`weights` must be 'imagenet', None or the path of an existing "
        f"weights file. Received: weights={weights!r}"
    )


def download(alpha: float, side: tuple[int, int]) -> str:
    """Returns the local path of the ImageNet weights, downloading them."""
    height, width = side
    size = height if height == width and height in IMAGENET_SIZES else 224
    if size != height or size != width:
        logging.warning(
            "ImageNet weights for MobileNetV2 exist for square images of "
            "%s pixels; using the %d px weights for %dx%d inputs, whose "
            "features will be weaker. Pass `resize_to=%d` for a native size.",
            ", ".join(map(str, IMAGENET_SIZES)),
            size,
            height,
            width,
            IMAGENET_SIZES[0],
        )
    filename = _WEIGHTS_FILE.format(float(alpha), size)
    url = _WEIGHTS_URL + filename
    try:
        return keras.utils.get_file(filename, url, cache_subdir="models")
    # `get_file` raises a bare `Exception` for network failures.
    except Exception as err:
        raise RuntimeError(
            f"Could not download the ImageNet weights for MobileNetV2 "
            f"(alpha={alpha}, {size} px) from {url}: {err}. Without "
            "internet access, either pass `weights=None` to train from "
            "random weights, or download that file on another machine and "
            "pass its path, `weights='/path/to/" + filename + "'` (or copy "
            "it to ~/.keras/models/, where Keras looks first)."
        ) from err
