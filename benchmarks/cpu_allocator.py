"""What TensorFlow's BFC allocator on the CPU costs, side by side.

`import tfmemsafe` sets `TF_CPU_ALLOCATOR_USE_BFC=true` so that the CPU
keeps allocator statistics on every kind of CPU (see docs/runtime.md).
This measures what that costs in training throughput against TensorFlow's
default CPU allocator, with oneDNN off (`TF_ENABLE_ONEDNN_OPTS=0`, the
default on CPUs without AVX-512 VNNI/BF16 or AMX, where the default
allocator keeps no statistics) and on (`=1`, where the default allocator
is oneDNN's, itself BFC-based).

Each run is a fresh process that trains the main job's network (three
VGG-style blocks of two 3x3 convolutions with batch normalization, 32, 64
and 128 filters, on 32x32x3 generated images) with `model.fit`: one
warm-up epoch (tracing), then `--steps` timed steps. The four variants,
{default allocator, BFC} x {oneDNN off, on}, run one after the other in
every round, in an order rotated from round to round, so that all see the
same machine load on average. The ratios are BFC over default within each
oneDNN setting, per round (median and range). CPU time is the process's,
which other work on a shared machine disturbs less than wall time.

Example:
    python benchmarks/cpu_allocator.py --rounds=5 --steps=40
"""

import statistics
import time

from absl import app
from absl import flags

_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds of the four variants.")
_STEPS = flags.DEFINE_integer("steps", 40, "Timed training steps per run.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Training batch size.")

ALLOCATORS = ("default", "bfc")
ONEDNN = ("0", "1")


def train(steps, batch_size):
    """Trains the network in this process; returns its timings and peak."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    blocks = []
    for filters in (32, 64, 128):
        blocks += [
            keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
            keras.layers.Conv2D(filters, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
        ]
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3), dtype="uint8"),
            keras.layers.Rescaling(1 / 255),
            *blocks,
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    samples = steps * batch_size
    x = rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, samples)
    model.fit(x[: 4 * batch_size], y[: 4 * batch_size], batch_size=batch_size)
    start, cpu_start = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    try:
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except ValueError:  # "Allocator stats not available"
        peak = None
    return {"wall": wall, "cpu": cpu, "samples": samples, "peak": peak}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfmemsafe import testing

    variants = [(a, o) for o in ONEDNN for a in ALLOCATORS]
    runs = {variant: [] for variant in variants}
    for round_index in range(_ROUNDS.value):
        shift = round_index % len(variants)
        for allocator, onednn in variants[shift:] + variants[:shift]:
            env = {
                "TF_CPU_ALLOCATOR_USE_BFC": str(allocator == "bfc").lower(),
                "TF_ENABLE_ONEDNN_OPTS": onednn,
                # The child imports tfmemsafe.testing: keep it from
                # choosing the allocator.
                "TFMEMSAFE_AUTOCONFIGURE": "0",
            }
            result = testing.run_in_subprocess(
                train, args=[_STEPS.value, _BATCH_SIZE.value], env=env
            )
            runs[allocator, onednn].append(result)
            print(
                f"round {round_index + 1}: {allocator}, oneDNN={onednn}: "
                f"{result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU",
                flush=True,
            )

    print()
    print(
        f"{_STEPS.value} steps of batch {_BATCH_SIZE.value} per run, "
        f"{_ROUNDS.value} rounds; medians, ratios per round (min-max)."
    )
    print(
        "| oneDNN | CPU allocator | peak MB | samples/s (wall) "
        "| BFC vs default | range | samples/s (CPU) | BFC vs default "
        "| range |"
    )
    print("|---|---|---:|---:|---:|---|---:|---:|---|")
    for allocator, onednn in variants:
        results = runs[allocator, onednn]
        baseline = runs["default", onednn]
        cells = []
        for key in ("wall", "cpu"):
            speed = statistics.median(r["samples"] / r[key] for r in results)
            ratios = [
                b[key] / r[key] for r, b in zip(results, baseline, strict=True)
            ]
            cells += [
                f"{speed:.0f}",
                f"{statistics.median(ratios):.3f}",
                f"{min(ratios):.3f}-{max(ratios):.3f}",
            ]
        peaks = [r["peak"] for r in results if r["peak"] is not None]
        peak = (
            f"{statistics.median(peaks) / 2**20:.1f}" if peaks else "no stats"
        )
        label = "on" if onednn == "1" else "off"
        print(f"| {label} | {allocator} | {peak} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
