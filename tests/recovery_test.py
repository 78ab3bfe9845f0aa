"""Tests for tfmemsafe.recovery: fit, evaluate, predict that survive OOM.

`RealOutOfMemoryTest` runs its scenarios in child processes whose CPU
allocator is capped (`tfmemsafe.testing.run_with_memory_cap`), so each
out-of-memory error is a genuine `ResourceExhaustedError`. Each costs about
ten seconds, the time TensorFlow's allocator waits for memory to be freed
before it gives up; the scenarios start together when the class is set up,
so those waits overlap. The other tests run in this process and raise
`ResourceExhaustedError` from a callback where they need an error at an
exact step.
"""

import concurrent.futures
import csv
import dataclasses
import os
import tempfile
import warnings

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing

_MB = 1024 * 1024
_CAP_MB = 300


def _conv_net():
    return testing.reference_model("conv_net", (32, 32, 3), metrics=None)


def _images(rows, size=32):
    """Images whose class is the signs of their mean red and green."""
    x = np.random.default_rng(0).normal(size=(rows, size, size, 3))
    x = x.astype("float32")
    means = x.mean(axis=(1, 2))
    y = (means[:, 0] > 0).astype("int32") + 2 * (means[:, 1] > 0)
    return x, y


def _aligned_rows(x, y):
    """`from_tensor_slices` rows that TensorFlow can hand out uncopied.

    Its iterator copies a row that does not start on a 64-byte boundary
    (a 4-byte label, say), with an allocation it does not check: when the
    CPU allocator is full, as when a step runs out beside it, that copy
    ends the process, under plain `model.fit` too (docs/oom-recovery.md).
    An image here is 12 KiB; each label is repeated to 16 int32 and the
    first taken again by a `map`, whose allocations are checked.
    """
    labels = np.repeat(y[:, None], 16, axis=1)
    rows = tf.data.Dataset.from_tensor_slices((x, labels))
    return rows.map(lambda image, label: (image, label[0]))


def _largest_difference(variables, others):
    return max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for a, b in zip(variables, others, strict=True)
    )


def _fit_epochs(model, x, y, batch_sizes, first_epoch=0):
    """Trains as a run that never failed: each epoch at its batch sizes.

    An entry is a batch size, or `(size, steps, new_size)` for an epoch
    that ran `steps` steps at `size` and the rest at `new_size`.
    """
    for epoch, batch_size in enumerate(batch_sizes, start=first_epoch):
        if isinstance(batch_size, tuple):
            size, steps, new_size = batch_size
            rows = tf.data.Dataset.from_tensor_slices((x, y))
            data = {
                "x": rows.take(size * steps)
                .batch(size)
                .concatenate(rows.skip(size * steps).batch(new_size))
            }
        else:
            data = {"x": x, "y": y, "batch_size": batch_size}
        model.fit(
            **data,
            epochs=epoch + 1,
            initial_epoch=epoch,
            shuffle=False,
            verbose=0,
        )


class _Ballast(keras.callbacks.Callback):
    """Takes device memory at one step, and keeps it.

    Like memory that something else in the process takes midway, it makes
    the following steps run out at a batch size that fitted before. It is
    taken in 1 MB pieces, as many small allocations would be, so that it
    fits between the blocks the allocator has already carved.
    """

    def __init__(self, megabytes, step, epoch=None):
        super().__init__()
        self.megabytes = megabytes
        self.at = (epoch, step)
        self.epoch = None
        self.pieces = []
        self.predicted_rows = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def _maybe_take(self, batch):
        if (self.epoch, batch) == self.at:
            while len(self.pieces) < self.megabytes:
                self.pieces.append(tf.zeros((_MB // 4,)))

    def on_train_batch_begin(self, batch, logs=None):
        self._maybe_take(batch)

    def on_predict_batch_begin(self, batch, logs=None):
        self._maybe_take(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self.predicted_rows.append(int(logs["outputs"].shape[0]))


class _Recorder(keras.callbacks.Callback):
    """Counts the hooks a run calls."""

    def __init__(self):
        super().__init__()
        self.train_begins = 0
        self.train_ends = 0
        self.epochs_begun = []
        self.epochs_ended = []

    def on_train_begin(self, logs=None):
        self.train_begins += 1

    def on_train_end(self, logs=None):
        self.train_ends += 1

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs_begun.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs_ended.append(epoch)


# Scenarios run in child processes under the memory cap. Each returns what
# the tests check, as JSON.


def conv_net_under_cap():
    """Batch 1024 does not fit; later, other memory use squeezes the
    micro-batches it runs as.

    The data is a pipeline without prefetching, so that the memory of each
    step does not depend on how far `tf.data` reads ahead.
    """
    x, y = _images(2048)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    result = {}
    try:
        _conv_net().fit(dataset.batch(1024), epochs=3, verbose=0)
    except tf.errors.ResourceExhaustedError as err:
        result["plain_fit_error"] = type(err).__name__
    model = _conv_net()
    recorder = _Recorder()
    with tempfile.TemporaryDirectory() as directory:
        csv_path = os.path.join(directory, "log.csv")
        checkpoint = os.path.join(directory, "epoch{epoch}.weights.h5")
        history = tfmemsafe.fit(
            model,
            dataset.batch,
            batch_size=1024,
            epochs=3,
            # No pre-flight check: planning_test tests it.
            memory_estimate=False,
            callbacks=[
                # Held from epoch 1, step 1 on: micro-batches that fit
                # before no longer do.
                _Ballast(120, epoch=1, step=1),
                recorder,
                keras.callbacks.CSVLogger(csv_path),
                keras.callbacks.ModelCheckpoint(
                    checkpoint, save_weights_only=True
                ),
            ],
            verbose=0,
        )
        with open(csv_path) as f:
            result["csv_epochs"] = [int(r["epoch"]) for r in csv.DictReader(f)]
        result["checkpoints"] = sorted(os.listdir(directory))
    result.update(
        events=[dataclasses.asdict(e) for e in history.oom_events],
        loss=history.history["loss"],
        epochs=history.epoch,
        batch_size=history.batch_size,
        finite=all(np.isfinite(w).all() for w in model.get_weights()),
        train_begins=recorder.train_begins,
        train_ends=recorder.train_ends,
        epochs_ended=recorder.epochs_ended,
    )
    return result


def accumulating_model_under_cap():
    """Batch 1024 x 2 accumulation steps does not fit; 512 x 4 does."""
    x, y = _images(2048)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    model = tfmemsafe.with_gradient_accumulation(_conv_net(), 2)
    history = tfmemsafe.fit(
        model,
        dataset.batch,
        batch_size=1024,
        epochs=2,
        preflight=False,
        verbose=0,
    )
    return {
        "events": [dataclasses.asdict(e) for e in history.oom_events],
        "accumulation_steps": model.accumulation_steps,
        "batch_size": history.batch_size,
        # One update per window of 2048 samples: one per epoch.
        "iterations": int(model.optimizer.iterations),
    }


def model_too_big_for_the_cap():
    """A model whose single sample needs more than the cap."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((512, 512, 3)),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2),
        ]
    )
    model.compile("sgd", "sparse_categorical_crossentropy")
    x = np.zeros((4, 512, 512, 3), "float32")
    y = np.zeros((4,), "int32")
    try:
        tfmemsafe.fit(model, (x, y), batch_size=2, preflight=False, verbose=0)
    except tfmemsafe.OutOfMemoryError as err:
        return {
            "message": str(err),
            "tried": list(err.tried_batch_sizes),
            "cause_is_oom": tfmemsafe.is_oom_error(err.__cause__),
        }
    return {"message": None}


def predict_and_evaluate_under_cap():
    """Prediction is squeezed midway; evaluation at 2048 does not fit."""
    x, y = _images(3000)
    model = _conv_net()
    ballast = _Ballast(80, step=1)
    predictions = tfmemsafe.predict(
        model, x, batch_size=1024, callbacks=[ballast], verbose=0
    )
    ballast.pieces = []
    reference = model.predict(x, batch_size=256, verbose=0)
    return {
        "rows": len(predictions),
        "predicted_rows": ballast.predicted_rows,
        "difference": float(np.max(np.abs(predictions - reference))),
        "evaluate": tfmemsafe.evaluate(
            model, (x, y), batch_size=2048, verbose=0
        ),
        "evaluate_reference": model.evaluate(x, y, batch_size=256, verbose=0),
    }


def find_max_batch_size_under_cap():
    x, y = _images(2048)
    model = _conv_net()
    model.fit(x[:256], y[:256], batch_size=128, verbose=0)  # Adam has state.
    state = model.variables + model.optimizer.variables
    before = [v.numpy().copy() for v in state]
    size = tfmemsafe.find_max_batch_size(model, (x, y), start=64)
    unchanged = all(
        np.array_equal(a, v.numpy()) for a, v in zip(before, state, strict=True)
    )
    # Trains at the size found, with and without validation.
    trained = []
    for validation in (None, (x[:512], y[:512])):
        history = tfmemsafe.fit(
            model,
            (x, y),
            batch_size=size,
            validation_data=validation,
            verbose=0,
        )
        trained.append(
            [history.batch_size, [e.phase for e in history.oom_events]]
        )
    try:
        model.fit(x, y, batch_size=8 * size, epochs=1, verbose=0)
        eight_times = "fits"
    except tf.errors.ResourceExhaustedError:
        eight_times = "out of memory"
    return {
        "size": size,
        "unchanged": unchanged,
        "trained": trained,
        "eight_times": eight_times,
    }


def mirrored_strategy_under_cap():
    """Two replicas: a global batch too large, split on each replica."""
    strategy = _models.mirrored_on_two_cpus()
    x, y = _images(2048)
    with strategy.scope():
        model = _conv_net()
    too_large = tfmemsafe.fit(
        model,
        (x, y),
        batch_size=2048,
        epochs=2,
        preflight=False,
        verbose=0,
    )
    variables = model.variables + model.optimizer.variables
    return {
        "too_large_events": [
            dataclasses.asdict(e) for e in too_large.oom_events
        ],
        "resumed_epochs": too_large.epoch,
        "replicas_agree": all(
            all(np.array_equal(r, v.value.values[0]) for r in v.value.values)
            for v in variables
        ),
    }


def _xla_conv_net():
    """The conv net, its training step compiled with XLA."""
    model = _conv_net()
    model.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    return model


def xla_model_under_cap():
    """A step compiled by XLA runs out on the CPU: no retry, a clear error.

    TensorFlow's CPU allocator is inconsistent after it, and this process
    aborts when it exits: the result is written before.
    """
    x, y = _images(2048)
    model = _xla_conv_net()
    batches = []
    counter = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: batches.append(batch)
    )
    try:
        tfmemsafe.fit(
            model,
            (x, y),
            batch_size=2048,
            preflight=False,
            callbacks=[counter],
            verbose=0,
        )
    except tfmemsafe.OutOfMemoryError as err:
        return {
            "error": str(err),
            "cause": type(err.__cause__).__name__,
            "attempts": len(batches),
        }
    return {"error": None}


def xla_batch_search_under_cap():
    """`find_max_batch_size` on an XLA model: the first error ends it."""
    x, y = _images(2048)
    model = _xla_conv_net()
    try:
        tfmemsafe.find_max_batch_size(
            model,
            (x, y),
            start=2048,
            max_batch_size=2048,
            memory_estimate=False,  # So that the first trial runs out.
        )
    except tfmemsafe.OutOfMemoryError as err:
        return {"error": str(err)}
    return {"error": None}


def fixed_shape_batch_search_under_cap():
    """`find_max_batch_size` on a transformer at a fixed length and batch
    shape, then plain `model.fit` at the size found.

    At such shapes Grappler rewrites attention's summed input gradient into
    a temporary variable; without `without_per_step_variables` the first
    trial, which runs out, left it behind, and the next trace at a fixed
    shape raised `AlreadyExistsError`: here plain `model.fit`'s, traced
    afresh as after `compile` (the trials' own later steps reuse Keras'
    trace for any batch size, which Grappler does not rewrite).
    """
    length = 512
    model = testing.reference_model("transformer", (length,))
    rng = np.random.default_rng(0)
    x = rng.integers(1, 2000, (256, length)).astype("int32")
    y = rng.integers(0, 4, 256).astype("int32")
    rows = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    try:
        with _models.absl_messages("INFO") as messages:
            size = tfmemsafe.find_max_batch_size(
                model,
                lambda batch_size: rows.batch(batch_size, drop_remainder=True),
                start=32,
                max_batch_size=32,
                # By trial from 32, which runs out of the 400 MB cap (its
                # estimate's first guess, 18, trains without an error).
                memory_estimate=False,
            )
    except (tf.errors.OpError, tfmemsafe.OutOfMemoryError) as err:
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    fixed = tf.data.Dataset.from_tensor_slices((x, y))
    model.train_function = None  # A fresh trace, at the fixed shape.
    history = model.fit(
        fixed.batch(size, drop_remainder=True), steps_per_epoch=2, verbose=0
    )
    return {
        "error": None,
        "size": size,
        "ran_out": [m for m in messages if "ran out of memory" in m],
        "loss": history.history["loss"][-1],
    }


class _StateAtEpochEnd(keras.callbacks.Callback):
    """Host copies of some variables at the end of the latest epoch."""

    def __init__(self, variables):
        super().__init__()
        self.variables = variables
        self.values = None

    def on_epoch_end(self, epoch, logs=None):
        self.values = [v.numpy() for v in self.variables]


# Leaving 120 MB, a batch of 512 of the conv net always runs out and
# micro-batches of up to 128 rows always fit (its step's memory at each
# size: docs/memory-estimate.md, "Repeatability").
_HELD_BATCH = 512
_LEAVE_MB = 120


def _fit_with_memory_held(
    model, data, optimizers, forever=False, leave_mb=_LEAVE_MB, **kwargs
):
    """Two epochs of `tfmemsafe.fit`, the allocator full but for
    `leave_mb` from epoch 1, step 1 until the next step (or for good):
    the failed step's micro-batches have that room; what the run left."""
    state = model.variables + [v for o in optimizers for v in o.variables]
    held = testing.HeldMemory(1, 1, forever=forever, leave_mb=leave_mb)
    counter = _StepCounter()
    at_epoch_end = _StateAtEpochEnd(state)
    result = {"error": None, "events": []}
    try:
        history = tfmemsafe.fit(
            model,
            data,
            epochs=2,
            callbacks=[held, counter, at_epoch_end],
            verbose=0,
            **kwargs,
        )
        result["events"] = [dataclasses.asdict(e) for e in history.oom_events]
        result["epochs"] = history.epoch
    except tfmemsafe.OutOfMemoryError as err:
        result["error"] = str(err)
    held.release()
    result.update(
        steps=counter.steps,
        iterations=[int(o.iterations.numpy()) for o in optimizers],
        finite=all(np.isfinite(v.numpy()).all() for v in state),
        difference_from_last_epoch_end=max(
            float(np.max(np.abs(v.numpy() - value)))
            for v, value in zip(state, at_epoch_end.values, strict=True)
        ),
    )
    return result


def _suffered(run) -> list:
    """A held-memory run's OOM events, not the pre-flight check's."""
    return [e for e in run["events"] if e["phase"] != "preflight"]


def _repeated_with_memory_held(**kwargs):
    """A dataset, repeated and batched by `fit`, memory held."""
    model = _conv_net()
    return _fit_with_memory_held(
        model,
        _aligned_rows(*_images(1024)).repeat(2),
        [model.optimizer],
        batch_size=_HELD_BATCH,
        **kwargs,
    )


def _two_optimizers_with_memory_held(**kwargs):
    """A model with two optimizers (as a GAN) on arrays, memory held."""
    x, y = _models.table(4096)
    # Its hidden activations at batch 1024 take 1 MiB, more than the
    # 1 MiB the hold leaves with the step's other tensors.
    model = _two_optimizers(hidden=(256,))
    optimizers = [model.first_optimizer, model.second_optimizer]
    return _fit_with_memory_held(
        model, (x, y), optimizers, batch_size=1024, leave_mb=1, **kwargs
    )


def datasets_with_memory_held_under_cap():
    """A repeated dataset and a dataset function, with memory held through
    the recovery, and no estimate made before the error (a pre-flight
    split would leave the held step room, or not, as the estimate reads).
    (With `steps_per_epoch`, `fit` recovers inside the step: on_oom_test.)

    Both crashed TensorFlow before tfmemsafe hardened the pipelines it
    gives Keras (`_pipelines.for_keras`): the rewrite of the pipeline
    when its iterator is made, and a prefetch after a batch that could
    not be allocated.
    """
    function = _conv_net()
    return {
        "repeated": _repeated_with_memory_held(preflight=False),
        "function": _fit_with_memory_held(
            function,
            _aligned_rows(*_images(1024)).batch,
            [function.optimizer],
            batch_size=_HELD_BATCH,
            preflight=False,
        ),
    }


def two_optimizers_with_memory_held_under_cap():
    """A model with two optimizers (as a GAN), with memory held through
    the recovery."""
    return _two_optimizers_with_memory_held()


def without_preflight_with_memory_held_under_cap():
    """A model with two optimizers, memory held, and no estimate made
    before the error."""
    return _two_optimizers_with_memory_held(preflight=False)


def mirrored_strategy_with_memory_held_under_cap():
    """Two replicas on a dataset, with memory held through the recovery."""
    strategy = _models.mirrored_on_two_cpus()
    x, y = _images(1024)
    with strategy.scope():
        model = _conv_net()
    # Two replicas share one allocator. A global batch of 512 can fit in
    # 100 MB where the scheduler runs them one after the other, as on a
    # loaded machine, and its step takes about 200 MiB side by side;
    # small micro-batches side by side need a little over 54 MiB (each
    # replica's convolution gradient takes 27 MiB whatever the rows).
    # 75 MB left runs out at 512 and fits small micro-batches. Whole
    # batches from the start: the pre-flight check's micro-batches can
    # fit beside the held memory, and the hold must make a batch run out.
    result = _fit_with_memory_held(
        model,
        _aligned_rows(x, y),
        [model.optimizer],
        leave_mb=75,
        batch_size=_HELD_BATCH,
        preflight=False,
    )
    variables = model.variables + model.optimizer.variables
    result["replicas_agree"] = all(
        all(np.array_equal(r, v.value.values[0]) for r in v.value.values)
        for v in variables
    )
    return result


_SCENARIOS = {
    conv_net_under_cap: _CAP_MB,
    xla_model_under_cap: _CAP_MB,
    xla_batch_search_under_cap: _CAP_MB,
    fixed_shape_batch_search_under_cap: 400,
    accumulating_model_under_cap: _CAP_MB,
    model_too_big_for_the_cap: _CAP_MB,
    predict_and_evaluate_under_cap: _CAP_MB,
    find_max_batch_size_under_cap: _CAP_MB,
    # Lower, so that a global batch of 1024 is well beyond what two
    # replicas can hold.
    mirrored_strategy_under_cap: 250,
    datasets_with_memory_held_under_cap: _CAP_MB,
    two_optimizers_with_memory_held_under_cap: _CAP_MB,
    without_preflight_with_memory_held_under_cap: _CAP_MB,
    mirrored_strategy_with_memory_held_under_cap: _CAP_MB,
}


class _TwoOptimizers(keras.Model):
    """Two networks, each updated by an optimizer held as an attribute.

    Like a GAN's generator and discriminator: compiled with
    `optimizer=None`, so `model.optimizer` knows of neither.
    """

    def __init__(self, seed=0, hidden=()):
        super().__init__()
        keras.utils.set_random_seed(seed)
        layers = [keras.layers.Dense(units, "relu") for units in hidden]
        self.first = keras.Sequential(
            [keras.Input((4,)), *layers, keras.layers.Dense(1)]
        )
        layers = [keras.layers.Dense(units, "relu") for units in hidden]
        self.second = keras.Sequential(
            [keras.Input((4,)), *layers, keras.layers.Dense(1)]
        )

    def call(self, x):
        return self.first(x) + self.second(x)

    def compile(self):
        super().compile(optimizer=None)
        self.first_optimizer = keras.optimizers.Adam(1e-2)
        self.second_optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**10
        )
        self.first_optimizer.build(self.first.trainable_variables)
        self.second_optimizer.build(self.second.trainable_variables)

    @property
    def state(self):
        return (
            self.variables
            + self.first_optimizer.variables
            + self.second_optimizer.variables
        )

    def train_step(self, data):
        x, y = data
        for network, optimizer in (
            (self.first, self.first_optimizer),
            (self.second, self.second_optimizer),
        ):
            variables = network.trainable_variables
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(y - network(x)))
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, variables), variables)
        return {"loss": loss}


def _two_optimizers(hidden=()):
    model = _TwoOptimizers(hidden=hidden)
    model.compile()
    return model


_KINDS = (
    ("arrays", "arrays"),
    ("unbatched_dataset", "unbatched_dataset"),
    ("batched_dataset", "batched_dataset"),
    ("callable", "callable"),
)


class FitTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(*_KINDS[1:])
    def test_dataset_kinds_do_not_warn_that_shuffle_is_ignored(self, kind):
        x, y = _models.table(64)
        data = _models.data_of_kind(kind, x, y)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tfmemsafe.fit(_models.dense_model(), data, batch_size=32, verbose=0)
            tfmemsafe.find_max_batch_size(
                _models.dense_model(), data, start=16, max_batch_size=32
            )
        messages = [str(w.message) for w in caught]
        self.assertEmpty([m for m in messages if "shuffle" in m], messages)

    def test_error_that_is_not_oom_propagates_unchanged_without_retry(self):
        x, _ = _models.table()
        bad_labels = np.zeros((len(x), 2), "int32")  # Sparse labels: (n,).

        def classifier():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            model.compile("adam", "sparse_categorical_crossentropy")
            return model

        with self.assertRaises(ValueError) as plain:
            classifier().fit(x, bad_labels, verbose=0)
        recorder = _Recorder()
        with self.assertRaises(ValueError) as caught:
            tfmemsafe.fit(
                classifier(), (x, bad_labels), callbacks=[recorder], verbose=0
            )
        # Keras' own error, raised from tfmemsafe's compiled step (the
        # trace in its message names that step's frames).
        self.assertIn(
            str(plain.exception).strip().splitlines()[-1].strip(),
            str(caught.exception),
        )
        self.assertEqual(recorder.train_begins, 1)
        self.assertEqual(recorder.epochs_begun, [0])

    def test_keyboard_interrupt_propagates_without_retry(self):
        x, y = _models.table()
        recorder = _Recorder()
        with self.assertRaises(KeyboardInterrupt):
            tfmemsafe.fit(
                _models.dense_model(),
                (x, y),
                epochs=3,
                callbacks=[
                    recorder,
                    keras.callbacks.LambdaCallback(
                        on_epoch_end=_interrupt_at_epoch_1
                    ),
                ],
                verbose=0,
            )
        self.assertEqual(recorder.epochs_begun, [0, 1])

    def test_auto_batch_size_uses_the_largest_that_was_tried(self):
        # Without allocator statistics (no BFC cap here) only the data
        # bounds the search: 64 rows.
        x, y = _models.table(64)
        history = tfmemsafe.fit(
            _models.dense_model(), (x, y), batch_size="auto", verbose=0
        )
        self.assertEqual(history.batch_size, 64)

    @parameterized.named_parameters(
        ("batched_dataset", "batched_dataset", 0.0, False, 60),
        ("arrays_less_validation", "arrays", 0.5, False, 30),
        # Keras splits nothing off when `validation_data` is given.
        ("arrays_and_validation_data", "arrays", 0.5, True, 60),
    )
    def test_batch_size_is_at_most_the_samples_trained_on(
        self, kind, validation_split, validation_data, samples
    ):
        x, y = _models.table(60)
        data = _models.data_of_kind(kind, x, y)
        validation = (x[:8], y[:8]) if validation_data else None
        for batch_size in ("auto", 512):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                history = tfmemsafe.fit(
                    _models.dense_model(),
                    data,
                    batch_size=batch_size,
                    validation_split=validation_split,
                    validation_data=validation,
                    verbose=0,
                )
            self.assertLessEqual(history.batch_size, samples)
            self.assertEqual(
                history.params["steps"], -(-samples // history.batch_size)
            )
            messages = [str(w.message) for w in caught]
            self.assertEmpty([m for m in messages if "ran out" in m], messages)
        self.assertEqual(history.batch_size, samples)  # Of 512.


def _interrupt_at_epoch_1(epoch, logs):
    if epoch == 1:
        raise KeyboardInterrupt


def _interrupt_at_epoch_2(epoch, logs):
    if epoch == 2:
        raise KeyboardInterrupt


class _StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_end(self, epoch, logs=None):
        self.steps.append(self._last + 1)

    def on_train_batch_end(self, batch, logs=None):
        self._last = batch


class FindMaxBatchSizeTest(tf.test.TestCase):
    def test_leaves_weights_and_loss_scale_optimizer_as_found(self):
        x, y = _models.table(512)
        model = _models.dense_model(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        )
        model.fit(x, y, batch_size=64, verbose=0)
        state = model.variables + model.optimizer.variables
        before = [v.numpy().copy() for v in state]
        size = tfmemsafe.find_max_batch_size(
            model, (x, y), start=32, max_batch_size=64
        )
        self.assertEqual(size, 64)  # No statistics here: only the bound.
        for expected, variable in zip(before, state, strict=True):
            self.assertAllEqual(expected, variable.numpy(), msg=variable.path)

    def test_leaves_optimizers_held_as_attributes_as_found(self):
        x, y = _models.table(512)
        model = _two_optimizers()
        model.fit(x, y, batch_size=64, verbose=0)
        before = [v.numpy().copy() for v in model.state]
        tfmemsafe.find_max_batch_size(
            model, (x, y), start=32, max_batch_size=64
        )
        for expected, variable in zip(before, model.state, strict=True):
            self.assertAllEqual(expected, variable.numpy(), msg=variable.path)

    def test_trials_reuse_the_traced_step(self):
        traces = []

        class Counting(keras.Model):
            def train_step(self, data):
                traces.append(1)  # Runs once per trace.
                return super().train_step(data)

        inputs = keras.Input((4,))
        model = Counting(inputs, keras.layers.Dense(2)(inputs))
        model.compile("sgd", "mse")
        x, y = _models.table(512)
        # No statistics or estimate: trials at 32, 64, ..., 512.
        tfmemsafe.find_max_batch_size(
            model, (x, y), max_batch_size=512, memory_estimate=False
        )
        self.assertLess(len(traces), 5)

    def test_builds_the_optimizer_so_a_fresh_one_stays_fresh(self):
        x, y = _models.table(64)
        model = _models.dense_model()
        self.assertFalse(model.optimizer.built)
        tfmemsafe.find_max_batch_size(model, (x, y), max_batch_size=32)
        self.assertEqual(int(model.optimizer.iterations), 0)
        for variable in model.optimizer.variables[2:]:  # Moments.
            self.assertAllEqual(variable.numpy(), np.zeros(variable.shape))


# Arrays large against everything else in the process, and a model that
# is small against them: what `fit` adds shows in the peak RSS.
_HOST_ROWS, _HOST_FEATURES = 65536, 1024  # 256 MiB of float32.


def peak_rss_of_fit_on_arrays(wrapper: bool, shuffle: bool) -> dict:
    """Peak RSS of two epochs on large arrays, plain or through tfmemsafe."""
    import resource

    x = np.random.default_rng(0).random((_HOST_ROWS, _HOST_FEATURES), "f4")
    y = (x[:, 0] > 0.5).astype("f4")
    model = keras.Sequential(
        [keras.Input((_HOST_FEATURES,)), keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fit = tfmemsafe.fit if wrapper else model.fit
    arguments = dict(batch_size=4096, epochs=2, shuffle=shuffle, verbose=0)
    if wrapper:
        fit(model, (x, y), preflight=False, **arguments)
    else:
        fit(x, y, **arguments)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"before": before * 1024, "peak": after * 1024}


# A model whose state (a frozen 8192 x 8192 layer, 256 MiB) is large
# against everything else in the process, and whose trainable part is
# small: a host copy of the state would show, and nothing else that
# grows with the trainable part can hide it (docs/oom-recovery.md).
_FROZEN_UNITS = 8192


def peak_rss_of_fit_of_a_large_model(wrapper: bool) -> dict:
    """Peak RSS over the start of two epochs of a model with 256 MiB of
    state, plain or through tfmemsafe."""
    import resource

    x = np.random.default_rng(0).random((256, _FROZEN_UNITS), "f4")
    y = (x[:, 0] > 0.5).astype("i4")
    frozen = keras.layers.Dense(_FROZEN_UNITS, trainable=False)
    model = keras.Sequential(
        [keras.Input((_FROZEN_UNITS,)), frozen, keras.layers.Dense(2)]
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    state = sum(
        np.prod(v.shape) * np.dtype(v.dtype).itemsize
        for v in [*model.variables, *model.optimizer.variables]
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    arguments = dict(batch_size=128, epochs=2, verbose=0)
    if wrapper:
        tfmemsafe.fit(model, (x, y), preflight=False, **arguments)
    else:
        model.fit(x, y, **arguments)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"before": before * 1024, "peak": after * 1024, "state": state}


class ArgumentTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("string", "images/"),
        ("object", object()),
    )
    def test_unknown_data_kind_raises_type_error(self, data):
        with self.assertRaisesRegex(TypeError, r"^`x` must be arrays"):
            tfmemsafe.fit(_models.dense_model(), data)

    def test_a_list_with_an_output_left_out_trains(self):
        inputs = keras.Input((2,))
        # The second output has no loss: nothing to train in it either.
        outputs = [
            keras.layers.Dense(1)(inputs),
            keras.layers.Dense(1, trainable=False)(inputs),
        ]
        model = keras.Model(inputs, outputs)
        model.compile("sgd", ["mse", None])
        x, y = np.ones((8, 2), "float32"), np.zeros((8, 1), "float32")
        history = tfmemsafe.fit(model, x, [y, None], verbose=0, preflight=False)
        self.assertLen(history.history["loss"], 1)

    def test_targets_beside_a_dataset_are_refused_naming_y(self):
        x, y = _models.table(8)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        model = _models.dense_model()
        for run in (tfmemsafe.fit, tfmemsafe.evaluate):
            with (
                self.subTest(run=run.__name__),
                self.assertRaisesRegex(
                    ValueError,
                    r"^`y` must not be passed when `x` is a tf.data",
                ),
            ):
                run(model, data, y, verbose=0)

    def test_lists_of_numbers_are_refused_naming_their_argument(self):
        x, y = _models.table(8)
        model = _models.dense_model()
        for name, data in (("x", (x.tolist(), y)), ("y", (x, y.tolist()))):
            with self.assertRaisesRegex(
                TypeError, rf"^`{name}` must be arrays.*of type list$"
            ):
                tfmemsafe.fit(model, *data, verbose=0)

    @parameterized.named_parameters(
        ("min_batch_size", {"min_batch_size": 0}, "min_batch_size"),
        ("max_retries", {"max_retries": -1}, "max_retries"),
        ("batch_size", {"batch_size": 0}, "batch_size"),
        ("epochs", {"epochs": 0}, "epochs"),
    )
    def test_out_of_range_argument_raises_value_error(self, kwargs, name):
        x, y = _models.table(8)
        with self.assertRaisesRegex(
            ValueError, rf"^`{name}` must be an integer"
        ):
            tfmemsafe.fit(_models.dense_model(), (x, y), **kwargs)

    def test_numpy_batch_size_is_taken(self):
        x, y = _models.table(8)
        history = tfmemsafe.fit(
            _models.dense_model(), x, y, batch_size=np.int64(4), verbose=0
        )
        self.assertEqual(history.batch_size, 4)

    def test_missing_x_raises_value_error(self):
        with self.assertRaisesRegex(
            ValueError, r"^`x` is required.*Received: x=None"
        ):
            tfmemsafe.fit(_models.dense_model())

    def test_callable_must_return_a_dataset(self):
        with self.assertRaisesRegex(TypeError, r"^`x` must return a tf"):
            tfmemsafe.fit(_models.dense_model(), lambda b: [1, 2], batch_size=2)

    def test_uncompiled_model_is_rejected(self):
        x, y = _models.table(8)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        with self.assertRaisesRegex(ValueError, r"^`model` must be compiled"):
            tfmemsafe.fit(model, (x, y))

    def test_headroom_must_be_a_fraction(self):
        x, y = _models.table(8)
        with self.assertRaisesRegex(ValueError, r"^`headroom` must be"):
            tfmemsafe.find_max_batch_size(
                _models.dense_model(), (x, y), headroom=1
            )


class RealOutOfMemoryTest(tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # The scenarios run side by side, each in its own process: most of
        # their time is the allocator's ten-second waits, which need no CPU.
        cls._pool = concurrent.futures.ThreadPoolExecutor(len(_SCENARIOS))
        cls._results = {
            scenario: cls._pool.submit(
                testing.run_with_memory_cap, scenario, cap_mb
            )
            for scenario, cap_mb in _SCENARIOS.items()
        }

    @classmethod
    def tearDownClass(cls):
        cls._pool.shutdown(wait=True)
        super().tearDownClass()

    def result(self, scenario):
        return self._results[scenario].result()

    def test_xla_on_the_cpu_is_not_retried_and_says_why(self):
        result = self.result(xla_model_under_cap)
        self.assertIsNotNone(result["error"], msg=result)
        self.assertStartsWith(
            result["error"], "Out of memory in a step compiled with XLA"
        )
        self.assertIn("jit_compile=False", result["error"])
        self.assertEqual(result["cause"], "ResourceExhaustedError")
        self.assertEqual(result["attempts"], 1)  # The first step, once.

    def test_xla_on_the_cpu_ends_the_batch_search_untouched(self):
        # Putting the model back after the failed trial would end the
        # process; the child returning at all shows it was not.
        result = self.result(xla_batch_search_under_cap)
        self.assertIsNotNone(result["error"], msg=result)
        self.assertStartsWith(
            result["error"], "Out of memory in a step compiled with XLA"
        )

    def test_a_failed_trial_leaves_nothing_that_breaks_the_next(self):
        result = self.result(fixed_shape_batch_search_under_cap)
        self.assertIsNone(result["error"], msg=result)
        self.assertNotEmpty(result["ran_out"], msg=result)
        self.assertBetween(result["size"], 1, 31)
        self.assertTrue(np.isfinite(result["loss"]), msg=result)

    def test_fit_finishes_every_epoch_where_plain_fit_runs_out(self):
        result = self.result(conv_net_under_cap)
        self.assertEqual(result["plain_fit_error"], "ResourceExhaustedError")
        self.assertLen(result["loss"], 3)
        self.assertEqual(result["epochs"], [0, 1, 2])
        self.assertLess(result["loss"][-1], result["loss"][0])
        self.assertTrue(result["finite"])
        self.assertNotEmpty(result["events"])
        for event in result["events"]:
            # The batch is kept: it ran as micro-batches of one update.
            self.assertEqual(event["batch_size_before"], 1024)
            self.assertEqual(event["batch_size_after"], 1024)
            self.assertGreaterEqual(event["split_into"], 2)
        self.assertEqual(result["batch_size"], 1024)

    def test_callbacks_see_one_run_across_retries(self):
        result = self.result(conv_net_under_cap)
        self.assertEqual(result["train_begins"], 1)
        self.assertEqual(result["train_ends"], 1)
        self.assertEqual(result["epochs_ended"], [0, 1, 2])
        # CSVLogger(append=False) would empty its file on a second
        # on_train_begin.
        self.assertEqual(result["csv_epochs"], [0, 1, 2])
        self.assertEqual(
            result["checkpoints"],
            [
                "epoch1.weights.h5",
                "epoch2.weights.h5",
                "epoch3.weights.h5",
                "log.csv",
            ],
        )

    def test_accumulating_model_keeps_its_effective_batch(self):
        result = self.result(accumulating_model_under_cap)
        self.assertNotEmpty(result["events"])
        for event in result["events"]:
            self.assertEqual(event["batch_size_after"], 1024)
            self.assertEqual(event["accumulation_steps"], 2)
        # Each split batch counted once in its window of 2.
        self.assertEqual(result["accumulation_steps"], 2)
        self.assertEqual(result["batch_size"], 1024)
        self.assertEqual(result["iterations"], 2)

    def test_model_that_never_fits_raises_out_of_memory_error(self):
        result = self.result(model_too_big_for_the_cap)
        self.assertRegex(
            result["message"],
            r"^A batch of 2 ran out of memory even as micro-batches of one "
            r"example\. Instead, try mixed precision",
        )
        self.assertTrue(result["cause_is_oom"])

    def test_evaluate_splits_the_batch_that_ran_out(self):
        result = self.result(predict_and_evaluate_under_cap)
        self.assertAllClose(
            result["evaluate"], result["evaluate_reference"], rtol=1e-5
        )

    def test_predict_returns_every_row_in_order_after_a_split(self):
        result = self.result(predict_and_evaluate_under_cap)
        self.assertEqual(result["rows"], 3000)
        # Batch 0 ran at 1024 and was kept; batch 1 ran out; the rest ran
        # smaller. Batches that failed are not counted here, so the sum
        # shows that no row was predicted twice or skipped.
        rows = result["predicted_rows"]
        self.assertEqual(sum(rows), 3000)
        self.assertLess(result["difference"], 1e-5)

    def test_found_size_trains_with_and_without_validation(self):
        result = self.result(find_max_batch_size_under_cap)
        self.assertGreaterEqual(result["size"], 64)
        size = result["size"]
        # It trains, at worst after one recovery in training and one in
        # validation (each phase has its own micro-batches), or split from
        # the pre-flight check's prediction. The one trial that confirms a
        # size reads its peak with the noise of a real step, so a size at
        # the edge can be confirmed and then run out in `fit`; it is never
        # cut before it ran (a size that trained is measured).
        for batch_size, phases in result["trained"]:
            self.assertEqual(len(phases), len(set(phases)), msg=phases)
            self.assertContainsSubset(
                phases, {"preflight", "training", "validation"}
            )
            self.assertEqual(batch_size, size)
        # Not far below the limit either: eight times the size found (at
        # most the 2,048 rows) runs out. The size moves with the estimate
        # and the trials' peaks, further on a loaded machine, where four
        # times it has been seen to fit.
        self.assertEqual(result["eight_times"], "out of memory", msg=result)

    def test_find_max_batch_size_leaves_weights_and_optimizer_as_found(self):
        result = self.result(find_max_batch_size_under_cap)
        self.assertTrue(result["unchanged"])

    def test_global_batch_splits_under_a_mirrored_strategy(self):
        result = self.result(mirrored_strategy_under_cap)
        # 2048 runs out, and runs again as micro-batches.
        events = result["too_large_events"]
        self.assertNotEmpty(events)
        for event in events:
            self.assertEqual(event["batch_size_after"], 2048)
            self.assertGreaterEqual(event["split_into"], 2)

    def test_mirrored_variables_are_restored_on_every_replica(self):
        result = self.result(mirrored_strategy_under_cap)
        self.assertEqual(result["resumed_epochs"], [0, 1])
        self.assertTrue(result["replicas_agree"])

    def assertRecoveredConsistently(self, run, own_train_step=False):
        """One recovery, every epoch, no update lost or made twice (a
        model's own `train_step` updates once per micro-batch)."""
        self.assertIsNone(run["error"], msg=run)
        self.assertEqual(run["epochs"], [0, 1])
        # The pre-flight check may split the batch first; the hold's OOM
        # comes whatever the size.
        events = _suffered(run)
        self.assertNotEmpty(events, msg=run)
        self.assertRegex(events[0]["error"], "OOM|allocate")
        self.assertTrue(run["finite"])
        for iterations in run["iterations"]:
            if own_train_step:
                self.assertGreater(iterations, sum(run["steps"]), msg=run)
            else:
                self.assertEqual(iterations, sum(run["steps"]), msg=run)

    def test_datasets_recover_with_memory_held_by_something_else(self):
        result = self.result(datasets_with_memory_held_under_cap)
        for name, run in result.items():
            with self.subTest(name):
                self.assertRecoveredConsistently(run)
                self.assertEqual(_suffered(run)[0]["epoch"], 1)

    def test_two_optimizers_recover_with_memory_held(self):
        # A train_step of its own runs once per micro-batch, each call
        # updating: more updates than steps, every one finite.
        result = self.result(two_optimizers_with_memory_held_under_cap)
        self.assertRecoveredConsistently(result, own_train_step=True)

    def test_recovers_with_memory_held_and_no_estimate_made_before(self):
        result = self.result(without_preflight_with_memory_held_under_cap)
        self.assertRecoveredConsistently(result, own_train_step=True)

    def test_mirrored_strategy_recovers_with_memory_held(self):
        result = self.result(mirrored_strategy_with_memory_held_under_cap)
        self.assertRecoveredConsistently(result)
        self.assertTrue(result["replicas_agree"])


if __name__ == "__main__":
    tf.test.main()
