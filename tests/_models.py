"""Models, data and runs that several test files build the same way.

Imported as `import _models`: pytest puts this directory on `sys.path`, and
the child processes that `tfmemsafe.testing` starts inherit it, so the
scenarios they run can use these too. Networks and data that benchmarks
share as well live in `tfmemsafe.testing`.
"""

import concurrent.futures
import contextlib
from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl import logging

import tfmemsafe
from tfmemsafe import testing

# For capped children whose test depends on a step's peak: independent ops
# run one at a time, as a GPU's one stream does, so that the peak does not
# depend on which ops ran side by side (docs/memory-estimate.md,
# "Repeatability").
ONE_STREAM = {"TF_NUM_INTEROP_THREADS": "1"}


def dense_model(optimizer=None, seed=0, accumulation_steps=None):
    """A 4 -> 8 (ReLU) -> 1 regression MLP, compiled with MSE.

    With `accumulation_steps`, wrapped by `with_gradient_accumulation`
    before it is compiled. The optimizer defaults to `Adam(1e-2)`.
    """
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    if accumulation_steps is not None:
        model = tfmemsafe.with_gradient_accumulation(model, accumulation_steps)
    model.compile(optimizer or keras.optimizers.Adam(1e-2), "mse")
    return model


def length_estimate(**kwargs):
    """A `MemoryEstimate` with lengths built by hand, so no probe runs:
    1000 MB, 100 MB fixed; a sample 64 KiB and 1 KiB a token at
    length 64 (`kwargs` change any of it)."""
    mib = 1024 * 1024
    defaults = dict(
        device="CPU:0",
        limit_bytes=1000 * mib,
        fixed_bytes=100 * mib,
        per_sample_bytes=128 * 1024,
        measurements=((8, 101 * mib), (32, 104 * mib)),
        length=64,
        length_coefficients=(64 * 1024.0, 1024.0, 0.0),
    )
    return tfmemsafe.MemoryEstimate(**{**defaults, **kwargs})


def table(rows=256, ids=False):
    """Normal features (seed 1) of 4 columns, and their sum as the target.

    With `ids`, the inputs are `(x, ids)`, each row's index beside it.
    """
    x = np.random.default_rng(1).normal(size=(rows, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    if ids:
        return (x, np.arange(rows, dtype="int32")), y
    return x, y


def data_of_kind(kind, inputs, y):
    """The same rows as one of the data kinds `tfmemsafe.fit` accepts."""
    dataset = tf.data.Dataset.from_tensor_slices((inputs, y))
    return {
        "arrays": (inputs, y),
        "unbatched_dataset": dataset,
        "batched_dataset": dataset.batch(32),
        "callable": lambda batch_size: dataset.batch(batch_size),
    }[kind]


def worker_conv_net():
    """A 32x32 conv net for 10 classes, as an `AccumulatingModel`.

    Build it in the strategy's scope. Seeded with 1; one convolution of 32
    channels, global pooling, compiled with Adam.
    """
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32, 32, 3))
    hidden = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    model = tfmemsafe.AccumulatingModel(inputs, keras.layers.Dense(10)(hidden))
    model.compile(
        "adam",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def worker_images():
    """The 128 images and labels `worker_conv_net` trains on."""
    return testing.random_images(128)


_HOG = []  # What the memory hog holds on to, for the life of the worker.
_HOG_PIECE_BYTES = 64 * 2**10


class MemoryHog(keras.callbacks.Callback):
    """Fills worker 1's memory when epoch 1 begins, all but 64 KiB.

    It takes `megabytes` in one tensor, then 64 KiB pieces until one
    fails, and lets the last piece go. So the step's first large
    allocation fails, while TensorFlow's own small allocations still find
    room: a step that took the allocator's last bytes (a tensor given the
    whole free block it was cut from, when that block is less than twice
    its size) left none, and a failed 8-byte allocation that TensorFlow
    does not check ended worker 1 (SIGSEGV) before it could report its
    OOM, and worker 0 stopped on its missing heartbeats instead
    (`UnavailableError`): 2 of 44 runs of distribute_test's OOM test
    under load. The piece that fails waits about 10 s for memory first.

    The memory is kept for the life of the process. `begun` lists the
    epochs begun, on every worker.
    """

    def __init__(self, megabytes, worker_index):
        super().__init__()
        self.megabytes = megabytes
        self.worker_index = worker_index
        self.begun = []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)
        if self.megabytes and self.worker_index == 1 and epoch == 1:
            # The pieces' shape and value made first: converting them from
            # Python with the allocator full would end the process.
            piece_shape = tf.constant([_HOG_PIECE_BYTES // 4])
            one = tf.constant(1.0)
            _HOG.append(tf.ones((self.megabytes * 2**18,), tf.float32))
            pieces = []
            try:
                while True:  # A Fill op, whose allocation is checked.
                    pieces.append(tf.fill(piece_shape, one))
            except tf.errors.ResourceExhaustedError:
                pass  # Full.
            _HOG.extend(pieces[:-1])


def fit_running_out(model, *points, callbacks=(), **kwargs):
    """`tfmemsafe.fit` on `table()` at batch 32, running out at `points`
    (`testing.SimulatedOutOfMemory`'s `(phase, epoch, step)`)."""
    return tfmemsafe.fit(
        model,
        table(),
        batch_size=32,
        callbacks=[testing.SimulatedOutOfMemory(*points), *callbacks],
        verbose=0,
        **kwargs,
    )


def machine_memory(num_bytes):
    """Patches the machine's memory where `memory` and `runtime` read it."""
    from tfmemsafe import memory
    from tfmemsafe.memory import _info

    stack = contextlib.ExitStack()
    for module in (memory, _info):
        stack.enter_context(
            mock.patch.object(
                module, "machine_memory_bytes", return_value=num_bytes
            )
        )
    return stack


def two_cpu_devices():
    """Splits the CPU into two logical devices, CPU:0 and CPU:1.

    Only in a child process, before TensorFlow initialises its devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )


def mirrored_on_two_cpus():
    """A `MirroredStrategy` over two logical CPU devices (a child only)."""
    two_cpu_devices()
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])


def side_by_side(target, arguments, cap_mb=None) -> list:
    """`target(*args)` for each `args` in `arguments`, each in a fresh
    process (under a `cap_mb` allocator cap, if given), all at once; their
    results in order. For comparisons whose children mostly wait."""

    def run(args):
        if cap_mb is None:
            return testing.run_in_subprocess(target, args=args)
        return testing.run_with_memory_cap(target, cap_mb, args=args)

    with concurrent.futures.ThreadPoolExecutor(len(arguments)) as pool:
        return list(pool.map(run, arguments))


@contextlib.contextmanager
def absl_messages(level="WARNING"):
    """The absl messages at `level` (a level name) or above logged
    inside, as a list.

    For children, where `TestCase.assertLogs` is not at hand. absl logs
    only at its verbosity or above, so inside, the verbosity is at least
    `level` (INFO ones are logged), and it is put back after.
    """
    messages = []

    class Handler(logging.logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Handler(level=level)
    verbosity = logging.get_verbosity()
    logging.set_verbosity(max(verbosity, logging.converter.ABSL_NAMES[level]))
    logging.get_absl_logger().addHandler(handler)
    try:
        yield messages
    finally:
        logging.get_absl_logger().removeHandler(handler)
        logging.set_verbosity(verbosity)


# The layer that runs out inside the step above some rows.
RunsOutAbove = testing.OutOfMemoryAbove
