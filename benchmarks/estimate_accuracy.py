"""How well `tfmemsafe.estimate_memory` predicts peaks beyond its probes.

Four small networks on generated data, the architectures of issue #14's
proof (`tests/estimate_test.py`, `RealCapTest`): a conv net (3x3
convolutions of 16 and 16 channels, max pooling, one of 32, global
pooling), a residual net with batch normalization (two blocks of two
16-channel convolutions), an MLP (two dense layers of 1024 on 256
features, dropout) and an `AccumulatingModel` (two micro-batches per
step) whose two two-convolution blocks are `Checkpointed`; images are
24x24x3, fed by a `tf.data` pipeline with one batch prefetched.

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


def build(name, image_size=24):
    """Returns `(model, data)`: a compiled network and a batching function."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmemsafe

    keras.utils.set_random_seed(0)
    conv = dict(padding="same", activation="relu")
    shape = (256,) if name == "mlp" else (image_size, image_size, 3)
    inputs = keras.Input(shape)
    if name == "conv_net":
        x = keras.layers.Conv2D(16, 3, **conv)(inputs)
        x = keras.layers.Conv2D(16, 3, **conv)(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(32, 3, padding="same")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    elif name == "residual_net":
        x = keras.layers.Conv2D(16, 3, padding="same")(inputs)
        for _ in range(2):
            r = keras.layers.Conv2D(16, 3, padding="same")(x)
            r = keras.layers.ReLU()(keras.layers.BatchNormalization()(r))
            r = keras.layers.Conv2D(16, 3, padding="same")(r)
            r = keras.layers.BatchNormalization()(r)
            x = keras.layers.ReLU()(keras.layers.Add()([x, r]))
        x = keras.layers.GlobalAveragePooling2D()(x)
    elif name == "mlp":
        x = keras.layers.Dense(1024, activation="relu")(inputs)
        x = keras.layers.Dense(1024, activation="relu")(x)
        x = keras.layers.Dropout(0.1)(x)
    elif name == "accumulating_checkpointed_net":
        x = keras.layers.Conv2D(16, 3, **conv)(inputs)
        for _ in range(2):
            block = keras.Sequential(
                [keras.layers.Conv2D(16, 3, **conv) for _ in range(2)]
            )
            x = tfmemsafe.Checkpointed(block)(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    else:
        raise app.UsageError(f"Unknown architecture: {name}")
    outputs = keras.layers.Dense(4)(x)
    if name == "accumulating_checkpointed_net":
        model = tfmemsafe.AccumulatingModel(
            inputs, outputs, accumulation_steps=2
        )
    else:
        model = keras.Model(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rows = 256
    x = np.random.default_rng(0).normal(size=(rows, *shape)).astype("float32")
    y = (x.reshape(rows, -1)[:, 0] > 0).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return model, lambda batch_size: dataset.batch(batch_size)


def measured_peak(model, data, batch_size):
    """The peak of three training steps, or `None` if they ran out."""
    import tensorflow as tf

    import tfmemsafe

    tfmemsafe.reset_peak_memory()
    try:
        model.fit(data(batch_size).take(3), verbose=0)
    except tf.errors.ResourceExhaustedError:
        return None
    finally:
        model.train_function = None
    return tfmemsafe.memory_info(include_limit=False).peak_bytes


def measure(name, multiples, image_size=24):
    """Estimates, then measures at `multiples` of the largest probe."""
    import tfmemsafe

    model, data = build(name, image_size)
    estimate = tfmemsafe.estimate_memory(model, data)
    largest = estimate.measurements[-1][0]
    rows = []
    for multiple in multiples:
        size = multiple * largest
        peak = measured_peak(model, data, size)
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
