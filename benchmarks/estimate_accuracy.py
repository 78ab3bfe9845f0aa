"""How well `tfmemsafe.estimate_memory` predicts peaks beyond its probes.

The six networks of the memory model's proof (`tests/estimate_test.py`,
`RealCapTest`), built by `tfmemsafe.testing.reference_model` on data from
`tfmemsafe.testing.random_data` (a `tf.data` pipeline, one batch
prefetched): a conv net and a residual net with batch normalization on
24x24 images, an MLP on 256 features, an `AccumulatingModel` whose
convolution blocks are `Checkpointed`, a GRU and a transformer encoder
block on 64 token ids.

Each network runs in `--repeats` fresh processes whose CPU allocator is
capped (TensorFlow's BFC allocator, oneDNN off, as
`tfmemsafe.testing.run_with_memory_cap` sets it) at the test's cap for
it, two processes at a time. Each estimates with the default probes,
then trains eight steps at each of `--multiples` times the largest
probe, in increasing order, until one runs out of memory, and reads the
highest step's peak as the estimate reads its probes: the growth over
what was in use before, plus the model's counted state. The table gives
the first process's probes, the predicted and measured peaks and the
error (predicted over measured, minus one), and across the processes the
spread (largest less smallest, over the median) of `max_batch_size()`
and of the prediction at the first process's largest size.

With `--step=tfmemsafe.fit`, the probes and the measured steps are the
step as `tfmemsafe.fit` trains it and its own estimates measure it: each
optimizer's updates wait for every gradient and run one after another
(the step guard, installed through a private module, as `fit` installs
it). With `--step=model.fit` (the default), Keras' own step, as
`tfmemsafe.estimate_memory` measures it for plain `model.fit`.

Example:
    python benchmarks/estimate_accuracy.py
    python benchmarks/estimate_accuracy.py --step=tfmemsafe.fit
"""

import concurrent.futures

from absl import app
from absl import flags

_MULTIPLES = flags.DEFINE_list(
    "multiples",
    ["1.5", "2", "3", "4"],
    "Sizes to check, times the largest probe.",
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 2, "Fresh processes per network, for the spread."
)
_ARCHITECTURES = flags.DEFINE_list(
    "architectures",
    [
        "conv_net",
        "residual_net",
        "mlp",
        "accumulating_checkpointed_net",
        "gru",
        "transformer",
    ],
    "Networks to measure.",
)
_STEP = flags.DEFINE_enum(
    "step",
    "model.fit",
    ["model.fit", "tfmemsafe.fit"],
    "The training step measured: Keras' own, or tfmemsafe.fit's.",
)

_MIB = 1024 * 1024
# Each network's sample shape, cap in MB and whether its data is token
# ids, as in `RealCapTest`.
NETWORKS = {
    "conv_net": ((24, 24, 3), 1200, False),
    "residual_net": ((24, 24, 3), 1300, False),
    "mlp": ((256,), 250, False),
    "accumulating_checkpointed_net": ((24, 24, 3), 1000, False),
    "gru": ((64,), 700, True),
    "transformer": ((64,), 700, True),
}


def measure(name, multiples, step="model.fit"):
    """Estimates, then measures at `multiples` of the largest probe."""
    import gc

    import tfmemsafe
    from tfmemsafe import _model_state
    from tfmemsafe import _step_guard
    from tfmemsafe import estimate as estimate_lib
    from tfmemsafe import testing

    shape, _, tokens = NETWORKS[name]
    model = testing.reference_model(name, (None,) if tokens else shape)
    if step == "tfmemsafe.fit":
        _step_guard.StepGuard(
            model,
            _model_state.optimizers_of(model),
            _model_state.gradient_accumulators_of(model),
        )
    data = testing.random_data(shape, tokens=tokens)
    estimate = tfmemsafe.estimate_memory(model, data)
    largest = estimate.measurements[-1][0]
    rows = []
    for multiple in multiples:
        size = int(multiple * largest)
        gc.collect()
        before = tfmemsafe.memory_info("CPU:0").current_bytes
        peak = testing.training_peak_bytes(model, data, size, steps=8)
        if peak is not None:
            peak = peak - before + estimate_lib.state_bytes(model)
        rows.append((size, estimate.peak_bytes(size), peak))
        if peak is None:
            break
    return {
        "probes": [[size, peak] for size, peak in estimate.measurements],
        "rows": rows,
        "line": [estimate.fixed_bytes, estimate.per_sample_bytes],
        "max_batch_size": estimate.max_batch_size(),
    }


def _spread(values) -> str:
    values = sorted(values)
    middle = values[len(values) // 2]
    return f"{100 * (values[-1] - values[0]) / middle:.1f}%"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfmemsafe import testing

    multiples = [float(m) for m in _MULTIPLES.value]
    names = _ARCHITECTURES.value
    unknown = [name for name in names if name not in NETWORKS]
    if unknown:
        raise app.UsageError(
            f"`--architectures` must name some of {', '.join(NETWORKS)}. "
            f"Received: {', '.join(unknown)}"
        )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {
            name: [
                pool.submit(
                    testing.run_with_memory_cap,
                    measure,
                    NETWORKS[name][1],
                    args=[name, multiples, _STEP.value],
                    timeout=1800,
                )
                for _ in range(_REPEATS.value)
            ]
            for name in names
        }
        results = {
            name: [future.result() for future in runs]
            for name, runs in futures.items()
        }
    print(
        "| model | cap MB | probes: batch (peak MiB) | batch | "
        "predicted MiB | measured MiB | error |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        first = runs[0]
        cap = NETWORKS[name][1]
        probes = ", ".join(
            f"{size} ({peak / _MIB:.1f})" for size, peak in first["probes"]
        )
        for size, predicted, peak in first["rows"]:
            if peak is None:
                measured, error = "out of memory", ""
            else:
                measured = f"{peak / _MIB:.1f}"
                error = f"{100 * (predicted / peak - 1):+.1f}%"
            print(
                f"| {name} | {cap} | {probes} | {size} | "
                f"{predicted / _MIB:.1f} | {measured} | {error} |"
            )
            name = cap = probes = ""
        sizes = [run["max_batch_size"] for run in runs]
        last = first["rows"][-1][0]
        predicted = [
            fixed + slope * last
            for fixed, slope in (run["line"] for run in runs)
        ]
        print(
            f"| | | max_batch_size(): {', '.join(map(str, sizes))} "
            f"(spread {_spread(sizes)}); predicted at {last}: spread "
            f"{_spread(predicted)} over {len(runs)} processes | | | | |"
        )


if __name__ == "__main__":
    app.run(main)
