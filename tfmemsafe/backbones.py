"""Transfer learning on a frozen MobileNetV2: build, fine-tune, cache.

A frozen backbone needs no gradients and no stored activations for the
backward pass, so it trains in a fraction of the memory of full
fine-tuning. Because it computes the same features every epoch, those
features can also be computed once and the head trained on them alone.
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

# Cached features are shuffled through a buffer of at most this many.
_MAX_SHUFFLE_BUFFER = 50_000


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


def cache_features(
    model: keras.Model,
    x,
    y=None,
    *,
    sample_weight=None,
    batch_size: int = 64,
    cache_path: str | os.PathLike | None = None,
    features_layer: str = FEATURES_LAYER,
    verbose: int = 1,
) -> tf.data.Dataset:
    """Runs a model's frozen backbone once and keeps the features.

    A frozen backbone computes the same features for an image at every
    epoch. This runs it once, in batches, over the data (on your
    accelerator, not inside a `tf.data` thread) and stores the output of
    `features_layer`: in memory, or, for data larger than memory, in a
    TFRecord file at `cache_path` that is written as the batches come and
    read back as a stream. Train the head on the result with `fit_head`.

    Everything before `features_layer` must be frozen and free of
    randomness: a model with data augmentation is refused, because
    features computed once would hide the augmentation from the head.
    Cached features go stale when the backbone changes, so cache again
    after loading other weights, and do not cache after `unfreeze`.

    Args:
        model: A model from `build_frozen_mobilenet_v2`, or any functional
            model with a frozen trunk ending in a layer `features_layer`.
        x: Images: a NumPy array or tensor, or a batched `tf.data.Dataset`
            of `x`, `(x, y)` or `(x, y, sample_weight)`.
        y: Labels for array `x`. Must be `None` when `x` is a dataset.
        sample_weight: Per-sample weights for array `x`.
        batch_size: int. The batch size for array `x`. Defaults to 64.
        cache_path: str. A file to write the features to. Defaults to
            `None`: keep them in memory. An existing file is overwritten.
        features_layer: str. The layer whose output is cached. Defaults to
            `"features"`, the pooled backbone output.
        verbose: int. 1 shows a progress bar, 0 is silent. Defaults to 1.

    Returns:
        An unbatched `tf.data.Dataset` whose elements are like the input's
        with the image replaced by its features: `features`,
        `(features, y)` or `(features, y, sample_weight)`.

    Raises:
        ValueError: If the model's trunk is trainable or augments its
            input, `features_layer` does not exist, or the data are
            inconsistent.

    Example:
    >>> features = tfmemsafe.cache_features(model, x_train, y_train)
    >>> history = tfmemsafe.fit_head(model, features, epochs=20)
    """
    extract = _compiled_extractor(_split(model, features_layer)[0])
    batches, num_batches = _batches(x, y, sample_weight, batch_size)
    progress = keras.utils.Progbar(num_batches) if verbose else None
    if cache_path is None:
        return _cache_in_memory(extract, batches, progress)
    return _cache_to_file(extract, batches, os.fspath(cache_path), progress)


def fit_head(
    model: keras.Model,
    features: tf.data.Dataset,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    validation_data=None,
    shuffle: bool = True,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose="auto",
    initial_epoch: int = 0,
    features_layer: str = FEATURES_LAYER,
) -> keras.callbacks.History:
    """Trains a model's head on features from `cache_features`.

    The head (the layers after `features_layer`) is trained as its own
    model whose layers are shared with `model`, so when this returns,
    `model` is the full model, backbone and trained head, ready to
    `evaluate`, `predict` and `save`. Its predictions equal those of the
    same model trained without caching, up to float rounding; an epoch
    costs only the head's work.

    The head is compiled from `model.get_compile_config()` (the optimizer,
    loss and metrics `model` was compiled with), with a fresh optimizer
    state; `model`'s own optimizer is not used.

    Args:
        model: The compiled model whose features were cached.
        features: The unbatched dataset returned by `cache_features`.
        epochs: int. Defaults to 1.
        batch_size: int. Defaults to 32. Memory is no concern here, so
            with gradient accumulation pass the effective batch size.
        validation_data: `(x, y)` or `(x, y, sample_weight)` images, whose
            features are then computed once, or a dataset returned by
            `cache_features`. Defaults to `None`.
        shuffle: bool. Shuffle the features every epoch (through a buffer
            of up to 50 000 elements). Defaults to `True`.
        callbacks: Keras callbacks for the head's `fit`.
        verbose: As for `keras.Model.fit`. Defaults to `"auto"`.
        initial_epoch: int. As for `keras.Model.fit`. Defaults to 0.
        features_layer: str. The layer the features came from. Defaults
            to `"features"`.

    Returns:
        The `keras.callbacks.History` of the head's `fit`.

    Raises:
        ValueError: If `model` is not compiled, or `features` does not
            match the head's input.

    Example:
    >>> features = tfmemsafe.cache_features(model, x_train, y_train)
    >>> tfmemsafe.fit_head(model, features, epochs=20,
    ...                    validation_data=(x_val, y_val))
    >>> model.evaluate(x_test, y_test)
    """
    if not model.compiled:
        raise ValueError(
            "`model` must be compiled before `fit_head`, which trains the "
            "head with the model's optimizer, loss and metrics. Call "
            "`model.compile(...)` first."
        )
    _, head = _split(model, features_layer)
    head.compile_from_config(model.get_compile_config())
    train = _batched_features(features, head, batch_size, shuffle, "features")
    if validation_data is None:
        validation = None
    elif isinstance(validation_data, tf.data.Dataset):
        validation = _batched_features(
            validation_data, head, batch_size, False, "validation_data"
        )
    else:
        validation = cache_features(
            model,
            *validation_data,
            batch_size=max(batch_size, 64),
            features_layer=features_layer,
            verbose=0,
        ).batch(batch_size)
    return head.fit(
        train,
        epochs=epochs,
        validation_data=validation,
        callbacks=callbacks,
        verbose=verbose,
        initial_epoch=initial_epoch,
        shuffle=False,  # The dataset is shuffled above.
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


def _split(model: keras.Model, features_layer: str):
    """Returns the models trunk -> features and features -> outputs.

    Both share `model`'s layers, so training the second trains `model`.
    """
    try:
        features = model.get_layer(features_layer).output
    except (ValueError, AttributeError) as err:
        raise ValueError(
            f"`features_layer` must name a layer of `model` whose output "
            f"is the cached features. Received: "
            f"features_layer={features_layer!r}, which {model.name!r} "
            "does not have (or is not a functional model)."
        ) from err
    extractor = keras.Model(model.inputs, features)
    random_layers = [
        layer.name for layer in _walk(extractor.layers) if _is_random(layer)
    ]
    if random_layers:
        raise ValueError(
            "Cannot cache the features of a model that augments its input: "
            f"{', '.join(map(repr, random_layers))} before "
            f"{features_layer!r} change the images at every step, and "
            "features computed once would hide that from the head. Build "
            "the model without `augmentation` to cache features, or train "
            "it with `fit` and augmentation."
        )
    trainable = [w.path for w in extractor.trainable_weights]
    if trainable:
        raise ValueError(
            f"Cannot cache features: everything before {features_layer!r} "
            f"must be frozen, but {len(trainable)} weights are trainable "
            f"(such as {trainable[0]!r}). Cache features before calling "
            "`unfreeze`; fine-tune with `fit`."
        )
    head = AccumulatingModel(
        features,
        model.outputs,
        accumulation_steps=getattr(model, "accumulation_steps", 1),
    )
    return extractor, head


def _walk(layers):
    for layer in layers:
        yield layer
        if isinstance(layer, keras.layers.Wrapper):
            yield from _walk([layer.layer])
        elif hasattr(layer, "layers"):
            yield from _walk(layer.layers)


def _is_random(layer) -> bool:
    """Whether a layer draws random numbers (augmentation, dropout, noise)."""
    return any(
        isinstance(value, keras.random.SeedGenerator)
        for value in vars(layer).values()
    )


def _batches(x, y, sample_weight, batch_size):
    """Yields input batches as tuples (x, *rest); returns the count too."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError(
                "`y` and `sample_weight` must be None when `x` is a "
                "dataset: the dataset yields them. "
                f"Received: y={type(y).__name__}, "
                f"sample_weight={type(sample_weight).__name__}"
            )
        count = int(x.cardinality())
        batches = (
            element if isinstance(element, tuple) else (element,)
            for element in x
        )
        return batches, (count if count >= 0 else None)
    _checks.integer("batch_size", batch_size)
    arrays = [a for a in (x, y, sample_weight) if a is not None]
    sizes = {len(a) for a in arrays}
    if len(sizes) != 1:
        raise ValueError(
            "`x`, `y` and `sample_weight` must have the same number of "
            f"samples. Received: {', '.join(str(len(a)) for a in arrays)}"
        )
    (num_samples,) = sizes
    batches = (
        tuple(a[start : start + batch_size] for a in arrays)
        for start in range(0, num_samples, batch_size)
    )
    return batches, -(-num_samples // batch_size)


def _compiled_extractor(extractor: keras.Model):
    """Returns a function images -> features traced once for all batches."""
    spec = extractor.inputs[0]

    @tf.function(
        input_signature=[tf.TensorSpec(spec.shape, spec.dtype)],
        reduce_retracing=True,
    )
    def extract(images):
        return extractor(images, training=False)

    def run(images):
        images = tf.convert_to_tensor(images)
        if not tf.TensorShape(spec.shape).is_compatible_with(images.shape):
            raise ValueError(
                f"`x` must hold images of shape {tuple(spec.shape[1:])}, as "
                f"the model's input. Received a batch of shape "
                f"{tuple(images.shape)}."
            )
        return extract(tf.cast(images, spec.dtype))

    return run


def _cache_in_memory(extract, batches, progress) -> tf.data.Dataset:
    columns = None
    for step, (images, *rest) in enumerate(batches, start=1):
        row = [extract(images).numpy(), *map(np.asarray, rest)]
        columns = [[] for _ in row] if columns is None else columns
        for column, value in zip(columns, row, strict=True):
            column.append(value)
        if progress:
            progress.update(step)
    if columns is None:
        raise ValueError("`x` is empty: there are no images to cache.")
    arrays = tuple(np.concatenate(column) for column in columns)
    return tf.data.Dataset.from_tensor_slices(
        arrays if len(arrays) > 1 else arrays[0]
    )


def _cache_to_file(extract, batches, path, progress) -> tf.data.Dataset:
    partial = path + ".partial"
    specs = None
    num_samples = 0
    try:
        with tf.io.TFRecordWriter(partial) as writer:
            for step, (images, *rest) in enumerate(batches, start=1):
                row = [extract(images), *rest]
                row = [tf.convert_to_tensor(value) for value in row]
                specs = specs or [
                    tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in row
                ]
                num_samples += int(row[0].shape[0])
                writer.write(_serialize_row(row))
                if progress:
                    progress.update(step)
    except BaseException:
        if tf.io.gfile.exists(partial):  # Never leave a half-written cache.
            tf.io.gfile.remove(partial)
        raise
    if specs is None:
        tf.io.gfile.remove(partial)
        raise ValueError("`x` is empty: there are no images to cache.")
    tf.io.gfile.rename(partial, path, overwrite=True)
    logging.info("Cached %d samples' features in %s.", num_samples, path)

    def parse(record):
        parsed = tf.io.parse_single_example(
            record,
            {
                str(i): tf.io.FixedLenFeature([], tf.string)
                for i in range(len(specs))
            },
        )
        row = tuple(
            tf.ensure_shape(
                tf.io.parse_tensor(parsed[str(i)], spec.dtype), spec.shape
            )
            for i, spec in enumerate(specs)
        )
        return row if len(row) > 1 else row[0]

    dataset = tf.data.TFRecordDataset(path).map(parse).unbatch()
    return dataset.apply(tf.data.experimental.assert_cardinality(num_samples))


def _serialize_row(row) -> bytes:
    feature = {
        str(i): tf.train.Feature(
            bytes_list=tf.train.BytesList(
                value=[tf.io.serialize_tensor(value).numpy()]
            )
        )
        for i, value in enumerate(row)
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString()


def _batched_features(dataset, head, batch_size, shuffle, argument):
    spec = dataset.element_spec
    features_spec = spec[0] if isinstance(spec, tuple) else spec
    expected = tuple(head.inputs[0].shape[1:])
    if tuple(features_spec.shape) != expected:
        raise ValueError(
            f"`{argument}` must be an unbatched dataset from "
            f"`cache_features`, whose elements start with features of "
            f"shape {expected}. Received elements of shape "
            f"{tuple(features_spec.shape)}."
        )
    if shuffle:
        count = int(dataset.cardinality())
        buffer = count if 0 < count <= _MAX_SHUFFLE_BUFFER else None
        dataset = dataset.shuffle(buffer or _MAX_SHUFFLE_BUFFER)
    return dataset.batch(batch_size).prefetch(tf.data.AUTOTUNE)
