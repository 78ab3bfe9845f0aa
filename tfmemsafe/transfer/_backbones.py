"""Transfer learning on a frozen MobileNetV2: build, then fine-tune.

A frozen backbone needs no gradients and no stored activations for the
backward pass, so it trains in a fraction of the memory of full
fine-tuning. `build_frozen_mobilenet_v2` builds such a classifier and
`unfreeze` makes the top of its backbone trainable for fine-tuning.
Because a frozen backbone computes the same features every epoch, they
can also be computed once and the head trained on them alone: see
`tfmemsafe.feature_cache`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe.accumulation import AccumulatingModel

# Where Keras downloads MobileNetV2 weights from, and the sizes they exist for.
_WEIGHTS_URL = (
    "https://storage.googleapis.com/tensorflow/keras-applications/mobilenet_v2/"
)
_WEIGHTS_FILE = (
    "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_{}_{}_no_top.h5"
)
IMAGENET_SIZES = (96, 128, 160, 192, 224)
ALPHAS = (0.35, 0.5, 0.75, 1.0, 1.3, 1.4)
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
    if alpha not in ALPHAS:
        raise ValueError(
            f"`alpha` must be one of {', '.join(map(str, ALPHAS))}. "
            f"Received: alpha={alpha!r}"
        )
    head_units = _check_head_units(head_units)
    _checks.fraction("dropout", dropout, what="a float")
    _checks.integer("accumulation_steps", accumulation_steps)
    augmentation = _check_augmentation(augmentation)
    weights = _check_weights(weights)

    side = (resize_to, resize_to) if resize_to else (height, width)
    if weights == "imagenet":
        weights = _imagenet_weights_path(alpha, side)
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


@dataclasses.dataclass(frozen=True)
class UnfreezeSummary:
    """What `unfreeze` made trainable.

    Attributes:
        backbone: The backbone's name.
        layers: The names of the backbone layers that are now trainable.
        frozen_batchnorm: BatchNormalization layers in the unfrozen range
            that were kept frozen.
        trainable_params: The number of backbone parameters now trainable.
    """

    backbone: str
    layers: tuple[str, ...]
    frozen_batchnorm: tuple[str, ...]
    trainable_params: int

    def __str__(self) -> str:
        return (
            f"Unfroze {len(self.layers)} layers of {self.backbone!r} "
            f"({self.trainable_params:,} parameters now trainable; "
            f"{len(self.frozen_batchnorm)} BatchNormalization layers kept "
            "frozen). Recompile the model, with a lower learning rate, "
            "before calling fit."
        )


def unfreeze(
    model: keras.Model,
    *,
    last_n_layers: int | None = None,
    from_layer: str | None = None,
    keep_batchnorm_frozen: bool = True,
) -> UnfreezeSummary:
    """Makes the top of a frozen backbone trainable, for fine-tuning.

    The second phase of transfer learning: once the head has been trained
    on the frozen backbone, unfreeze the backbone's last layers and train
    on with a learning rate about 10x lower, so the pretrained filters
    adapt without being wiped out by large gradients.

    The call sets the whole trainable state of the backbone: the layers in
    the range become trainable and all others frozen, so calling it again
    with a smaller range freezes layers again. Layers are counted as in
    `backbone.layers` (activations and additions included), as in the
    Keras fine-tuning guide. BatchNormalization layers are kept frozen by
    default: their statistics suit the pretrained filters, and a model
    from `build_frozen_mobilenet_v2` runs them in inference mode anyway.

    Give at most one of `last_n_layers` and `from_layer`; with neither,
    the whole backbone is unfrozen.

    You must compile the model again after this call (Keras fixes the
    trainable weights at `compile`), with a lower learning rate:
    `model.compile(optimizer=keras.optimizers.Adam(1e-5), ...)`.

    Args:
        model: A model from `build_frozen_mobilenet_v2`, or any model with
            one nested model that has weights (its backbone, possibly in a
            wrapper such as `InferenceMode`); a model with no nested model
            is treated as the backbone itself.
        last_n_layers: int. Unfreeze the backbone's last this many layers.
        from_layer: str. Unfreeze from the backbone layer of this name
            (inclusive) to the end, e.g. `"block_13_expand"`.
        keep_batchnorm_frozen: bool. Keep BatchNormalization layers frozen.
            Defaults to `True`.

    Returns:
        An `UnfreezeSummary` naming the layers now trainable and the
        number of backbone parameters that are. It is also logged.

    Raises:
        ValueError: If both `last_n_layers` and `from_layer` are given,
            `last_n_layers` is out of range, `from_layer` names no backbone
            layer, or the backbone cannot be told apart.

    Example:
    >>> summary = tfmemsafe.unfreeze(model, last_n_layers=30)
    >>> model.compile(optimizer=keras.optimizers.Adam(1e-5),
    ...               loss="sparse_categorical_crossentropy")
    """
    backbone = _find_backbone(model)
    layers = [
        layer
        for layer in backbone.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    start = _unfreeze_start(layers, backbone.name, last_n_layers, from_layer)
    backbone.trainable = True
    unfrozen, frozen_batchnorm = [], []
    for i, layer in enumerate(layers):
        is_batchnorm = isinstance(layer, keras.layers.BatchNormalization)
        if i >= start and is_batchnorm and keep_batchnorm_frozen:
            frozen_batchnorm.append(layer.name)
        layer.trainable = i >= start and layer.name not in frozen_batchnorm
        if layer.trainable:
            unfrozen.append(layer.name)
    trainable_params = sum(
        int(np.prod(w.shape)) for w in backbone.trainable_weights
    )
    summary = UnfreezeSummary(
        backbone=backbone.name,
        layers=tuple(unfrozen),
        frozen_batchnorm=tuple(frozen_batchnorm),
        trainable_params=trainable_params,
    )
    logging.info("%s", summary)
    return summary


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


def _check_weights(weights):
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


def _imagenet_weights_path(alpha: float, side: tuple[int, int]) -> str:
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


def _find_backbone(model: keras.Model) -> keras.Model:
    unwrapped = [
        layer.layer if isinstance(layer, keras.layers.Wrapper) else layer
        for layer in model.layers
    ]
    nested = [
        layer
        for layer in unwrapped
        if isinstance(layer, keras.Model) and layer.weights
    ]
    if not nested:
        return model
    if len(nested) > 1:
        raise ValueError(
            "`model` must have one nested model (its backbone) to unfreeze. "
            f"Received: a model with {len(nested)}: "
            f"{', '.join(repr(layer.name) for layer in nested)}. Call "
            "`unfreeze` on the backbone itself."
        )
    return nested[0]


def _unfreeze_start(layers, backbone_name, last_n_layers, from_layer) -> int:
    if last_n_layers is not None and from_layer is not None:
        raise ValueError(
            "Give at most one of `last_n_layers` and `from_layer`. "
            f"Received: last_n_layers={last_n_layers!r}, "
            f"from_layer={from_layer!r}"
        )
    if last_n_layers is not None:
        if not _checks.is_integer(last_n_layers) or last_n_layers > len(layers):
            raise ValueError(
                "`last_n_layers` must be an integer from 1 to the "
                f"backbone's {len(layers)} layers. "
                f"Received: last_n_layers={last_n_layers!r}"
            )
        return len(layers) - last_n_layers
    if from_layer is not None:
        names = [layer.name for layer in layers]
        if from_layer not in names:
            raise ValueError(
                f"`from_layer` must name a layer of the backbone "
                f"{backbone_name!r}, such as {names[-min(10, len(names))]!r}. "
                f"Received: from_layer={from_layer!r}"
            )
        return names.index(from_layer)
    return 0
