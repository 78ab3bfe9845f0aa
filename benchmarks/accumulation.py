"""Gradient accumulation: peak memory and throughput, side by side.

Trains a small conv net on generated 32x32 images four ways:

- `plain b`: `keras.Model.fit` at the micro-batch `b`;
- `plain N*b`: `keras.Model.fit` at the large batch;
- `tfmemsafe N x b`: `tfmemsafe.AccumulatingModel` at `b`, one update
  per `N` micro-batches (the same updates as `plain N*b`);
- `keras N x b`: a plain model whose optimizer has Keras' own
  `gradient_accumulation_steps=N`, at `b`.

Peak memory is read from TensorFlow's CPU allocator
(`TF_CPU_ALLOCATOR_USE_BFC=true`), each variant in a fresh process, over
the epochs after a warm-up one. Throughput is measured in one process
with the variants' epochs interleaved, so that load from other work on the
machine falls on all of them alike; it is reported per wall second and
per CPU second of the process (less sensitive to that load). Targets:
`tfmemsafe N x b` within 3% of `plain b` in throughput, and at most 0.35x
the peak memory of `plain N*b` for N=8.

    python benchmarks/accumulation.py --micro_batch=16 --accumulation_steps=8
"""

import statistics
import time

import keras
import tensorflow as tf
from absl import app
from absl import flags

import tfmemsafe

_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 16, "Micro-batch b.")
_STEPS = flags.DEFINE_integer(
    "accumulation_steps", 8, "Micro-batches per update, N."
)
_SAMPLES = flags.DEFINE_integer("samples", 1024, "Samples per epoch.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 5, "Timed epochs per variant (after a warm-up epoch)."
)

_VARIANTS = ("plain b", "plain N*b", "tfmemsafe N x b", "keras N x b")


def _dataset(samples, batch_size):
    """Generated images, made per batch so no data sits in the allocator."""

    def sample(index):
        seed = tf.stack([index, tf.constant(0, tf.int64)])
        image = tf.random.stateless_normal((32, 32, 3), seed)
        return image, index % 10

    return (
        tf.data.Dataset.range(samples).map(sample).batch(batch_size).prefetch(2)
    )


def _model(variant, steps):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10)(x)
    if variant == "tfmemsafe N x b":
        model = tfmemsafe.AccumulatingModel(
            inputs, outputs, accumulation_steps=steps
        )
    else:
        model = keras.Model(inputs, outputs)
    accumulation = steps if variant == "keras N x b" else None
    model.compile(
        keras.optimizers.Adam(gradient_accumulation_steps=accumulation),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _batch_size(variant, micro_batch, steps):
    return micro_batch * steps if variant == "plain N*b" else micro_batch


def measure_memory(variant, micro_batch, steps, samples, epochs):
    """Peak allocator MB over `epochs` epochs after a warm-up (a child)."""
    model = _model(variant, steps)
    data = _dataset(samples, _batch_size(variant, micro_batch, steps))
    model.fit(data, epochs=1, verbose=0)
    tfmemsafe.reset_peak_memory("CPU:0")
    model.fit(data, epochs=epochs, verbose=0)
    return tfmemsafe.memory_info("CPU:0").peak_mb


def measure_throughput(micro_batch, steps, samples, rounds):
    """Samples per wall and CPU second of each variant (a child)."""
    models, datasets = {}, {}
    for variant in _VARIANTS:
        models[variant] = _model(variant, steps)
        datasets[variant] = _dataset(
            samples, _batch_size(variant, micro_batch, steps)
        )
        models[variant].fit(datasets[variant], epochs=1, verbose=0)
    wall = {variant: [] for variant in _VARIANTS}
    cpu = {variant: [] for variant in _VARIANTS}
    for round_index in range(rounds):
        # Rotate the order so no variant always follows the same one.
        order = _VARIANTS[round_index % 4 :] + _VARIANTS[: round_index % 4]
        for variant in order:
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            models[variant].fit(datasets[variant], epochs=1, verbose=0)
            wall[variant].append(samples / (time.perf_counter() - wall_start))
            cpu[variant].append(samples / (time.process_time() - cpu_start))
    return {
        variant: [
            statistics.median(wall[variant]),
            statistics.median(cpu[variant]),
        ]
        for variant in _VARIANTS
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    b, n, samples = _MICRO_BATCH.value, _STEPS.value, _SAMPLES.value
    allocator = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    peaks = {
        variant: tfmemsafe.testing.run_in_subprocess(
            measure_memory,
            args=[variant, b, n, samples, 2],
            env=allocator,
        )
        for variant in _VARIANTS
    }
    speed = tfmemsafe.testing.run_in_subprocess(
        measure_throughput, args=[b, n, samples, _ROUNDS.value]
    )
    large, small = peaks["plain N*b"], speed["plain b"]
    print(
        f"Conv net on 32x32x3, b={b}, N={n}, {samples} samples/epoch; "
        f"throughput: median of {_ROUNDS.value} interleaved epochs."
    )
    print(
        "| variant | batch per step | samples per update | peak MB "
        "| vs plain N*b | samples/s (wall) | vs plain b | samples/s (CPU) "
        "| vs plain b |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in _VARIANTS:
        per_step = _batch_size(variant, b, n)
        per_update = b if variant == "plain b" else b * n
        wall, cpu = speed[variant]
        print(
            f"| {variant} | {per_step} | {per_update} | {peaks[variant]:.1f} "
            f"| {peaks[variant] / large:.2f}x | {wall:.0f} "
            f"| {wall / small[0]:.3f}x | {cpu:.0f} | {cpu / small[1]:.3f}x |"
        )


if __name__ == "__main__":
    app.run(main)
