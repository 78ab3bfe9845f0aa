"""What the safety net costs on large models, side by side with `model.fit`.

An MLP with Adam (512 features, two hidden layers of `--widths` units, 10
classes) trains `--epochs` epochs on `--rows` random rows at batch
`--batch_size`, with no out-of-memory error, through `model.fit`,
through `model.fit` with `tfmemsafe.SplitBatchOnOOM()` in its callbacks,
and through `tfmemsafe.fit` (which is `model.fit` with that callback and
a pre-flight estimate; here `preflight=False`, so that only the safety
net is measured), each in a fresh process, the three taking turns
`--rounds` times for each width. Neither the callback nor
`tfmemsafe.fit` copies the model or optimizer state: the callback holds
each step's batch, to train it again if it runs out, and without an
error writes nothing. The table gives the parameters, the
model-and-optimizer state, the peak RSS of the whole process over what
it held before training, and the CPU and wall time of training, with the
ratios of each to `model.fit`: medians, and the range of the rounds'
ratios (one run's CPU time moves by several percent on a shared
machine).

With `--recover_width` (off by default), one error at that width, under
a CPU allocator cap of `--cap_mb`: at epoch 1, step 1 a callback fills
the allocator, as memory that something else takes would, and lets go
when the next step begins; the table sets `tfmemsafe.fit` beside
`model.fit` under the same cap with nothing held. `tfmemsafe.fit` trains
the failed step's batch again in the same step, as micro-batches of one
update, while the fill is still held. On this workload the step's memory
is nearly all weights, their gradients and optimizer state, which no
split makes smaller, so no micro-batch fits beside the fill: the run
ends with `tfmemsafe.OutOfMemoryError`, micro-batches of one example
having run out too (a batch too large is recovered from in
benchmarks/oom_recovery.py).

Example:
    python benchmarks/scale.py
    python benchmarks/scale.py --widths=4096,8192 --rounds=1
"""

import os
import resource
import time

from absl import app
from absl import flags

_WIDTHS = flags.DEFINE_list(
    "widths",
    ["4096", "8192", "16000"],
    "Hidden widths: about 19M, 71M and 264M parameters.",
)
_ROWS = flags.DEFINE_integer("rows", 2048, "Training rows.")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Epochs.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 3, "Rounds of the three runs for each width, taking turns."
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Batch size.")
_RECOVER_WIDTH = flags.DEFINE_integer(
    "recover_width", 0, "Hidden width of the held-memory error (0: none)."
)
_CAP_MB = flags.DEFINE_integer(
    "cap_mb", 2000, "CPU allocator cap of the recovered error, MB."
)
_FEATURES = 512


def _model(width):
    import keras

    model = keras.Sequential(
        [
            keras.Input((_FEATURES,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    return model


def _data(rows):
    import numpy as np

    generator = np.random.default_rng(0)
    x = generator.random((rows, _FEATURES), dtype="float32")
    return x, generator.integers(0, 10, rows)


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_VARIANTS = ("model.fit", "SplitBatchOnOOM", "tfmemsafe.fit")


def train(wrapper, width, rows, epochs, batch_size, hold=False):
    """One training run in this process; returns its costs."""
    import numpy as np

    import tfmemsafe
    from tfmemsafe import testing

    x, y = _data(rows)
    model = _model(width)
    variables = [*model.variables, *model.optimizer.variables]
    state = sum(np.prod(v.shape) * 4 for v in variables)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu, wall = _cpu_seconds(), time.perf_counter()
    callbacks = [testing.HeldMemory(epoch=1, step=1)] if hold else []
    arguments = dict(
        batch_size=batch_size, epochs=epochs, verbose=0, callbacks=callbacks
    )
    events = []
    if wrapper == "SplitBatchOnOOM":
        split = tfmemsafe.SplitBatchOnOOM()
        arguments["callbacks"] = [*callbacks, split]
        model.fit(x, y, **arguments)
        events = split.oom_events
    elif wrapper:
        history = tfmemsafe.fit(model, (x, y), preflight=False, **arguments)
        events = history.oom_events
    else:
        model.fit(x, y, **arguments)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "errors": len(events),
        "split_into": events[-1].split_into if events else 1,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
        "updates": int(model.optimizer.iterations.numpy()),
        "parameters": model.count_params(),
        "state": state,
        "peak": peak,
        "extra": peak - before,
        "cpu": _cpu_seconds() - cpu,
        "wall": time.perf_counter() - wall,
    }


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _ratios(pairs, key, index=1):
    """A variant's over `model.fit`'s: the median (the range)."""
    ratios = [runs[index][key] / runs[0][key] for runs in pairs]
    if len(ratios) == 1:
        return f"{ratios[0]:.3f}"
    return f"{_median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _mib(size):
    return f"{size / 2**20:,.0f}"


def main(argv):
    del argv  # Unused.
    from tfmemsafe import testing

    rows, epochs, size = _ROWS.value, _EPOCHS.value, _BATCH_SIZE.value
    if _RECOVER_WIDTH.value and (epochs < 2 or rows < 2 * size):
        # The memory is held at epoch 1, step 1.
        raise app.UsageError(
            "The recovered error needs `--epochs` >= 2 and `--rows` of at "
            "least two batches, or `--recover_width=0`."
        )
    print(
        f"An MLP with Adam, {rows} rows of {_FEATURES} features, {epochs} "
        f"epochs at batch {size}; peak RSS over the start of training; "
        f"{_ROUNDS.value} rounds a width, the three taking turns: medians, "
        "and the range of the rounds' ratios to model.fit.\n"
    )
    print(
        "| parameters | state MiB | model.fit MiB | variant | variant MiB "
        "| extra MiB | extra / state | CPU ratio | wall ratio |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    onednn = set()
    for width in map(int, _WIDTHS.value):
        rounds = []
        for _ in range(_ROUNDS.value):
            rounds.append(
                [
                    testing.run_in_subprocess(
                        train,
                        args=[variant != "model.fit" and variant]
                        + [width, rows, epochs, size],
                    )
                    for variant in _VARIANTS
                ]
            )
        onednn.update(run["onednn"] for runs in rounds for run in runs)
        errors = sum(run["errors"] for runs in rounds for run in runs)
        if errors:
            print(f"({errors} out-of-memory errors at width {width}.)")
        plain_extra = _median([runs[0]["extra"] for runs in rounds])
        state = rounds[0][0]["state"]
        for index, variant in enumerate(_VARIANTS[1:], start=1):
            extra = _median([r[index]["extra"] - r[0]["extra"] for r in rounds])
            variant_extra = _median([r[index]["extra"] for r in rounds])
            print(
                f"| {rounds[0][0]['parameters'] / 1e6:.0f}M | {_mib(state)} | "
                f"{_mib(plain_extra)} | {variant} | {_mib(variant_extra)} | "
                f"{_mib(extra)} | {extra / state:+.1%} | "
                f"{_ratios(rounds, 'cpu', index)} | "
                f"{_ratios(rounds, 'wall', index)} |",
                flush=True,
            )
    if onednn:
        print(f"\nTF_ENABLE_ONEDNN_OPTS in the runs: {', '.join(onednn)}.")
    if _RECOVER_WIDTH.value:
        _recovered(_RECOVER_WIDTH.value, rows, epochs, size, _CAP_MB.value)


def _recovered(width, rows, epochs, size, cap_mb):
    from tfmemsafe import testing

    print(
        f"\nOne held-memory error at hidden width {width}, CPU allocator "
        f"capped at {cap_mb} MB: `tfmemsafe.fit` with memory held at epoch "
        "1, step 1 until the next step, beside `model.fit` with nothing "
        "held.\n"
    )
    print(
        "| run | errors | micro-batches | updates | peak RSS MiB "
        "| over start MiB | CPU s | wall s | CPU ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    plain, recovered = (
        testing.run_with_memory_cap(
            train, cap_mb, args=[wrapper, width, rows, epochs, size, wrapper]
        )
        for wrapper in (False, True)
    )
    for name, run in (("model.fit", plain), ("tfmemsafe.fit", recovered)):
        print(
            f"| {name} | {run['errors']} | {run['split_into']} "
            f"| {run['updates']} | "
            f"{_mib(run['peak'])} | {_mib(run['extra'])} | "
            f"{run['cpu']:.1f} | {run['wall']:.1f} | "
            f"{run['cpu'] / plain['cpu']:.3f} |",
            flush=True,
        )
    print(f"\nTF_ENABLE_ONEDNN_OPTS in the capped runs: {plain['onednn']}.")


if __name__ == "__main__":
    app.run(main)
