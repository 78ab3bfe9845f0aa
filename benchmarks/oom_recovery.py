"""What recovering from out-of-memory costs, side by side with `model.fit`.

Under a memory cap (TensorFlow's BFC allocator on the CPU limited to
`--cap_mb`, so running out raises a real `ResourceExhaustedError`), trains
a conv net (two 3x3 convolutions of 16 channels, max pooling, one of 32,
global pooling, a dense head) on random 64x64x3 images for `--epochs`:

- `model.fit`: Keras, at `--batch_size`, a size that fits.
- `SplitBatchOnOOM`: `model.fit` with `tfmemsafe.SplitBatchOnOOM()`, at
  `--oversize` times that (8x by default): the first batch runs out and
  is trained again, in the same step, as micro-batches whose gradients
  make one update, sized from the step's measured peak; every later batch
  trains in micro-batches from the start. The batch size is kept.
- `tfmemsafe.fit`: `model.fit` plus that callback, at the same oversize,
  with its pre-flight check (the default): it estimates the step's memory
  and starts the batch already split into micro-batches predicted to fit,
  so no error.
- `tfmemsafe.fit, no pre-flight`: `preflight=False`; the first batch runs
  out once and is split, as with the callback alone.
- `tfmemsafe.fit(auto)`: `batch_size="auto"`, which runs
  `find_max_batch_size` first (run once, after the rounds).

Each run is a fresh process under the same cap. The first four variants
take turns for `--rounds` rounds (their order rotated every round, so all
see the same machine load on average); the ratios are per round. The
batch column is the batch trained (`history.batch_size` for
`tfmemsafe.fit`), the micro-batches column how many micro-batches each
batch trained as at the end (the last event's `split_into`, or after a
grow-back the batch over the grown micro-batch). The allocator OOMs
column counts the allocator's own reports of a failed allocation
(`tfmemsafe.testing.AllocatorFailures`); events are the `OOMEvent`s,
the pre-flight check's included. Besides wall time, the table gives the
process's CPU time, which other work on a shared machine disturbs less,
and breaks the extra time down with a callback that stamps every epoch
and step:

- allocator wait: the out-of-memory errors times the time one failing
  allocation takes, measured once in that process: TensorFlow's BFC
  allocator (the GPU's too) waits about ten seconds for memory to be
  freed before it gives up;
- failed steps: the steps that ran out, from their start to their end,
  less the run's median step: the wait, tracing and computing at the
  batch that failed up to the allocation that failed, and the same batch
  trained again as micro-batches (with their tracing). Nothing is undone:
  the step that ran out is the step that trains;
- before epoch 0: building the run, the pre-flight estimate, and the
  search with "auto".

Example:
    python benchmarks/oom_recovery.py --epochs=12 --rounds=2
"""

import os
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

    import tfmemsafe
    from tfmemsafe import testing

    class Timeline(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.first_epoch = None
            self.epoch = None
            self.steps = {}  # (epoch, batch) -> [begin, end]

        def on_epoch_begin(self, epoch, logs=None):
            if self.first_epoch is None:
                self.first_epoch = time.perf_counter()
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.steps[self.epoch, batch] = [time.perf_counter(), None]

        def on_train_batch_end(self, batch, logs=None):
            self.steps[self.epoch, batch][1] = time.perf_counter()

    x, y = testing.random_images(samples, size=64, classes=4)
    model = build_model()
    timeline = Timeline()
    result = {
        "variant": variant,
        "allocator_wait": 0.0,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
    }
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
            result["batch_size"] = batch_size
            events, grow_backs = [], []
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
            result["batch_size"] = batch_size * oversize
            events, grow_backs = split.oom_events, split.grow_back_events
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
            result["batch_size"] = history.batch_size
            events = history.oom_events
            grow_backs = history.grow_back_events
        result["wall"] = time.perf_counter() - start
        result["cpu"] = time.process_time() - cpu_start
    result["allocator_ooms"] = failures.count
    result["oom_events"] = len(events)
    result["micro_batches"] = _micro_batches(
        result["batch_size"], events, grow_backs
    )
    # Before the first epoch: building, the pre-flight estimate, and the
    # search with "auto".
    result["setup"] = timeline.first_epoch - start
    durations = {
        key: end - begin for key, (begin, end) in timeline.steps.items()
    }
    result["median_step"] = statistics.median(durations.values())
    failed = {(e.epoch, e.step) for e in events if e.phase == "training"}
    result["failed_steps"] = sum(
        durations[key] - result["median_step"] for key in failed
    )
    return result


def _micro_batches(batch_size, events, grow_backs):
    """How many micro-batches a batch trained as at the end: `"1"`, `"8"`,
    or `"8, then 4"` after a grow-back."""
    if not events:
        return "1"
    count = str(events[-1].split_into)
    last = (events[-1].epoch, events[-1].step)
    grown = [g for g in grow_backs if (g.epoch, g.step) > last]
    if grown:
        count += f", then {-(-batch_size // grown[-1].batch_size_after)}"
    return count


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
        f"the others at {_BATCH_SIZE.value * _OVERSIZE.value}; "
        f"{_ROUNDS.value} rounds (medians; ratios per round, the auto run "
        "against the median model.fit); TF_ENABLE_ONEDNN_OPTS in the runs: "
        + ", ".join(sorted({r["onednn"] for rs in runs.values() for r in rs}))
        + "."
    )
    print(
        "| variant | batch | micro-batches | wall s | vs model.fit | CPU s "
        "| vs model.fit | allocator OOMs | events | allocator wait s "
        "| failed steps s | before epoch 0 s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
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
        splits = sorted({r["micro_batches"] for r in results})
        print(
            f"| {variant} | {results[-1]['batch_size']} "
            f"| {' or '.join(splits)} "
            f"| {median_of('wall'):.1f} | {wall_ratio:.2f} "
            f"| {median_of('cpu'):.1f} | {cpu_ratio:.2f} "
            f"| {ooms:g} | {median_of('oom_events'):g} "
            f"| {ooms * median_of('allocator_wait'):.1f} "
            f"| {median_of('failed_steps'):.1f} "
            f"| {median_of('setup'):.1f} |"
        )
    waits = [r["allocator_wait"] for r in runs["tfmemsafe.fit"]]
    if waits:
        print()
        print(f"One failing allocation took {statistics.median(waits):.1f} s.")
        for key, name in (("wall", "wall"), ("cpu", "CPU")):
            print(
                f"Per-round {name} ratios: "
                + "; ".join(
                    f"{variant} "
                    + ", ".join(
                        f"{r[key] / b[key]:.2f}"
                        for r, b in zip(runs[variant], baseline, strict=True)
                    )
                    for variant in _ROTATED[1:]
                )
                + "."
            )
        print(
            "Micro-batches per round: "
            + "; ".join(
                f"{variant} "
                + ", ".join(r["micro_batches"] for r in runs[variant])
                for variant in _ROTATED[1:]
            )
            + "."
        )


if __name__ == "__main__":
    app.run(main)
