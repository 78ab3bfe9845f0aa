r"""Trains a DCGAN on CIFAR-10 (or digits), with gradient accumulation.

Two networks, each with its own Adam optimizer (wrapped in a
`keras.optimizers.LossScaleOptimizer` under mixed precision) and its own
`tfmemsafe.GradientAccumulator`, trained by a custom `train_step` through
`tfmemsafe.fit`: when a batch does not fit in memory, its step runs again
on micro-batches of it, one call of the model's `train_step` each (each
call accumulates into both accumulators, as a smaller batch would), and
training goes on at the next batch. After every epoch
a grid of samples from a fixed set of latent vectors is written as a PNG.

    python examples/cifar10_dcgan.py --dataset=digits --epochs=20

    python examples/cifar10_dcgan.py --epochs=30 --batch_size=64 \
        --accumulation_steps=2
"""

import os

import common
import keras
import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import tfmemsafe

# --help lists the flags every example takes, too.
flags.adopt_module_key_flags(common)

_LATENT_DIM = flags.DEFINE_integer(
    "latent_dim", 128, "Size of the generator's input noise.", lower_bound=1
)
_GENERATOR_FILTERS = flags.DEFINE_integer(
    "generator_filters",
    64,
    "Filters of the generator's last layer; the layers before have 2x and "
    "4x as many.",
    lower_bound=1,
)
_DISCRIMINATOR_FILTERS = flags.DEFINE_integer(
    "discriminator_filters",
    64,
    "Filters of the discriminator's first layer; the layers after have 2x "
    "and 4x as many.",
    lower_bound=1,
)
_GENERATOR_LEARNING_RATE = flags.DEFINE_float(
    "generator_learning_rate",
    2e-4,
    "The generator's Adam learning rate.",
    lower_bound=0.0,
)
_DISCRIMINATOR_LEARNING_RATE = flags.DEFINE_float(
    "discriminator_learning_rate",
    2e-4,
    "The discriminator's Adam learning rate.",
    lower_bound=0.0,
)
_SAMPLE_GRID = flags.DEFINE_integer(
    "sample_grid",
    8,
    "Side of the grid of samples written after each epoch (8: 64 images).",
    lower_bound=1,
)

_IMAGE_SIDE = 32


def build_generator(latent_dim: int, filters: int) -> keras.Model:
    """Noise -> 32x32x3 images in [-1, 1]: 4x4, then three upsamplings."""
    inputs = keras.Input((latent_dim,), name="noise")
    x = keras.layers.Dense(4 * 4 * 4 * filters, use_bias=False)(inputs)
    x = keras.layers.Reshape((4, 4, 4 * filters))(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    for width in (2 * filters, filters):
        x = keras.layers.Conv2DTranspose(
            width, 4, strides=2, padding="same", use_bias=False
        )(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    # float32 images under mixed precision too.
    outputs = keras.layers.Conv2DTranspose(
        3, 4, strides=2, padding="same", activation="tanh", dtype="float32"
    )(x)
    return keras.Model(inputs, outputs, name="generator")


def build_discriminator(filters: int) -> keras.Model:
    """32x32x3 images in [-1, 1] -> one logit: real or generated."""
    inputs = keras.Input((_IMAGE_SIDE, _IMAGE_SIDE, 3), name="images")
    x = inputs
    for index, width in enumerate((filters, 2 * filters, 4 * filters)):
        # No biases: TensorFlow's graph optimizer fails (and says so) to
        # fuse Conv2D + BiasAdd + LeakyRelu when the generator's step
        # differentiates through them.
        x = keras.layers.Conv2D(
            width, 4, strides=2, padding="same", use_bias=False
        )(x)
        if index:  # As in the DCGAN paper: none on the first layer.
            x = keras.layers.BatchNormalization()(x)
        x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.2)(x)
    outputs = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="discriminator")


class DCGAN(tfmemsafe.AccumulatingModel):
    """A generator and a discriminator, each with its own accumulator.

    Deriving from `AccumulatingModel` lets `fit` apply both partial
    windows at the end of each epoch.
    """

    def __init__(self, *, generator, discriminator, accumulation_steps=1):
        super().__init__(accumulation_steps=accumulation_steps, name="dcgan")
        self.generator = generator
        self.discriminator = discriminator
        self.latent_dim = generator.input_shape[-1]
        self.generator_gradients = tfmemsafe.GradientAccumulator(
            accumulation_steps, name="generator_gradients"
        )
        self.discriminator_gradients = tfmemsafe.GradientAccumulator(
            accumulation_steps, name="discriminator_gradients"
        )
        self.noise_seed = keras.random.SeedGenerator()
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    def call(self, noise, training=False):
        return self.generator(noise, training=training)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, generator_optimizer, discriminator_optimizer):
        """Takes one optimizer per network; wraps them for mixed precision."""
        # No optimizer of Keras' own: it would hold state for every weight
        # and never be used.
        super().compile(optimizer=None)
        self.generator_optimizer = _loss_scaled(generator_optimizer)
        self.discriminator_optimizer = _loss_scaled(discriminator_optimizer)
        # Built now, so that their state exists from the start.
        self.generator_optimizer.build(self.generator.trainable_variables)
        self.discriminator_optimizer.build(
            self.discriminator.trainable_variables
        )

    def train_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        real = tf.cast(real, "float32") / 127.5 - 1.0
        batch_size = tf.shape(real)[0]

        fake = self.generator(self._noise(batch_size), training=True)
        with tf.GradientTape() as tape:
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            # One-sided label smoothing (real = 0.9) keeps the
            # discriminator from overpowering the generator.
            d_loss = self.bce(
                tf.fill(tf.shape(real_logits), 0.9), real_logits
            ) + self.bce(tf.zeros_like(fake_logits), fake_logits)
            scaled = self.discriminator_optimizer.scale_loss(
                _per_replica(d_loss)
            )
        self._accumulate(
            tape.gradient(scaled, self.discriminator.trainable_variables),
            self.discriminator,
            self.discriminator_gradients,
            self.discriminator_optimizer,
            batch_size,
        )

        with tf.GradientTape() as tape:
            fake = self.generator(self._noise(batch_size), training=True)
            fake_logits = self.discriminator(fake, training=True)
            # The generator wins when its images are taken for real.
            g_loss = self.bce(tf.ones_like(fake_logits), fake_logits)
            scaled = self.generator_optimizer.scale_loss(_per_replica(g_loss))
        self._accumulate(
            tape.gradient(scaled, self.generator.trainable_variables),
            self.generator,
            self.generator_gradients,
            self.generator_optimizer,
            batch_size,
        )

        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}

    def _noise(self, batch_size):
        return keras.random.normal(
            (batch_size, self.latent_dim), seed=self.noise_seed
        )

    @staticmethod
    def _accumulate(gradients, network, accumulator, optimizer, batch_size):
        variables = network.trainable_variables
        if accumulator.accumulation_steps == 1:
            # As plain Keras: no accumulator variables, no extra memory.
            optimizer.apply(gradients, variables)
            return
        accumulator.accumulate(gradients, variables, batch_size)
        accumulator.apply_if_ready(optimizer)


def _per_replica(loss):
    """Divides a loss by the replicas in sync, as Keras' `compute_loss` does.

    The optimizer sums the replicas' gradients, so each replica
    differentiates its share of the mean loss.
    """
    return loss / tf.distribute.get_strategy().num_replicas_in_sync


def _loss_scaled(optimizer):
    """`optimizer`, in a `LossScaleOptimizer` under mixed_float16."""
    if keras.config.dtype_policy().name == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


class SampleGrid(keras.callbacks.Callback):
    """Writes a PNG grid of generated images after every epoch.

    The same latent vectors every epoch, so the images show the generator
    learning.

    Args:
        directory: Where `samples_epoch_001.png`, ... are written.
        side: The grid is `side` x `side` images.
        latent_dim: The generator's input size.
    """

    def __init__(self, directory: str, side: int, latent_dim: int):
        super().__init__()
        self.directory = directory
        self.side = side
        self.noise = np.random.default_rng(0).standard_normal(
            (side * side, latent_dim), dtype=np.float32
        )

    def on_epoch_end(self, epoch, logs=None):
        images = self.model.generator(self.noise, training=False)
        images = np.asarray(images, dtype=np.float32)
        path = os.path.join(
            self.directory, f"samples_epoch_{epoch + 1:03d}.png"
        )
        _save_grid(images, self.side, path)


def _save_grid(images: np.ndarray, side: int, path: str) -> None:
    """Tiles images in [-1, 1] into a side x side grid with 2-pixel gaps."""
    pixels = np.clip((images + 1.0) * 127.5, 0, 255).astype(np.uint8)
    height, width, channels = pixels.shape[1:]
    gap = 2
    grid = np.full(
        (side * (height + gap) + gap, side * (width + gap) + gap, channels),
        255,
        dtype=np.uint8,
    )
    for index, image in enumerate(pixels):
        row, column = divmod(index, side)
        top = gap + row * (height + gap)
        left = gap + column * (width + gap)
        grid[top : top + height, left : left + width] = image
    keras.utils.save_img(path, grid, scale=False)


def main(argv):
    setup = common.set_up(__file__, argv)
    if setup is None:  # It ran under --memory_cap_mb.
        return
    directory = setup.directory

    train = common.load("train")
    with common.distribution_strategy().scope():
        gan = DCGAN(
            generator=build_generator(
                _LATENT_DIM.value, _GENERATOR_FILTERS.value
            ),
            discriminator=build_discriminator(_DISCRIMINATOR_FILTERS.value),
            accumulation_steps=common.ACCUMULATION_STEPS.value,
        )
        gan.compile(
            generator_optimizer=keras.optimizers.Adam(
                _GENERATOR_LEARNING_RATE.value, beta_1=0.5
            ),
            discriminator_optimizer=keras.optimizers.Adam(
                _DISCRIMINATOR_LEARNING_RATE.value, beta_1=0.5
            ),
        )
    monitor, callbacks = common.callbacks(directory)
    samples = SampleGrid(directory, _SAMPLE_GRID.value, _LATENT_DIM.value)
    history = tfmemsafe.fit(
        gan,
        train,
        batch_size=setup.batch_size,
        epochs=common.EPOCHS.value,
        steps_per_epoch=common.STEPS_PER_EPOCH.value,
        preflight=common.PREFLIGHT.value,
        callbacks=[*callbacks, samples],
        shuffle=False,  # The pipeline shuffles every epoch already.
    )
    paths = []
    for network in (gan.generator, gan.discriminator):
        paths.append(os.path.join(directory, f"{network.name}.keras"))
        network.save(paths[-1])
    common.summarize(
        directory,
        results={
            "discriminator loss": history.history["d_loss"][-1],
            "generator loss": history.history["g_loss"][-1],
        },
        runs=[common.Run("training", history, monitor)],
        outputs=[
            *paths,
            os.path.join(directory, "history.csv"),
            os.path.join(directory, "samples_epoch_*.png"),
        ],
        started=setup.started,
    )


if __name__ == "__main__":
    app.run(main)
