"""How well `tfmemsafe.estimate_memory` predicts peaks beyond its probes.

Four small networks on generated data, the architectures of issue #14's
proof (`tests/estimate_test.py`, `RealCapTest`), built by
`tfmemsafe.testing.reference_model`: a conv net (3x3 convolutions of 16
and 16 channels, max pooling, one of 32, global pooling), a residual net
with batch normalization (two blocks of two 16-channel convolutions), an
MLP (two dense layers of 1024 on 256 features, dropout) and an
`AccumulatingModel` (two micro-batches per step) whose two
two-convolution blocks are `Checkpointed`; images are 24x24x3, fed by
`tfmemsafe.testing.random_data`, a `tf.data` pipeline with one batch
prefetched.

Each network runs in a fresh process whose CPU allocator is capped
(TensorFlow's BFC allocator, oneDNN off, as
`tfmemsafe.testing.run_with_memory_cap` sets it) at the test's cap for
it, or at `--cap_mb`, all at once. There it estimates with the default
probes, then trains three steps at each of `--multiples` times the
largest probe, in increasing order, and reads the allocator's peak,
until one runs out of memory. The table gives the probes, and for each
larger size the predicted and the measured peak and the error
(predicted over measured, minus one).

Example:
    python benchmarks/estimate_accuracy.py
"""

import concurrent.futures

from absl import app
from absl import flags

_CAP_MB = flags.DEFINE_integer(
    "cap_mb", 0, "The allocator's limit in MB; 0: each network's own."
)
_MULTIPLES = flags.DEFINE_list(
    "multiples",
    ["2", "4", "6", "8"],
    "Sizes to check, times the largest probe.",
)
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", 0, "Image height and width; 0: each network's own."
)
_ARCHITECTURES = flags.DEFINE_list(
    "architectures",
    ["conv_net", "residual_net", "mlp", "accumulating_checkpointed_net"],
    "Networks to measure.",
)

_MIB = 1024 * 1024
# Each network's cap in MB and image size, as in `RealCapTest`.
CAPS = {
    "conv_net": (450, 24),
    "residual_net": (1300, 24),
    "mlp": (250, None),
    "accumulating_checkpointed_net": (1000, 24),
}


def measure(name, multiples, image_size=24):
    """Estimates, then measures at `multiples` of the largest probe."""
    import tfmemsafe
    from tfmemsafe import testing

    shape = (256,) if name == "mlp" else (image_size, image_size, 3)
    model = testing.reference_model(name, shape)
    data = testing.random_data(shape)
    estimate = tfmemsafe.estimate_memory(model, data)
    largest = estimate.measurements[-1][0]
    rows = []
    for multiple in multiples:
        size = multiple * largest
        peak = testing.training_peak_bytes(model, data, size)
        rows.append((size, estimate.peak_bytes(size), peak))
        if peak is None:
            break
    return {
        "probes": [[size, peak] for size, peak in estimate.measurements],
        "rows": rows,
        "max_batch_size": estimate.max_batch_size(),
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfmemsafe import testing

    multiples = [int(m) for m in _MULTIPLES.value]
    names = _ARCHITECTURES.value
    unknown = [name for name in names if name not in CAPS]
    if unknown:
        raise app.UsageError(
            f"`--architectures` must name some of {', '.join(CAPS)}. "
            f"Received: {', '.join(unknown)}"
        )
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        futures = {
            name: pool.submit(
                testing.run_with_memory_cap,
                measure,
                _CAP_MB.value or CAPS[name][0],
                args=[name, multiples, _IMAGE_SIZE.value or CAPS[name][1]],
            )
            for name in names
        }
        results = {name: future.result() for name, future in futures.items()}
    print(
        "| model | cap MB | probes: batch (peak MiB) | batch | "
        "predicted MiB | measured MiB | error |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, result in results.items():
        cap = _CAP_MB.value or CAPS[name][0]
        probes = ", ".join(
            f"{size} ({peak / _MIB:.1f})" for size, peak in result["probes"]
        )
        for size, predicted, peak in result["rows"]:
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
        print(f"| | | max_batch_size(): {result['max_batch_size']} | | | | |")


if __name__ == "__main__":
    app.run(main)
