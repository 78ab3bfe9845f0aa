"""Small seeded networks and generated data for out-of-memory experiments."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.checkpointing import Checkpointed

_DEFAULT_SHAPES = {
    "conv_net": (24, 24, 3),
    "residual_net": (24, 24, 3),
    "mlp": (256,),
    "accumulating_checkpointed_net": (24, 24, 3),
    "gru": (64,),
    "transformer": (64,),
}
# The sequence networks' vocabulary: token ids are in [1, _VOCABULARY).
_VOCABULARY = 2000
# The transformer's learned positions: its longest sequence.
_LONGEST = 4096


def reference_model(
    name: str,
    input_shape: Sequence[int] | None = None,
    *,
    metrics: Sequence[str] | None = ("accuracy",),
) -> keras.Model:
    """Returns one of six small compiled networks, seeded with 0.

    Networks of the shapes whose memory behaves differently, for
    measuring and testing memory on a machine: each classifies into 4
    classes with `Adam(3e-3)` and a sparse categorical cross-entropy on
    logits; built after `keras.utils.set_random_seed(0)`, so the same
    arguments give the same weights.

    - `"conv_net"`: two 3x3 convolutions of 16 channels, max pooling, one
      of 32, global average pooling.
    - `"residual_net"`: a 3x3 convolution of 16 channels and two residual
      blocks of two, with batch normalization, global average pooling.
    - `"mlp"`: two dense layers of 1024, dropout 0.1.
    - `"accumulating_checkpointed_net"`: an `AccumulatingModel` (2
      accumulation steps) with a convolution of 16 channels and two
      `Checkpointed` blocks of two more.
    - `"gru"`: token ids (in `[1, 2000)`, any length) embedded in 64
      dimensions, a GRU of 128 units, its last state classified.
    - `"transformer"`: token ids embedded in 64 dimensions plus a learned
      position (up to 4096), one encoder block (4-head
      `MultiHeadAttention` of key size 16, a feed-forward layer of 128,
      layer normalization), average pooling.

    Args:
        name: str. One of the names above.
        input_shape: The shape of one sample. Defaults to `(24, 24, 3)`
            for the image networks, `(256,)` for `"mlp"` and `(64,)`
            (token ids) for the sequence networks, whose length may be
            `None` (any length).
        metrics: The metrics to compile with. Defaults to `("accuracy",)`.

    Returns:
        A compiled `keras.Model`.

    Example:
    >>> model = tfmemsafe.testing.reference_model("conv_net", (32, 32, 3))
    >>> model.output_shape
    (None, 4)
    """
    _checks.one_of("name", name, tuple(_DEFAULT_SHAPES))
    shape = tuple(input_shape or _DEFAULT_SHAPES[name])
    if name == "transformer" and (shape[0] or 0) > _LONGEST:
        raise ValueError(
            f"`input_shape` of the transformer must be at most {_LONGEST} "
            f"tokens long, its positions. Received: input_shape={shape!r}"
        )
    keras.utils.set_random_seed(0)
    model = _BUILDERS[name](shape)
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics) if metrics is not None else None,
    )
    return model


def _conv_net(shape):
    return keras.Sequential(
        [
            keras.Input(shape),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )


def _residual_net(shape):
    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(16, 3, padding="same")(inputs)
    for _ in range(2):
        r = keras.layers.Conv2D(16, 3, padding="same")(x)
        r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
        r = keras.layers.Conv2D(16, 3, padding="same")(r)
        r = keras.layers.BatchNormalization()(r)
        x = keras.layers.ReLU()(keras.layers.Add()([x, r]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


def _mlp(shape):
    return keras.Sequential(
        [
            keras.Input(shape),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(4),
        ]
    )


def _accumulating_checkpointed_net(shape):
    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    for _ in range(2):
        block = keras.Sequential(
            [
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            ]
        )
        x = Checkpointed(block)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(4)(x)
    return AccumulatingModel(inputs, outputs, accumulation_steps=2)


def _gru(shape):
    inputs = keras.Input(shape, dtype="int32")
    x = keras.layers.Embedding(_VOCABULARY, 64)(inputs)
    x = keras.layers.GRU(128)(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


class _AddPosition(keras.layers.Layer):
    """Adds a learned embedding of each token's position."""

    def __init__(self, longest, **kwargs):
        super().__init__(**kwargs)
        self.longest = longest

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=(self.longest, input_shape[-1]), initializer="uniform"
        )

    def call(self, x):
        length = keras.ops.shape(x)[1]
        return x + self.positions[None, :length]

    def get_config(self):
        return {**super().get_config(), "longest": self.longest}


def _transformer(shape):
    inputs = keras.Input(shape, dtype="int32")
    x = keras.layers.Embedding(_VOCABULARY, 64)(inputs)
    x = _AddPosition(_LONGEST)(x)
    attended = keras.layers.MultiHeadAttention(4, 16)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    fed = keras.layers.Dense(128, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(64)(fed))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(4)(x))


_BUILDERS = {
    "conv_net": _conv_net,
    "residual_net": _residual_net,
    "mlp": _mlp,
    "accumulating_checkpointed_net": _accumulating_checkpointed_net,
    "gru": _gru,
    "transformer": _transformer,
}


def random_data(
    input_shape: Sequence[int], rows: int = 256, *, tokens: bool = False
) -> Callable[[int], tf.data.Dataset]:
    """Returns `batch_size -> dataset`: a few random rows, repeated forever.

    The rows are normal noise (seed 0), labelled 1 where their first value
    is positive and 0 elsewhere. They are few, so that the data's own
    memory is small beside a training step's, and one batch is prefetched:
    `tf.data`'s autotuned prefetch would buffer a varying number of
    batches, memory that depends on no batch size.

    Args:
        input_shape: The shape of one sample.
        rows: int. How many distinct rows. Defaults to 256.
        tokens: bool. Whether the rows are token ids for the sequence
            networks of `reference_model` (uniform in `[1, 2000)`,
            labelled by their first id's parity) instead of noise.
            Defaults to `False`.

    Returns:
        A callable from a batch size to an endless `tf.data.Dataset` of
        `(x, y)` batches, as `tfmemsafe.fit` and
        `tfmemsafe.estimate_memory` accept.

    Example:
    >>> data = tfmemsafe.testing.random_data((256,))
    >>> model = tfmemsafe.testing.reference_model("mlp")
    >>> model.fit(data(64).take(2), verbose=0)
    """
    rows = _checks.integer("rows", rows, 1)
    tokens = _checks.boolean("tokens", tokens)
    shape = tuple(input_shape)
    rng = np.random.default_rng(0)
    if tokens:
        x = rng.integers(1, _VOCABULARY, (rows, *shape)).astype("int32")
        y = (x.reshape(rows, -1)[:, 0] % 2).astype("int32")
    else:
        x = rng.normal(size=(rows, *shape)).astype("float32")
        y = (x.reshape(rows, -1)[:, 0] > 0).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return lambda batch_size: _pipelines.for_keras(
        dataset.batch(batch_size).prefetch(1), one_worker=False
    )


def random_images(
    rows: int, size: int = 32, classes: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """Returns `(x, y)`: uniform random RGB images and integer labels.

    Drawn from `np.random.default_rng(0)`: first the images, then the
    labels, so the same arguments give the same arrays.

    Args:
        rows: int. How many images.
        size: int. Their height and width. Defaults to 32.
        classes: int. Labels are in `[0, classes)`. Defaults to 10.

    Returns:
        `x`, float32 of shape `(rows, size, size, 3)` in `[0, 1)`, and
        `y`, int64 of shape `(rows,)`.

    Example:
    >>> x, y = tfmemsafe.testing.random_images(128, size=64, classes=4)
    >>> x.shape, y.max() < 4
    ((128, 64, 64, 3), True)
    """
    rows = _checks.integer("rows", rows, 1)
    size = _checks.integer("size", size, 1)
    classes = _checks.integer("classes", classes, 1)
    rng = np.random.default_rng(0)
    x = rng.random((rows, size, size, 3), dtype=np.float32)
    return x, rng.integers(0, classes, rows)
