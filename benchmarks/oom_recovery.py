"""What recovering from out-of-memory costs `tfmemsafe.fit`, side by side.

Under a memory cap (TensorFlow's BFC allocator on the CPU limited to
`--cap_mb`, so running out raises a real `ResourceExhaustedError`), trains
a conv net (two 3x3 convolutions of 16 channels, max pooling, one of 32,
global pooling, a dense head) on random 64x64x3 images for `--epochs`:

- `model.fit`: Keras, started at `--batch_size`, a size that fits.
- `SplitBatchOnOOM`: `model.fit` with `tfmemsafe.SplitBatchOnOOM()`,
  started at `--oversize` times that: the first batch runs out, and every
  batch is trained in the step as micro-batches of one update, the batch
  size kept.
- `tfmemsafe.fit`: started at `--oversize` times that (8x by default),
  with its pre-flight check (the default): it estimates the step's memory
  and starts at the largest halving predicted to fit, so no OOM.
- `tfmemsafe.fit, no pre-flight`: `preflight=False`; it runs out once at
  8x, estimates, and jumps to the largest halving predicted to fit.
- `tfmemsafe.fit(auto)`: `batch_size="auto"`, which runs
  `find_max_batch_size` first (run once, after the rounds).

Each run is a fresh process under the same cap. The first three variants
take turns for `--rounds` rounds (their order rotated every round, so all
see the same machine load on average); the ratios are per round. The
allocator OOMs column counts the allocator's own reports of a failed
allocation (`tfmemsafe.testing.AllocatorFailures`). Besides
wall time, the table gives the process's CPU time, which other work on a
shared machine disturbs less, and breaks the extra time of
`tfmemsafe.fit` down with a callback that stamps every epoch and step:

- allocator wait: the out-of-memory errors times the time one failing
  allocation takes, measured once in that process: TensorFlow's BFC
  allocator (the GPU's too) waits about ten seconds for memory to be
  freed before it gives up;
- failed steps: from the start of each step that ran out to the start of
  the retry: the wait, tracing and computing at the size that failed up
  to the allocation that failed, restoring the epoch's state, and the
  next `model.fit`'s setup;
- lost partial epochs: steps done in an epoch before it failed, undone;
- state copies: the host copy of the weights and optimizer state taken
  at the start of every epoch (one copy of every model and optimizer
  variable to NumPy timed, times the epochs).

Example:
    python benchmarks/oom_recovery.py --epochs=12 --rounds=2
"""

import statistics
import time

from absl import app
from absl import flags

_EPOCHS = flags.DEFINE_integer("epochs", 8, "Epochs per variant.")
_SAMPLES = flags.DEFINE_integer("samples", 2048, "Training images.")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 128, "A batch size that fits under the cap."
)
_OVERSIZE = flags.DEFINE_integer(
    "oversize", 8, "How many times too large tfmemsafe.fit starts."
)
_CAP_MB = flags.DEFINE_integer("cap_mb", 450, "The allocator's limit in MB.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 2, "Rounds of the first four variants, in turn."
)
_AUTO = flags.DEFINE_bool("auto", True, "Also run tfmemsafe.fit(auto) once.")

VARIANTS = (
    "model.fit",
    "SplitBatchOnOOM",
    "tfmemsafe.fit",
    "tfmemsafe.fit, no pre-flight",
    "tfmemsafe.fit(auto)",
)
_ROTATED = VARIANTS[:4]


def build_model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def allocator_wait_seconds(cap_mb):
    """How long one allocation beyond the cap takes to fail."""
    import tensorflow as tf

    start = time.perf_counter()
    try:
        tf.zeros((cap_mb + 1) * 1024 * 1024 // 4)
    except tf.errors.ResourceExhaustedError:
        return time.perf_counter() - start
    raise RuntimeError(f"An allocation of {cap_mb + 1} MB did not fail.")


def run_variant(variant, epochs, samples, batch_size, oversize, cap_mb):
    """Trains one variant in this (capped) process; returns its timings."""
    import keras
    import numpy as np

    import tfmemsafe
    from tfmemsafe import testing

    class Timeline(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.events = []

        def on_epoch_begin(self, epoch, logs=None):
            self.events.append(("epoch", time.perf_counter()))

        def on_train_batch_begin(self, batch, logs=None):
            self.events.append(("begin", time.perf_counter()))

        def on_train_batch_end(self, batch, logs=None):
            self.events.append(("end", time.perf_counter()))

    x, y = testing.random_images(samples, size=64, classes=4)
    model = build_model()
    timeline = Timeline()
    result = {"variant": variant, "allocator_wait": 0.0, "oom_events": 0}
    if variant != "model.fit":
        result["allocator_wait"] = allocator_wait_seconds(cap_mb)
    start, cpu_start = time.perf_counter(), time.process_time()
    with testing.AllocatorFailures() as failures:
        if variant == "model.fit":
            model.fit(
                x,
                y,
                batch_size=batch_size,
                epochs=epochs,
                callbacks=[timeline],
                verbose=0,
            )
            result["final_batch_size"] = batch_size
        elif variant == "SplitBatchOnOOM":
            split = tfmemsafe.SplitBatchOnOOM()
            model.fit(
                x,
                y,
                batch_size=batch_size * oversize,
                epochs=epochs,
                callbacks=[timeline, split],
                verbose=0,
            )
            result["oom_events"] = len(split.oom_events)
            result["final_batch_size"] = batch_size * oversize
        else:
            history = tfmemsafe.fit(
                model,
                (x, y),
                batch_size="auto"
                if variant.endswith("(auto)")
                else batch_size * oversize,
                epochs=epochs,
                preflight=not variant.endswith("no pre-flight"),
                callbacks=[timeline],
                verbose=0,
            )
            result["oom_events"] = len(history.oom_events)
            result["final_batch_size"] = history.batch_size
        result["wall"] = time.perf_counter() - start
        result["cpu"] = time.process_time() - cpu_start
    result["allocator_ooms"] = failures.count
    state_variables = model.variables + model.optimizer.variables
    # What fit copies to the host at each epoch's start: every variable of
    # the model and of its optimizer.
    copy_start = time.perf_counter()
    [np.array(v.numpy(), copy=True) for v in state_variables]
    result["state_copies"] = epochs * (time.perf_counter() - copy_start)
    if not variant.startswith("tfmemsafe.fit"):
        result["state_copies"] = 0.0  # Only tfmemsafe.fit's epochs copy.
    # Before the first epoch: building, and the search with "auto".
    result["setup"] = timeline.events[0][1] - start
    result.update(_breakdown(timeline.events))
    return result


def _breakdown(events):
    """Seconds in failed steps and in the epochs' steps undone."""
    failed = lost = 0.0
    epoch_start = step_start = None
    durations = []
    for kind, stamp in events:
        if kind == "epoch":
            if step_start is not None:  # The last step never ended.
                failed += stamp - step_start
                lost += step_start - epoch_start
            epoch_start, step_start = stamp, None
        elif kind == "begin":
            step_start = stamp
        else:
            durations.append(stamp - step_start)
            step_start = None
    return {
        "failed_steps": failed,
        "lost_epochs": lost,
        "median_step": statistics.median(durations),
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfmemsafe import testing

    def run(variant):
        result = testing.run_with_memory_cap(
            run_variant,
            _CAP_MB.value,
            args=[
                variant,
                _EPOCHS.value,
                _SAMPLES.value,
                _BATCH_SIZE.value,
                _OVERSIZE.value,
                _CAP_MB.value,
            ],
        )
        print(
            f"{variant}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s "
            "CPU",
            flush=True,
        )
        return result

    runs = {variant: [] for variant in VARIANTS}
    for round_index in range(_ROUNDS.value):
        turn = round_index % len(_ROTATED)
        for variant in _ROTATED[turn:] + _ROTATED[:turn]:
            runs[variant].append(run(variant))
    if _AUTO.value:
        runs[VARIANTS[4]].append(run(VARIANTS[4]))

    baseline = runs["model.fit"]
    print()
    print(
        f"{_EPOCHS.value} epochs of {_SAMPLES.value} 64x64 images under a "
        f"{_CAP_MB.value} MB cap; model.fit at batch {_BATCH_SIZE.value}, "
        f"the others from {_BATCH_SIZE.value * _OVERSIZE.value}; "
        f"{_ROUNDS.value} rounds (medians; ratios per round, the auto run "
        "against the median model.fit)."
    )
    print(
        "| variant | final batch | wall s | vs model.fit | CPU s "
        "| vs model.fit | allocator OOMs | events | allocator wait s "
        "| failed steps s | lost partial epochs s | before epoch 0 s "
        "| state copies s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant, results in runs.items():
        if not results:
            continue
        if len(results) == len(baseline):
            pairs = zip(results, baseline, strict=True)
        else:
            median = {
                key: statistics.median(r[key] for r in baseline)
                for key in ("wall", "cpu")
            }
            pairs = [(r, median) for r in results]
        pairs = list(pairs)
        wall_ratio = statistics.median(r["wall"] / b["wall"] for r, b in pairs)
        cpu_ratio = statistics.median(r["cpu"] / b["cpu"] for r, b in pairs)

        def median_of(key, results=results):
            return statistics.median(r[key] for r in results)

        ooms = median_of("allocator_ooms")
        print(
            f"| {variant} | {results[-1]['final_batch_size']} "
            f"| {median_of('wall'):.1f} | {wall_ratio:.2f} "
            f"| {median_of('cpu'):.1f} | {cpu_ratio:.2f} "
            f"| {ooms:g} | {median_of('oom_events'):g} "
            f"| {ooms * median_of('allocator_wait'):.1f} "
            f"| {median_of('failed_steps'):.1f} "
            f"| {median_of('lost_epochs'):.1f} "
            f"| {median_of('setup'):.1f} "
            f"| {median_of('state_copies'):.1f} |"
        )
    waits = [r["allocator_wait"] for r in runs["tfmemsafe.fit"]]
    if waits:
        print()
        print(
            f"One failing allocation took {statistics.median(waits):.1f} s. "
            "Per-round wall ratios: "
            + "; ".join(
                f"{variant} "
                + ", ".join(
                    f"{r['wall'] / b['wall']:.2f}"
                    for r, b in zip(runs[variant], baseline, strict=True)
                )
                for variant in _ROTATED[1:]
            )
            + "."
        )


if __name__ == "__main__":
    app.run(main)
