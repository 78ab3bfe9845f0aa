"""What an out-of-memory error late in an epoch costs, side by side.

Under a memory cap (TensorFlow's BFC allocator on the CPU limited to
`--cap_mb`, so running out raises a real `ResourceExhaustedError`), trains
one epoch of `--steps` steps of a small conv net (3x3 convolutions of 8
channels, BatchNormalization, global pooling) on a pipeline of shuffled
samples whose images grow from 24x24 to `--large` pixels at step N/2 or
3N/4, so that batch `--batch_size` runs out there and half of it fits:

- `epoch replay`: `tfmemsafe.fit` on a pipeline that reshuffles at every
  iteration (`shuffle(..., reshuffle_each_iteration=True)`). Such data
  cannot give the same order again, so `tfmemsafe.fit` does not resume at
  the failed step: the epoch's saved state is put back and the epoch
  starts again at half the batch, as it always did before issue #15.
- `resume at step`: `tfmemsafe.fit` on the same pipeline shuffled once,
  with a fixed seed (`reshuffle_each_iteration=False`): training goes on
  at the failed step, at half the batch with twice the accumulation
  steps.
- `model.fit`: Keras at the size that fits, from the start (no error).

Each run is a fresh process under the same cap, one after the other.
Wall time and the process's CPU time are given; the cost of an error is
the difference from `model.fit` minus the allocator's wait (measured once:
one failing allocation, which TensorFlow's BFC allocator, like the GPU's,
spends about ten seconds waiting for memory to be freed). The run fails if
a variant did not take its path (the `OOMEvent`'s `resumed_at_step`).

What the copy of the model that `tfmemsafe.fit` keeps at each epoch's
start costs on large models is measured by benchmarks/scale.py.

Example:
    python benchmarks/resume.py --steps=40
"""

import time

from absl import app
from absl import flags

_STEPS = flags.DEFINE_integer("steps", 40, "Steps per epoch (N).")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 32, "The batch size that runs out on large images."
)
_LARGE = flags.DEFINE_integer("large", 96, "Side of the large images.")
_CAP_MB = flags.DEFINE_integer("cap_mb", 80, "The allocator's limit in MB.")

VARIANTS = ("epoch replay", "resume at step", "model.fit")


def run(variant, steps, batch_size, large, grow_fraction):
    """One variant in this (capped) process; returns its timings."""
    import keras
    import tensorflow as tf

    import tfmemsafe

    rows = steps * batch_size
    grow_at = int(rows * grow_fraction)

    def make(positions, ids):
        # By position in the epoch, so the images grow at the same step
        # whatever the order.
        size = tf.where(positions[0] >= grow_at, large, 24)
        grid = tf.cast(tf.range(size), tf.float32)
        images = tf.sin(
            tf.cast(ids, tf.float32)[:, None, None, None] * 0.01
            + grid[None, :, None, None] * 0.1
            + grid[None, None, :, None] * 0.07
            + tf.constant([0.0, 1.0, 2.0])
        )
        return images, ids % 4

    # The variants differ only here: an order tfmemsafe.fit can give again
    # (one fixed shuffle) or not (a new shuffle at every iteration).
    reshuffle = variant == "epoch replay"

    def data(size):
        ids = (
            tf.data.Dataset.range(rows)
            .map(lambda i: tf.cast(i, tf.int32))
            .shuffle(rows, seed=0, reshuffle_each_iteration=reshuffle)
        )
        return ids.enumerate().batch(size).map(make)

    keras.utils.set_random_seed(0)
    model = tfmemsafe.AccumulatingModel(*_layers(keras), accumulation_steps=1)
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    wall, cpu = time.perf_counter(), time.process_time()
    if variant == "model.fit":
        model.accumulation_steps = 2
        model.fit(data(batch_size // 2), epochs=1, verbose=0)
        events = []
    else:
        history = tfmemsafe.fit(
            model, data, batch_size=batch_size, epochs=1, verbose=0
        )
        events = history.oom_events
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    _check_path(variant, events)
    return {
        "wall": wall,
        "cpu": cpu,
        "ooms": len(events),
        "iterations": int(model.optimizer.iterations),
        "steps_at": [e.step for e in events],
    }


def _check_path(variant, events):
    """Raises unless the variant ran out once and took its own path."""
    if variant == "model.fit":
        return
    if not events:
        raise RuntimeError(
            f"{variant}: no out-of-memory error; lower --cap_mb or raise "
            "--large."
        )
    resumed_at = events[0].resumed_at_step
    if variant == "epoch replay" and resumed_at is not None:
        raise RuntimeError(
            f"epoch replay resumed at step {resumed_at} instead of "
            "restarting the epoch: it would measure the resume path."
        )
    if variant == "resume at step" and resumed_at is None:
        raise RuntimeError(
            "resume at step restarted the epoch instead of resuming: it "
            "would measure the replay path."
        )


def _layers(keras):
    inputs = keras.Input((None, None, 3))
    hidden = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(
        inputs
    )
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(
        hidden
    )
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return inputs, keras.layers.Dense(4)(hidden)


def allocator_wait():
    """Seconds one failing allocation takes (in a capped process)."""
    import tensorflow as tf

    start = time.perf_counter()
    try:
        tf.zeros((2**30,))  # 4 GB: far beyond the cap.
    except tf.errors.ResourceExhaustedError:
        pass
    return time.perf_counter() - start


def main(argv):
    del argv  # Unused.
    from tfmemsafe import testing

    cap = _CAP_MB.value
    wait = testing.run_with_memory_cap(allocator_wait, cap)
    rows = []
    for fraction in (0.5, 0.75):
        results = {}
        for variant in VARIANTS:
            results[variant] = testing.run_with_memory_cap(
                run,
                cap,
                args=[
                    variant,
                    _STEPS.value,
                    _BATCH_SIZE.value,
                    _LARGE.value,
                    fraction,
                ],
            )
        base = results["model.fit"]
        for variant, result in results.items():
            extra = result["wall"] - base["wall"] - result["ooms"] * wait
            rows.append(
                (fraction, variant, result, extra, result["cpu"] / base["cpu"])
            )
    step = None
    print(
        f"N={_STEPS.value} steps at batch {_BATCH_SIZE.value}, cap {cap} MB; "
        f"one failing allocation waited {wait:.1f} s.\n"
    )
    print(
        "| OOM at | variant | OOMs | iterations | wall s | CPU s | "
        "CPU vs model.fit | wall beyond model.fit and the waits s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for fraction, variant, result, extra, cpu_ratio in rows:
        step = int(fraction * _STEPS.value)
        print(
            f"| step {step} of {_STEPS.value} | {variant} | {result['ooms']} "
            f"| {result['iterations']} | {result['wall']:.1f} | "
            f"{result['cpu']:.1f} | {cpu_ratio:.2f} | {extra:.1f} |"
        )


if __name__ == "__main__":
    app.run(main)
