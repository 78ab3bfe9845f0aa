"""Training a head on cached features of a frozen backbone.

A frozen backbone computes the same features for an image at every epoch.
`cache_features` runs it once and keeps its output, in memory or in a
TFRecord file; `fit_head` trains the layers after it on those features
alone, sharing them with the full model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.transfer._backbones import FEATURES_LAYER

# Cached features are shuffled through a buffer of at most this many.
_MAX_SHUFFLE_BUFFER = 50_000


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
    return _pipelines.for_keras(dataset.batch(batch_size), one_worker=False)
