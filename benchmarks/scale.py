"""What the safety net costs on large models, side by side with `model.fit`.

An MLP with Adam (512 features, two hidden layers of `--widths` units, 10
classes) trains `--epochs` epochs on `--rows` random rows at batch
`--batch_size`, through `model.fit` and through `tfmemsafe.fit`
(`preflight=False`, so that only the safety net is measured), each in a
fresh process, the two one after the other for each width. The table gives
the parameters, the model-and-optimizer state, the peak RSS of the whole
process over what it held before training, and the CPU and wall time of
training, with the ratios of `tfmemsafe.fit` to `model.fit`.

Not measured here: one recovered error at the middle width. On this
workload the step's memory is nearly all weights and optimizer state
(`model.fit` peaks at 1,601 MiB at batch 2048 and 1,730 at 4096 for 71M
parameters), so no cap lets the full batch run out while half of it
surely fits. benchmarks/oom_recovery.py and benchmarks/resume.py measure
recoveries on networks whose activations dominate.

Example:
    python benchmarks/scale.py
    python benchmarks/scale.py --widths=4096,8192
"""

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
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Batch size.")
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


def train(wrapper, width, rows, epochs, batch_size):
    """One training run in this process; returns its costs."""
    import numpy as np

    import tfmemsafe

    x, y = _data(rows)
    model = _model(width)
    variables = [*model.variables, *model.optimizer.variables]
    state = sum(np.prod(v.shape) * 4 for v in variables)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu, wall = _cpu_seconds(), time.perf_counter()
    arguments = dict(batch_size=batch_size, epochs=epochs, verbose=0)
    if wrapper:
        tfmemsafe.fit(model, (x, y), preflight=False, **arguments)
    else:
        model.fit(x, y, **arguments)
    return {
        "parameters": model.count_params(),
        "state": state,
        "extra": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        - before,
        "cpu": _cpu_seconds() - cpu,
        "wall": time.perf_counter() - wall,
    }


def _mib(size):
    return f"{size / 2**20:,.0f}"


def main(argv):
    del argv  # Unused.
    from tfmemsafe import testing

    rows, epochs, size = _ROWS.value, _EPOCHS.value, _BATCH_SIZE.value
    print(
        f"An MLP with Adam, {rows} rows of {_FEATURES} features, {epochs} "
        f"epochs at batch {size}; peak RSS over the start of training.\n"
    )
    print(
        "| parameters | state MiB | model.fit MiB | tfmemsafe.fit MiB | "
        "extra MiB | extra / state | CPU ratio | wall ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for width in map(int, _WIDTHS.value):
        plain, wrapped = (
            testing.run_in_subprocess(
                train, args=[wrapper, width, rows, epochs, size]
            )
            for wrapper in (False, True)
        )
        extra = wrapped["extra"] - plain["extra"]
        print(
            f"| {plain['parameters'] / 1e6:.0f}M | {_mib(plain['state'])} | "
            f"{_mib(plain['extra'])} | {_mib(wrapped['extra'])} | "
            f"{_mib(extra)} | {extra / plain['state']:+.1%} | "
            f"{wrapped['cpu'] / plain['cpu']:.3f} | "
            f"{wrapped['wall'] / plain['wall']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
