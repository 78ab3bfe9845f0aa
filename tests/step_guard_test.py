"""Tests for what the step guard orders (`_step_guard.py`).

The barrier and its marker are tested through `fit` in recovery_test and
resume_test; here, that the updates it releases run one after another,
read from the traced step's graph, and what that does to the step's peak.
"""

import itertools

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import _step_guard

_ASSIGNMENTS = (
    "AssignVariableOp",
    "AssignAddVariableOp",
    "AssignSubVariableOp",
)


def _model(units=8):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(2),
        ]
    )


def _step_graph(model, optimizer):
    """The graph of one training step that ends in `optimizer.apply`."""
    x, y = tf.ones((3, 4)), tf.constant([0, 1, 0])
    loss_function = keras.losses.SparseCategoricalCrossentropy(True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_function(y, model(x, training=True))
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)

    return step.get_concrete_function(x, y).graph


def _after(op, earlier) -> bool:
    """Whether `op` waits for `earlier`, through data or control edges."""
    seen, waiting = set(), [op]
    while waiting:
        current = waiting.pop()
        if current is earlier:
            return True
        if current.name in seen:
            continue
        seen.add(current.name)
        waiting.extend(t.op for t in current.inputs)
        waiting.extend(current.control_inputs)
    return False


def _update_assignments(graph) -> list:
    """Every assignment op of the step, in the order traced: with the
    guard, the flag the barrier sets comes first; the optimizer's
    `iterations` increment is always last."""
    return [op for op in graph.get_operations() if op.type in _ASSIGNMENTS]


class OrderTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("adam", lambda: keras.optimizers.Adam(), 3),
        ("sgd_momentum", lambda: keras.optimizers.SGD(momentum=0.9), 2),
        ("rmsprop", lambda: keras.optimizers.RMSprop(), 2),
    )
    def test_each_update_waits_for_the_one_before(self, make, per_variable):
        model, optimizer = _model(), make()
        optimizer.build(model.trainable_variables)
        guard = _step_guard.StepGuard(model, [optimizer], [])
        try:
            assignments = _update_assignments(_step_graph(model, optimizer))
        finally:
            guard.close()
        updates = assignments[1:-1]
        self.assertLen(updates, per_variable * len(model.trainable_variables))
        for earlier, later in itertools.pairwise(updates):
            self.assertTrue(_after(later, earlier), msg=(earlier, later))

    def test_without_the_guard_updates_of_two_variables_are_not_ordered(self):
        # The check above can fail: Keras leaves the updates unordered.
        model, optimizer = _model(), keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        updates = _update_assignments(_step_graph(model, optimizer))[:-1]
        first_variable, second_variable = updates[:3], updates[3:6]
        self.assertFalse(_after(second_variable[0], first_variable[-1]))

    def test_closing_removes_the_order(self):
        model, optimizer = _model(), keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)
        _step_guard.StepGuard(model, [optimizer], []).close()
        self.assertNotIn("update_step", vars(optimizer))
        self.assertNotIn("assign_add", vars(optimizer))
        updates = _update_assignments(_step_graph(model, optimizer))[:-1]
        self.assertFalse(_after(updates[3], updates[2]))

    def test_a_step_traced_before_the_guard_gets_the_barrier(self):
        # Keras keeps the step an earlier `model.fit` traced; run without
        # the barrier, it would never set the marker.
        model = _model()
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        x, y = np.ones((8, 4), "float32"), np.zeros((8,), "int32")
        model.fit(x, y, batch_size=4, verbose=0)
        guard = _step_guard.StepGuard(model, [model.optimizer], [])
        try:
            guard.save_small_state()
            self.assertFalse(guard.touched())
            model.fit(x, y, batch_size=4, verbose=0)
            self.assertTrue(guard.touched())
        finally:
            guard.close()
        self.assertIsNone(model.train_function)

    def test_ordered_updates_train_as_model_fit_does(self):
        x = np.random.default_rng(0).random((64, 4), "float32")
        y = (x[:, 0] > 0.5).astype("int32")
        weights = []
        for guarded in (False, True):
            model = _model(16)
            model.compile(
                "adam", keras.losses.SparseCategoricalCrossentropy(True)
            )
            model.optimizer.build(model.trainable_variables)
            guard = (
                _step_guard.StepGuard(model, [model.optimizer], [])
                if guarded
                else None
            )
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            if guard:
                guard.close()
            weights.append(model.get_weights())
        for plain, ordered in zip(*weights, strict=True):
            self.assertAllClose(plain, ordered, rtol=1e-6, atol=1e-7)

    def test_loss_scale_optimizer_orders_its_inner_updates(self):
        model = _model()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
        optimizer.build(model.trainable_variables)
        guard = _step_guard.StepGuard(model, [optimizer], [])
        try:
            self.assertIn("update_step", vars(optimizer.inner_optimizer))
            # Its updates are traced in a branch of the finite-gradients
            # condition, a graph of their own: tracing them must not mix
            # the two graphs' ops.
            _step_graph(model, optimizer)
        finally:
            guard.close()
        self.assertNotIn("update_step", vars(optimizer.inner_optimizer))


_WIDTH, _BATCH = 2048, 128


def step_peaks_of_an_mlp(guarded: bool) -> list:
    """The allocator's peak of each step of an MLP with Adam, MiB."""
    model = keras.Sequential(
        [
            keras.Input((512,)),
            keras.layers.Dense(_WIDTH, activation="relu"),
            keras.layers.Dense(_WIDTH, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    if guarded:
        _step_guard.StepGuard(model, [model.optimizer], [])
    rng = np.random.default_rng(0)
    x = rng.random((_BATCH * 8, 512), dtype="float32")
    y = rng.integers(0, 10, _BATCH * 8)
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats("CPU:0")

        def on_train_batch_end(self, batch, logs=None):
            info = tf.config.experimental.get_memory_info("CPU:0")
            peaks.append(info["peak"] / 2**20)

    model.fit(
        x,
        y,
        batch_size=_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[Peaks()],
    )
    return peaks


class PeakTest(tf.test.TestCase):
    def test_ordered_updates_peak_no_higher_than_model_fit(self):
        # Released together by the barrier, Adam's updates peaked one
        # more copy of the largest variable above `model.fit`'s steps at
        # some steps; in order, no step comes near that. A CPU step's peak
        # moves by about a MiB from run to run with the inter-op
        # scheduler, so the bound is half that copy, not the median.
        largest_mib = _WIDTH**2 * 4 / 2**20
        plain, ordered = _models.side_by_side(
            step_peaks_of_an_mlp, [[False], [True]]
        )
        self.assertLess(
            max(ordered),
            np.median(plain) + largest_mib / 2,
            msg=(plain, ordered),
        )


class SmallStateTest(tf.test.TestCase):
    def test_metrics_made_after_the_guard_are_put_back(self):
        # Keras makes the compiled metrics' variables at the first step,
        # after `fit` installed the guard.
        model = _model()
        model.compile("sgd", "mse", metrics=["mae"])
        guard = _step_guard.StepGuard(model, [model.optimizer], [])
        try:
            x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            before = [v.numpy() for v in model.metrics_variables]
            self.assertLen(before, 4)  # The loss's and the MAE's.
            guard.save_small_state()
            model.train_on_batch(x, y)
            guard.restore_small_state()
            for got, want in zip(model.metrics_variables, before, strict=True):
                self.assertAllEqual(got.numpy(), want)
        finally:
            guard.close()


def tensorflow_warnings_of_short_runs() -> list:
    """What TensorFlow's logger says while six fresh `AccumulatingModel`s
    train a few steps each, in micro-batches, as in a loop of folds: each
    run has a guard of its own, whose marker is traced inside the step,
    a split of its own, and an epoch that ends with a partial window."""
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    tf.get_logger().addHandler(handler)
    x, y = np.ones((48, 4), "float32"), np.ones((48, 2), "float32")
    for _ in range(6):
        model = tfmemsafe.with_gradient_accumulation(_model(), 2)
        model.compile("sgd", "mse", metrics=["mae"])
        model.fit(
            x,
            y,
            batch_size=16,
            verbose=0,
            callbacks=[tfmemsafe.SplitBatchOnOOM(micro_batch_size=8)],
        )
    return [m for m in said if "AutoGraph" in m or "retracing" in m]


class TensorFlowWarningsTest(tf.test.TestCase):
    def test_the_guard_gives_tensorflow_nothing_to_warn_of(self):
        said = tfmemsafe.testing.run_in_subprocess(
            tensorflow_warnings_of_short_runs
        )
        self.assertEqual(said, [])


if __name__ == "__main__":
    tf.test.main()
