"""What handing a pipeline to Keras through tfmemsafe costs it.

`tfmemsafe.fit` (and `evaluate`, `predict`, the estimate's probes) give
Keras each `tf.data` pipeline as `_pipelines.for_keras` leaves it: tf.data's
default graph optimizations off unless the pipeline sets them (with a
final `prefetch(AUTOTUNE)` in place of the one they would add), and a
pass-through `map` before that prefetch. That keeps TensorFlow 2.21 from
ending the process when memory is short (docs/oom-recovery.md, "Memory
held by something else"). This measures what it costs and saves, side
by side in one process, for three pipelines a Keras user writes: each
epoch makes a new iterator (as each `fit` call does) and reads every
batch.

- time: wall and CPU seconds of an epoch, medians over alternating runs;
- the allocator's peak while the iterator is made, over what was in use
  before: tf.data's rewrite copies the arrays the pipeline holds.

    python benchmarks/pipelines.py --repeats=7
"""

import statistics
import time

import numpy as np
import tensorflow as tf
from absl import app
from absl import flags

import tfmemsafe  # noqa: F401  (a CPU allocator with statistics)
from tfmemsafe import _pipelines

_REPEATS = flags.DEFINE_integer("repeats", 7, "Epochs timed per pipeline.")
_ROWS = flags.DEFINE_integer("rows", 8192, "Images of 32x32x3.")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Batch size.")


def _augment(image, label):
    image = tf.image.random_flip_left_right(image, seed=1)
    image = tf.image.random_brightness(image, 0.1, seed=2)
    return tf.clip_by_value(image, 0.0, 1.0), label


def _pipelines_to_time(x, y, batch_size):
    rows = tf.data.Dataset.from_tensor_slices((x, y))
    return {
        "arrays, `batch`": lambda: rows.batch(batch_size),
        "a `map` (sequential), `batch`": lambda: rows.map(_augment).batch(
            batch_size
        ),
        "a `map` (`num_parallel_calls=AUTOTUNE`), `batch`, `prefetch`": (
            lambda: (
                rows.map(_augment, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch_size)
                .prefetch(tf.data.AUTOTUNE)
            )
        ),
    }


def _epoch(dataset):
    """Wall s, CPU s of one epoch; the allocator's peak over the start,
    while the iterator is made."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    wall, cpu = time.perf_counter(), time.process_time()
    iterator = iter(dataset)
    made = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    for _ in iterator:
        pass
    return time.perf_counter() - wall, time.process_time() - cpu, made


def _median(runs, key, column):
    return statistics.median(run[column] for run in runs[key])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    rng = np.random.default_rng(0)
    x = rng.random((_ROWS.value, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, _ROWS.value).astype("int32")
    print(
        f"{_ROWS.value} images of 32x32x3 ({x.nbytes / 2**20:.0f} MiB), "
        f"batch {_BATCH.value}; medians of {_REPEATS.value} epochs each, "
        "the two ways alternating."
    )
    print(
        "| pipeline | wall ratio | CPU ratio | MiB while the iterator is "
        "made: as built / for_keras |"
    )
    print("| --- | ---: | ---: | ---: |")
    for name, build in _pipelines_to_time(x, y, _BATCH.value).items():
        ways = {
            "as built": build,
            "for_keras": lambda build=build: _pipelines.for_keras(
                build(), one_worker=True
            ),
        }
        for way in ways.values():
            _epoch(way())  # Warm up: trace the functions once.
        runs = {key: [] for key in ways}
        for _ in range(_REPEATS.value):
            for key, way in ways.items():
                runs[key].append(_epoch(way()))

        wall = _median(runs, "for_keras", 0) / _median(runs, "as built", 0)
        cpu = _median(runs, "for_keras", 1) / _median(runs, "as built", 1)
        made = [_median(runs, key, 2) / 2**20 for key in ways]
        print(
            f"| {name} | {wall:.2f} | {cpu:.2f} | "
            f"{made[0]:.1f} / {made[1]:.1f} |"
        )


if __name__ == "__main__":
    app.run(main)
