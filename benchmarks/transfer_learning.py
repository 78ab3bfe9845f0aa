"""Transfer learning: peak memory and time per epoch, side by side.

Trains `tfmemsafe.build_frozen_mobilenet_v2` (default: alpha 1.0, 32x32
random images resized to 96 px, 10 classes, batch 64, 256 samples per
epoch) with random weights, which cost the same as ImageNet weights, once
per variant, each in a fresh process whose CPU allocator is TensorFlow's
BFC allocator, so that the peak it reports is exact:

- `frozen`: the backbone frozen, `fit` on the images.
- `fine_tune`: the whole backbone unfrozen with `tfmemsafe.unfreeze`
  (BatchNormalization kept frozen), `fit` on the images.
- `cached`: `tfmemsafe.cache_features` runs the backbone once, then
  `tfmemsafe.fit_head` trains the head on the cached features.

The first epoch (tracing) is not measured; the peak is the allocator's
high-water mark over the measured epochs, the time the median epoch. The
caching pass is measured on its own, tracing included, since it runs once.

Example:
    python benchmarks/transfer_learning.py --size=96 --batch_size=64
"""

import statistics
import time

from absl import app
from absl import flags

VARIANTS = ("frozen", "fine_tune", "cached")

_SIZE = flags.DEFINE_integer("size", 96, "Side the backbone sees (resize_to).")
_ALPHA = flags.DEFINE_float("alpha", 1.0, "MobileNetV2 width multiplier.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Training batch size.")
_SAMPLES = flags.DEFINE_integer("samples", 256, "Training samples per epoch.")
_EPOCHS = flags.DEFINE_integer(
    "epochs", 3, "Measured epochs per variant (after one warm-up epoch)."
)
_VARIANTS = flags.DEFINE_list(
    "variants", list(VARIANTS), f"Variants to run, from {VARIANTS}."
)


def measure(variant, size, alpha, batch_size, samples, epochs):
    """Trains one variant; returns its peak memory and epoch times."""
    import keras
    import numpy as np

    import tfmemsafe

    keras.utils.set_random_seed(0)
    model = tfmemsafe.build_frozen_mobilenet_v2(
        (32, 32, 3), 10, weights=None, alpha=alpha, resize_to=size
    )
    if variant == "fine_tune":
        tfmemsafe.unfreeze(model)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss="sparse_categorical_crossentropy",
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, samples)

    class EpochStats(keras.callbacks.Callback):
        """Times every epoch; resets the memory peak after the first."""

        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                tfmemsafe.reset_peak_memory("CPU:0")
            self.start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(time.perf_counter() - self.start[0])
            self.cpu.append(time.process_time() - self.start[1])

    result = {}
    if variant == "cached":
        tfmemsafe.reset_peak_memory("CPU:0")
        start = time.perf_counter()
        features = tfmemsafe.cache_features(
            model, x, y, batch_size=batch_size, verbose=0
        )
        result["caching_seconds"] = time.perf_counter() - start
        result["caching_peak_mb"] = tfmemsafe.memory_info("CPU:0").peak_mb

    stats = EpochStats()
    if variant == "cached":
        tfmemsafe.fit_head(
            model,
            features,
            epochs=1 + epochs,
            batch_size=batch_size,
            callbacks=[stats],
            verbose=0,
        )
    else:
        model.fit(
            x,
            y,
            epochs=1 + epochs,
            batch_size=batch_size,
            callbacks=[stats],
            verbose=0,
        )
    result["peak_mb"] = tfmemsafe.memory_info("CPU:0").peak_mb
    result["epoch_seconds"] = statistics.median(stats.wall[1:])
    result["epoch_cpu_seconds"] = statistics.median(stats.cpu[1:])
    result["first_epoch_seconds"] = stats.wall[0]
    result["trainable_params"] = sum(
        int(np.prod(w.shape)) for w in model.trainable_weights
    )
    return result


def _ratio(value, base):
    return f"{value / base:.2f}x" if base else ""


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    unknown = sorted(set(_VARIANTS.value) - set(VARIANTS))
    if unknown:
        raise app.UsageError(
            f"--variants must be among {VARIANTS}. Received: {unknown}"
        )
    from tfmemsafe import testing

    env = {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "CUDA_VISIBLE_DEVICES": "",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    args = [
        _SIZE.value,
        _ALPHA.value,
        _BATCH_SIZE.value,
        _SAMPLES.value,
        _EPOCHS.value,
    ]
    results = {}
    for variant in _VARIANTS.value:
        try:
            results[variant] = testing.run_in_subprocess(
                measure, args=[variant, *args], env=env
            )
        except testing.SubprocessError as err:
            cause = err.__cause__ or err
            results[variant] = {"error": f"{type(cause).__name__}: {cause}"}

    print(
        f"MobileNetV2 alpha={_ALPHA.value}, 32x32 images resized to "
        f"{_SIZE.value} px, batch {_BATCH_SIZE.value}, {_SAMPLES.value} "
        f"samples/epoch, median of {_EPOCHS.value} epochs after a warm-up"
    )
    print(
        "| variant | trainable params | peak MB | vs frozen "
        "| wall s/epoch | vs frozen | CPU s/epoch | vs frozen |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = results.get("frozen", {})
    for variant, result in results.items():
        if "error" in result:
            message = result["error"].splitlines()[0][:120]
            print(f"| {variant} | failed: {message} | | | | | | |")
            continue
        row = [variant, f"{result['trainable_params']:,}"]
        for key, digits in [
            ("peak_mb", 0),
            ("epoch_seconds", 3),
            ("epoch_cpu_seconds", 3),
        ]:
            row.append(f"{result[key]:.{digits}f}")
            row.append(_ratio(result[key], base.get(key)))
        print("| " + " | ".join(row) + " |")
    cached = results.get("cached", {})
    if "caching_seconds" in cached:
        print(
            f"| cached: the one caching pass | | "
            f"{cached['caching_peak_mb']:.0f} | "
            f"{_ratio(cached['caching_peak_mb'], base.get('peak_mb'))} | "
            f"{cached['caching_seconds']:.3f} | "
            f"{_ratio(cached['caching_seconds'], base.get('epoch_seconds'))}"
            " | | |"
        )
    firsts = [
        f"{variant} {result['first_epoch_seconds']:.1f} s"
        for variant, result in results.items()
        if "first_epoch_seconds" in result
    ]
    print("First epoch, tracing included: " + ", ".join(firsts) + ".")
    if "epoch_seconds" in cached and "epoch_seconds" in base:
        print(
            "Plain frozen epoch / cached epoch: "
            f"{base['epoch_seconds'] / cached['epoch_seconds']:.0f}x (wall), "
            f"{base['epoch_cpu_seconds'] / cached['epoch_cpu_seconds']:.0f}x "
            "(CPU)."
        )


if __name__ == "__main__":
    app.run(main)
