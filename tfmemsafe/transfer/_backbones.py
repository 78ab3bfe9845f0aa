"""A frozen MobileNetV2 classifier that preprocesses its own input.

A frozen backbone needs no gradients and no stored activations for the
backward pass, so it trains in a fraction of the memory of full
fine-tuning. `build_frozen_mobilenet_v2` builds such a classifier, with
the backbone inside `InferenceMode`; `unfreeze` (in `_unfreeze.py`) makes
the top of its backbone trainable for fine-tuning. Because a frozen
backbone computes the same features every epoch, they can also be
computed once and the head trained on them alone: see `cache_features`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.transfer import _imagenet_weights
from tfmemsafe.transfer._imagenet_weights import ALPHAS
from tfmemsafe.transfer._imagenet_weights import IMAGENET_SIZES

_MIN_SIZE = 32

# The pooled backbone output: where the frozen part ends and the head starts.
FEATURES_LAYER = "features"


@keras.saving.register_keras_serializable(package="tfmemsafe")
class InferenceMode(keras.layers.Wrapper):
    """Runs a layer in inference mode, even while the model trains.

    The Keras transfer-learning recipe calls a backbone with
    `training=False` so that its BatchNormalization layers keep their
    pretrained statistics when it is unfrozen. In Keras 3 a functional
    model passes its own `training` argument down to every layer,
    overriding that `training=False` during `fit` (keras-team/keras#20285):
    unfrozen BatchNormalization layers then normalise with batch
    statistics and overwrite their moving averages. This wrapper makes the
    call argument stick. The wrapped layer's weights stay trainable or not
    as its `trainable` flags say.

    Args:
        layer: The layer or model to run in inference mode.
        **kwargs: Base layer arguments, such as `name`.

    Example:
    >>> backbone = keras.applications.MobileNetV2(include_top=False)
    >>> features = tfmemsafe.InferenceMode(backbone)(inputs)
    """

    def call(self, inputs):
        return self.layer(inputs, training=False)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)


def build_frozen_mobilenet_v2(
    input_shape: Sequence[int] | tf.TensorShape = (32, 32, 3),
    num_classes: int = 10,
    *,
    weights: str | os.PathLike | None = "imagenet",
    alpha: float = 1.0,
    resize_to: int | None = None,
    augmentation: keras.layers.Layer | Sequence[keras.layers.Layer] = (),
    head_units: int | Sequence[int] = (),
    dropout: float = 0.2,
    accumulation_steps: int = 1,
) -> keras.Model:
    """Builds an image classifier on a frozen MobileNetV2 backbone.

    The model takes raw images (uint8, or floats in 0..255) and does its
    own preprocessing: optional `augmentation` (active only in training),
    MobileNetV2's scaling to -1..1 (`mobilenet_v2.preprocess_input`), and
    an optional resize. The backbone has `trainable = False` and runs
    inside `InferenceMode`, which calls it with `training=False` every
    time, so its BatchNormalization statistics stay fixed even after
    `unfreeze`. A global average pooling layer named `"features"`
    follows, then the head: `head_units` dense ReLU layers, dropout and a
    softmax classifier computed in float32, so the output (and the loss)
    stay float32 under a mixed precision policy.

    With `weights=None` the backbone is random and its BatchNormalization
    statistics untouched, so its features are close to zero: use it for
    tests, memory measurements, or to load weights into later, not to
    train from scratch.

    ImageNet weights exist for square inputs of 96, 128, 160, 192 and 224
    pixels. Small images such as CIFAR-10's 32x32 give the pretrained
    filters objects a few pixels wide; `resize_to=96` upsamples them to the
    smallest pretrained size, which usually gives much better features at
    9x the activation memory of 32x32 (memory grows with the square of the
    side: 224 costs 49x).

    Args:
        input_shape: Sequence of 3 ints (a tuple, a list or a fully
            known `tf.TensorShape` such as
            `dataset.element_spec[0].shape`). The image shape, channels
            last. Defaults to `(32, 32, 3)`.
        num_classes: int. The number of classes, at least 2. Defaults to
            10.
        weights: `"imagenet"`, `None` (random initialisation) or the path
            of a MobileNetV2 backbone weights file (`include_top=False`),
            such as the Keras ImageNet file downloaded elsewhere or a file
            written by `backbone.save_weights()`. Defaults to `"imagenet"`.
        alpha: float. The width multiplier, one of 0.35, 0.5, 0.75, 1.0,
            1.3 and 1.4 (the widths ImageNet weights exist for). Defaults
            to 1.0.
        resize_to: int. The side, in pixels, that images are resized to
            before the backbone; at least 32. Defaults to `None`: no
            resizing.
        augmentation: A Keras layer or a sequence of layers (such as
            `keras.layers.RandomFlip("horizontal")`) applied to the raw
            images in training only. Defaults to none. A model with
            augmentation cannot use `cache_features`.
        head_units: int or sequence of ints. The sizes of dense ReLU layers
            between the pooled features and the classifier. Defaults to
            none.
        dropout: float. The dropout rate before the classifier, in
            [0, 1). Defaults to 0.2.
        accumulation_steps: int. The model's `accumulation_steps`: how
            many batches it accumulates gradients over before each update.
            Defaults to 1 (an update per batch, as a plain model).

    Returns:
        An uncompiled `tfmemsafe.AccumulatingModel` (a `keras.Model`).

    Raises:
        ValueError: If an argument is out of range, or `weights` is
            neither `"imagenet"`, `None` nor an existing file.
        RuntimeError: If `weights="imagenet"` and the weights cannot be
            downloaded (for example without internet access). The
            download error is chained as `__cause__`.

    Example:
    >>> model = tfmemsafe.build_frozen_mobilenet_v2(
    ...     (32, 32, 3), 10, weights=None, alpha=0.35)
    >>> model.compile(optimizer="adam",
    ...               loss="sparse_categorical_crossentropy",
    ...               metrics=["accuracy"])
    >>> model.output.dtype
    'float32'
    """
    height, width = _check_input_shape(input_shape, resize_to)
    _checks.integer("num_classes", num_classes, 2)
    _checks.one_of("alpha", alpha, ALPHAS)
    head_units = _check_head_units(head_units)
    _checks.fraction("dropout", dropout, what="a float")
    _checks.integer("accumulation_steps", accumulation_steps)
    augmentation = _check_augmentation(augmentation)
    weights = _imagenet_weights.check_weights(weights)

    side = (resize_to, resize_to) if resize_to else (height, width)
    if weights == "imagenet":
        weights = _imagenet_weights.download(alpha, side)
    backbone = keras.applications.MobileNetV2(
        input_shape=(*side, 3),
        alpha=alpha,
        include_top=False,
        weights=weights,
    )
    backbone.trainable = False

    inputs = keras.Input(shape=(height, width, 3), name="images")
    x = inputs
    for layer in augmentation:
        x = layer(x)
    # mobilenet_v2.preprocess_input: [0, 255] -> [-1, 1].
    x = keras.layers.Rescaling(1 / 127.5, offset=-1.0, name="preprocess")(x)
    if side != (height, width):
        x = keras.layers.Resizing(*side, name="resize")(x)
    x = InferenceMode(backbone, name="backbone")(x)
    x = keras.layers.GlobalAveragePooling2D(name=FEATURES_LAYER)(x)
    for i, units in enumerate(head_units, start=1):
        x = keras.layers.Dense(units, activation="relu", name=f"head_{i}")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(
        num_classes, activation="softmax", dtype="float32", name="predictions"
    )(x)
    # An AccumulatingModel even for one step: it trains exactly like a
    # keras.Model, and also under MultiWorkerMirroredStrategy.
    return AccumulatingModel(
        inputs,
        outputs,
        accumulation_steps=accumulation_steps,
        name="frozen_mobilenet_v2",
    )


def _check_input_shape(input_shape, resize_to) -> tuple[int, int]:
    # A `tf.TensorShape` (such as `dataset.element_spec[0].shape`) is not a
    # `Sequence`; its unknown dimensions read as `None` and are rejected.
    if isinstance(input_shape, tf.TensorShape):
        known_rank = input_shape.rank is not None
        shape = tuple(input_shape) if known_rank else ()
    elif isinstance(input_shape, Sequence):
        shape = tuple(input_shape)
    else:
        shape = ()
    if len(shape) != 3 or not all(_checks.is_integer(d) for d in shape):
        raise ValueError(
            "`input_shape` must be 3 positive integers (height, width, "
            f"channels). Received: input_shape={input_shape!r}"
        )
    if shape[2] != 3:
        raise ValueError(
            "`input_shape` must have 3 channels (RGB, channels last); "
            "repeat grayscale images to 3 channels. "
            f"Received: input_shape={input_shape!r}"
        )
    if resize_to is not None:
        if not _checks.is_integer(resize_to) or resize_to < _MIN_SIZE:
            raise ValueError(
                f"`resize_to` must be an integer >= {_MIN_SIZE}, such as "
                f"{IMAGENET_SIZES[0]}. Received: resize_to={resize_to!r}"
            )
    elif min(shape[:2]) < _MIN_SIZE:
        raise ValueError(
            f"`input_shape` must be at least {_MIN_SIZE}x{_MIN_SIZE} for "
            f"MobileNetV2. Received: input_shape={input_shape!r}. Pass "
            f"`resize_to={IMAGENET_SIZES[0]}` to upsample small images."
        )
    return shape[0], shape[1]


def _check_head_units(head_units) -> tuple[int, ...]:
    units = (head_units,) if _checks.is_integer(head_units) else head_units
    if not isinstance(units, Sequence) or not all(
        _checks.is_integer(u) for u in units
    ):
        raise ValueError(
            "`head_units` must be a positive integer or a sequence of "
            f"them. Received: head_units={head_units!r}"
        )
    return tuple(units)


def _check_augmentation(augmentation) -> tuple[keras.layers.Layer, ...]:
    layers = (
        (augmentation,)
        if isinstance(augmentation, keras.layers.Layer)
        else augmentation
    )
    if not isinstance(layers, Sequence) or not all(
        isinstance(layer, keras.layers.Layer) for layer in layers
    ):
        raise ValueError(
            "`augmentation` must be a Keras layer or a sequence of layers, "
            "such as `keras.layers.RandomFlip('horizontal')`. "
            f"Received: augmentation={augmentation!r}"
        )
    return tuple(layers)
