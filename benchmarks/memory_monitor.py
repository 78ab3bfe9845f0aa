"""MemoryMonitor's cost to training throughput, side by side.

Trains the benchmark conv net (two 3x3 convolutions of 32 channels on
32x32x3 random images, global pooling, a dense head) with `fit`, one epoch
per call, rotating through the variants in every round so that all of
them see the same machine load:

- `none`: no callback.
- `empty_callback`: a callback whose `on_train_batch_end` does nothing
  (what any per-batch Keras callback costs).
- `monitor`: `tfmemsafe.MemoryMonitor()`, reading memory after every batch.
- `monitor_csv_tensorboard`: the same, also writing every reading to a CSV
  file and to TensorBoard (`csv_path`, `log_dir`).

It reports each variant's epoch time relative to `none` (the median and
quartiles of the per-round ratios), in wall time and in the process's CPU
time (less disturbed by other processes on a shared machine), and,
measured apart from training, what one call of the monitor's batch hook
costs, as a share of a training step.

The process uses TensorFlow's BFC allocator on the CPU (as the tests and
other memory benchmarks do), whose statistics the monitor reads.

Example:
    python benchmarks/memory_monitor.py --rounds=15 --steps=40
"""

import os
import statistics
import tempfile
import time

from absl import app
from absl import flags

VARIANTS = ("none", "empty_callback", "monitor", "monitor_csv_tensorboard")

_ROUNDS = flags.DEFINE_integer("rounds", 15, "Rounds of one epoch per variant.")
_STEPS = flags.DEFINE_integer("steps", 40, "Training steps per epoch.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Training batch size.")
_HOOK_CALLS = flags.DEFINE_integer(
    "hook_calls", 5000, "Calls of the batch hook timed on their own."
)


def build_model():
    """The benchmark conv net."""
    import keras

    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def make_callbacks(variant, tmp):
    import keras

    import tfmemsafe

    if variant == "none":
        return []
    if variant == "empty_callback":

        class Empty(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                pass

        return [Empty()]
    if variant == "monitor":
        return [tfmemsafe.MemoryMonitor(verbose=0)]
    return [
        tfmemsafe.MemoryMonitor(
            csv_path=os.path.join(tmp, "memory.csv"),
            log_dir=os.path.join(tmp, "logs"),
            verbose=0,
        )
    ]


def time_hook(monitor, calls):
    """Seconds per `on_train_batch_end` call of a monitor, outside `fit`."""
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    start = time.perf_counter()
    for batch in range(calls):
        monitor.on_train_batch_end(batch)
    elapsed = time.perf_counter() - start
    monitor.on_train_end()
    return elapsed / calls


def _ratios(times, baseline):
    """Quartiles of the per-round ratios `times / baseline`."""
    ratios = [t / b for t, b in zip(times, baseline, strict=True)]
    return statistics.quantiles(ratios, n=4, method="inclusive")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    # Read when TensorFlow is imported, so set before.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import numpy as np

    rng = np.random.default_rng(0)
    count = _STEPS.value * _BATCH_SIZE.value
    x = rng.random((count, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, count)
    model = build_model()
    model.fit(x, y, batch_size=_BATCH_SIZE.value, verbose=0)  # Trace.
    times = {variant: [] for variant in VARIANTS}
    cpu_times = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(_ROUNDS.value):
            shift = round_index % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                callbacks = make_callbacks(variant, tmp)
                start, cpu_start = time.perf_counter(), time.process_time()
                model.fit(
                    x,
                    y,
                    batch_size=_BATCH_SIZE.value,
                    verbose=0,
                    callbacks=callbacks,
                )
                times[variant].append(time.perf_counter() - start)
                cpu_times[variant].append(time.process_time() - cpu_start)
        hook_seconds = {
            variant: time_hook(
                make_callbacks(variant, tmp)[0], _HOOK_CALLS.value
            )
            for variant in ("monitor", "monitor_csv_tensorboard")
        }
    step_seconds = statistics.median(times["none"]) / _STEPS.value

    print(
        f"{_ROUNDS.value} rounds, {_STEPS.value} steps of batch "
        f"{_BATCH_SIZE.value} per epoch; median step "
        f"{1000 * step_seconds:.1f} ms without callbacks."
    )
    print(
        "| variant | median epoch (s) | wall time vs none | its IQR "
        "| process CPU time vs none | its IQR |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for variant in VARIANTS:
        wall = _ratios(times[variant], times["none"])
        cpu = _ratios(cpu_times[variant], cpu_times["none"])
        print(
            f"| {variant} | {statistics.median(times[variant]):.3f} "
            f"| {wall[1]:.3f} | {wall[0]:.3f}-{wall[2]:.3f} "
            f"| {cpu[1]:.3f} | {cpu[0]:.3f}-{cpu[2]:.3f} |"
        )
    print()
    for variant, seconds in hook_seconds.items():
        print(
            f"One call of on_train_batch_end, {variant}: "
            f"{1e6 * seconds:.1f} us = "
            f"{100 * seconds / step_seconds:.3f}% of a training step."
        )


if __name__ == "__main__":
    app.run(main)
