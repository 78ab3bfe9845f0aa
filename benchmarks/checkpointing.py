"""Gradient checkpointing: peak memory and time per epoch, side by side.

Trains a stack of residual conv blocks (default: 12 blocks on 64x64x16
inputs, batch 64) on random data with `fit`, once per variant, each in a
fresh process whose CPU allocator is TensorFlow's BFC allocator, so that
the peak it reports is exact:

- `none`: no checkpointing.
- `per_block`: every block wrapped in `tfmemsafe.Checkpointed`.
- `segments`: `tfmemsafe.checkpoint_blocks(blocks)`, about sqrt(n)
  segments, all but the last recomputed.
- `segments_all`: the same with `checkpoint_last=True`: every segment is
  recomputed.
- `remat_scope`: the model built inside `keras.RematScope(mode="full")`,
  Keras' own rematerialization.

The first epoch (tracing) is not measured; the peak is the allocator's
high-water mark over the measured epochs, the time the median epoch.

Example:
    python benchmarks/checkpointing.py --blocks=12 --epochs=3
"""

import re
import statistics
import time

from absl import app
from absl import flags

VARIANTS = ("none", "per_block", "segments", "segments_all", "remat_scope")

_BLOCKS = flags.DEFINE_integer("blocks", 12, "Residual blocks in the stack.")
_SIZE = flags.DEFINE_integer("size", 64, "Input height and width.")
_CHANNELS = flags.DEFINE_integer("channels", 16, "Channels in every block.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Training batch size.")
_STEPS = flags.DEFINE_integer("steps", 4, "Training steps per epoch.")
_EPOCHS = flags.DEFINE_integer(
    "epochs", 3, "Measured epochs per variant (after one warm-up epoch)."
)
_JIT_COMPILE = flags.DEFINE_boolean(
    "jit_compile", False, "Compile the train step with XLA."
)
_INTER_OP_THREADS = flags.DEFINE_integer(
    "inter_op_threads",
    1,
    "TensorFlow inter-op threads (0: TensorFlow's default). With 1, ops "
    "run one at a time and the peak is the same on every run; with more, "
    "it depends on thread timing.",
)
_VARIANTS = flags.DEFINE_list(
    "variants", list(VARIANTS), f"Variants to run, from {VARIANTS}."
)


def residual_block(channels, name):
    """Conv-BN-ReLU-Conv-BN plus the input, then ReLU, as a sub-model."""
    import keras

    inputs = keras.Input((None, None, channels))
    x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(channels, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(keras.layers.Add()([inputs, x]))
    return keras.Model(inputs, x, name=name)


def build_model(variant, blocks, size, channels):
    """The residual stack, checkpointed as `variant` says."""
    import keras

    import tfmemsafe

    def build():
        stack = [residual_block(channels, f"block_{i}") for i in range(blocks)]
        if variant == "per_block":
            stack = [tfmemsafe.Checkpointed(block) for block in stack]
        elif variant == "segments":
            stack = tfmemsafe.checkpoint_blocks(stack)
        elif variant == "segments_all":
            stack = tfmemsafe.checkpoint_blocks(stack, checkpoint_last=True)
        inputs = keras.Input((size, size, channels))
        x = inputs
        for layer in stack:
            x = layer(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10)(x)
        return keras.Model(inputs, outputs)

    if variant == "remat_scope":
        with keras.RematScope(mode="full"):
            return build()
    return build()


def measure(
    variant, blocks, size, channels, batch_size, steps, epochs, jit, threads
):
    """Trains one variant; returns its peak memory and epoch times."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmemsafe

    tf.config.threading.set_inter_op_parallelism_threads(threads)

    keras.utils.set_random_seed(0)
    model = build_model(variant, blocks, size, channels)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch_size * steps, size, size, channels))
    x = x.astype("float32")
    y = rng.integers(0, 10, size=(batch_size * steps,))
    model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)

    wall, cpu = [], []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            wall.append(time.perf_counter() - self.start[0])
            cpu.append(time.process_time() - self.start[1])

    tfmemsafe.reset_peak_memory("CPU:0")
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        callbacks=[EpochTimer()],
    )
    return {
        "peak_mb": tfmemsafe.memory_info("CPU:0").peak_mb,
        "epoch_seconds": statistics.median(wall),
        "epoch_cpu_seconds": statistics.median(cpu),
    }


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
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    args = [
        _BLOCKS.value,
        _SIZE.value,
        _CHANNELS.value,
        _BATCH_SIZE.value,
        _STEPS.value,
        _EPOCHS.value,
        _JIT_COMPILE.value,
        _INTER_OP_THREADS.value,
    ]
    results = {}
    for variant in _VARIANTS.value:
        try:
            results[variant] = testing.run_in_subprocess(
                measure, args=[variant, *args], env=env
            )
        except testing.SubprocessError as err:
            results[variant] = {"error": _error_line(err.__cause__ or err)}
    print(
        f"{_BLOCKS.value} residual blocks, {_SIZE.value}x{_SIZE.value}x"
        f"{_CHANNELS.value}, batch {_BATCH_SIZE.value}, {_STEPS.value} "
        f"steps/epoch, jit_compile={_JIT_COMPILE.value}, inter-op threads "
        f"{_INTER_OP_THREADS.value or 'default'}"
    )
    print(
        "| variant | peak MB | vs none | CPU s/epoch | vs none "
        "| wall s/epoch | vs none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = results.get("none", {})
    for variant, result in results.items():
        if "error" in result:
            print(f"| {variant} | failed: {result['error']} | | | | | |")
            continue
        row = [variant]
        for key, digits in [
            ("peak_mb", 0),
            ("epoch_cpu_seconds", 1),
            ("epoch_seconds", 1),
        ]:
            row.append(f"{result[key]:.{digits}f}")
            row.append(f"{result[key] / base[key] - 1:+.0%}" if base else "")
        print("| " + " | ".join(row) + " |")


def _error_line(error):
    """The error's type and the line of its message that says what failed."""
    lines = [
        re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        for line in str(error).splitlines()
    ]
    lines = [
        line
        for line in lines
        if line and not line.startswith("Exception encountered")
    ]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:160]


if __name__ == "__main__":
    app.run(main)
