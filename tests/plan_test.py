"""Tests for `tfmemsafe.plan`, `MemoryPlan` and `tfmemsafe.fit(plan=...)`.

The models are small residual networks of nested blocks (functional
models inside a functional model, which `keras.RematScope(mode="full")`
cannot train); a memory limit passed to `plan` stands in for a small
device, and `RealCapTest` plans under a capped allocator in a child.
"""

import dataclasses
import functools
import os
from unittest import mock

# The CPU allocator keeps statistics only with BFC (or oneDNN) on; it must
# be chosen before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import parameterized  # noqa: E402

import tfmemsafe  # noqa: E402
from tfmemsafe import testing  # noqa: E402
from tfmemsafe.planning import Candidate  # noqa: E402
from tfmemsafe.planning import _candidates  # noqa: E402
from tfmemsafe.planning import _measure  # noqa: E402
from tfmemsafe.planning import _workers  # noqa: E402

_ROWS = 1024
_BATCH = 512


def _residual(width=64, blocks=4, seed=0, model_class=keras.Model, layers=()):
    """Dense blocks (nested functional models) with residual adds, after
    `layers`."""
    keras.utils.set_random_seed(seed)

    def block():
        inputs = keras.Input((width,))
        hidden = keras.layers.Dense(4 * width, activation="relu")(inputs)
        hidden = keras.layers.Dense(width)(hidden)
        return keras.Model(inputs, keras.layers.Add()([inputs, hidden]))

    inputs = x = keras.Input((16,))
    for layer in layers:
        x = layer(x)
    x = keras.layers.Dense(width)(x)
    for _ in range(blocks):
        x = block()(x)
    model = model_class(inputs, keras.layers.Dense(3)(x))
    # SGD: Adam would turn the rounding of near-zero gradients into
    # differences of its learning rate between equal updates.
    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(rows=_ROWS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0)


def _state(model):
    return [v.numpy() for v in model.variables + model.optimizer.variables]


class PlanTest(parameterized.TestCase, tf.test.TestCase):
    def test_the_model_is_left_as_found(self):
        model = _residual()
        x, y = _data()
        model.fit(x, y, batch_size=256, verbose=0)
        before = _state(model)
        plan = tfmemsafe.plan(model, x, y, batch_size=_BATCH, verbose=0)
        self.assertAllClose(_state(model), before, rtol=0, atol=0)
        self.assertIsNotNone(plan.chosen.step_seconds)

    def test_a_batch_larger_than_the_data_is_planned_as_keras_trains_it(self):
        # `model.fit` trains one batch of the 100 rows.
        x, y = _data(100)
        plan = tfmemsafe.plan(
            _residual(), x, y, batch_size=_BATCH, checkpointing=False, verbose=0
        )
        self.assertEqual(plan.batch_size, 100)
        self.assertEqual(plan.candidates[0].micro_batches, 1)

    def test_a_batch_predicted_not_to_fit_whole_is_planned_smaller(self):
        model = _residual()
        x, y = _data(4096)
        estimate = tfmemsafe.estimate_memory(model, (x, y))
        # Midway between the whole batch's step and a quarter's, beside
        # what this process holds (the plan counts it; the estimate's
        # readings do not), so that the whole batch does not fit and a
        # split of it does.
        step = (estimate.peak_bytes(2048) + estimate.peak_bytes(512)) / 2
        held = tfmemsafe.memory_info("CPU:0").current_bytes
        limit = int((step + held) / 0.9)
        plan = tfmemsafe.plan(
            model, x, y, batch_size=2048, memory_limit=limit, verbose=0
        )
        whole = plan.candidates[0]
        self.assertEqual((whole.micro_batches, whole.checkpointing), (1, False))
        self.assertFalse(whole.fits, msg=str(plan))
        self.assertEqual(whole.note, "predicted not to fit")
        self.assertIsNone(whole.step_seconds)
        self.assertIsNot(plan.chosen, whole)
        self.assertTrue(plan.chosen.fits, msg=str(plan))
        self.assertIsNotNone(plan.chosen.step_seconds, msg=str(plan))
        self.assertEqual(plan.limit_bytes, limit)
        # The checkpointed model, at fewer micro-batches than the model
        # as it is trained at only.
        fewest = min(
            c.micro_batches
            for c in plan.candidates
            if c.step_seconds is not None and not c.checkpointing
        )
        recomputed = [c for c in plan.candidates if c.checkpointing]
        self.assertNotEmpty(recomputed, msg=str(plan))
        for candidate in recomputed:
            self.assertLess(candidate.micro_batches, fewest, msg=str(plan))
        self.assertIn(
            f"checkpointing at {fewest} micro-batches or more",
            "\n".join(plan.not_tried),
        )

    @parameterized.named_parameters(
        ("exact_only", False), ("split_batch_norm", True)
    )
    def test_micro_batches_of_a_batch_norm_model_only_when_asked(
        self, split_batch_norm
    ):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(64),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        x, y = _data()
        plan = tfmemsafe.plan(
            model,
            x,
            y,
            batch_size=_BATCH,
            checkpointing=False,
            split_batch_norm=split_batch_norm,
            verbose=0,
        )
        counts = {candidate.micro_batches for candidate in plan.candidates}
        said = [n for n in plan.not_tried if n.startswith("micro-batches:")]
        if split_batch_norm:
            self.assertGreater(max(counts), 1, msg=str(plan))
            self.assertEmpty(said)
        else:
            self.assertEqual(counts, {1}, msg=str(plan))
            self.assertRegex(said[0], "normalizes each batch")
        self.assertEqual(plan.callback().split_batch_norm, split_batch_norm)

    @parameterized.named_parameters(
        ("micro_batches", False), ("checkpointing", True)
    )
    def test_fit_with_a_plan_trains_as_keras_trains_the_whole_batch(
        self, checkpointing
    ):
        x, y = _data()
        reference = _residual()
        reference.fit(x, y, batch_size=_BATCH, epochs=2, verbose=0)
        model = _residual()
        plan = tfmemsafe.plan(
            model,
            x,
            y,
            batch_size=_BATCH,
            checkpointing=checkpointing,
            verbose=0,
        )
        chosen = Candidate(4, _BATCH // 4, checkpointing)
        plan.chosen = chosen  # As if the measurements chose it.
        history = tfmemsafe.fit(
            model, x, y, batch_size=_BATCH, epochs=2, verbose=0, plan=plan
        )
        self.assertAllClose(
            [v.numpy() for v in model.trainable_variables],
            [v.numpy() for v in reference.trainable_variables],
            rtol=1e-4,
            atol=1e-5,
        )
        self.assertEqual(int(model.optimizer.iterations), 4)
        self.assertLen(history.history["loss"], 2)

    def test_the_checkpointed_model_shares_every_variable(self):
        model = _residual()
        x, y = _data()
        plan = tfmemsafe.plan(
            model, x, y, batch_size=_BATCH, checkpointing=True, verbose=0
        )
        plan.chosen = Candidate(1, _BATCH, True)
        planned = plan.apply(model)
        self.assertIsNot(planned, model)
        wrapped = [
            layer
            for layer in planned.layers
            if isinstance(layer, tfmemsafe.Checkpointed)
        ]
        self.assertLen(wrapped, 4)
        self.assertEqual(
            [layer.recompute for layer in wrapped], [True, True, True, False]
        )
        ids = {id(v) for v in model.variables}
        self.assertTrue(all(id(v) in ids for v in planned.variables))
        self.assertIs(planned.optimizer, model.optimizer)
        before = model.trainable_variables[0].numpy()
        planned.fit(x, y, batch_size=_BATCH, verbose=0)
        self.assertNotAllClose(model.trainable_variables[0].numpy(), before)

    def test_a_sequential_model_is_checkpointed_in_segments(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((16,))]
            + [keras.layers.Dense(32, activation="relu") for _ in range(9)]
            + [keras.layers.Dense(3)]
        )
        model.compile("adam", "mse")
        x, _ = _data()
        plan = tfmemsafe.plan(
            model,
            x,
            np.zeros((_ROWS, 3)),
            batch_size=_BATCH,
            checkpointing=True,
            verbose=0,
        )
        self.assertEqual(
            {c.checkpointing for c in plan.candidates}, {False, True}
        )
        # The whole batch of each model trained; more micro-batches were
        # not measured.
        self.assertEqual(
            [c.step_seconds is not None for c in plan.candidates],
            [True, False, True, False],
            msg=str(plan),
        )

    def test_the_table_shows_every_candidate_and_what_was_not_tried(self):
        model = _residual()
        x, y = _data()
        plan = tfmemsafe.plan(model, x, y, batch_size=_BATCH, verbose=0)
        text = str(plan)
        self.assertStartsWith(text, f"MemoryPlan: batch {_BATCH} on CPU:0")
        for candidate in plan.candidates:
            self.assertIn(candidate.name, text)
        self.assertIn(f"* chosen: {plan.chosen.name}", text)
        self.assertIn("not tried: other precisions", text)
        # The whole batch trained: recomputing could only add work.
        self.assertEqual(plan.chosen.name, f"1 x {_BATCH}")
        self.assertFalse(any(c.checkpointing for c in plan.candidates))
        self.assertIn(
            "not tried: checkpointing: the whole batch trained without it",
            text,
        )


class ChoiceTest(tf.test.TestCase):
    def test_the_simplest_within_five_percent_of_the_fastest_is_chosen(self):
        whole = Candidate(1, 512, False, step_seconds=0.104)
        split = Candidate(2, 256, False, step_seconds=0.100)
        recomputed = Candidate(1, 512, True, step_seconds=0.090)
        self.assertIs(_candidates.chosen([whole, split]), whole)
        self.assertIs(
            _candidates.chosen([whole, split, recomputed]),
            recomputed,
        )
        # The same measurements, in another order: the same choice.
        self.assertIs(_candidates.chosen([split, whole]), whole)

    def test_a_candidate_that_ran_out_is_not_chosen(self):
        ran_out = Candidate(1, 512, False, note="ran out of memory")
        trained = Candidate(2, 256, False, step_seconds=1.0)
        self.assertFalse(ran_out.trained)
        self.assertTrue(trained.trained)
        self.assertIs(
            _candidates.chosen([ran_out, trained]),
            trained,
        )


class BadInputTest(tf.test.TestCase):
    def test_arguments_are_checked(self):
        model = _residual()
        x, y = _data()
        with self.assertRaisesRegex(ValueError, "`steps` must be"):
            tfmemsafe.plan(model, x, y, steps=0)
        with self.assertRaisesRegex(ValueError, "`checkpointing` must be"):
            tfmemsafe.plan(model, x, y, checkpointing="yes")
        with self.assertRaisesRegex(ValueError, "`memory_limit` must be"):
            tfmemsafe.plan(model, x, y, memory_limit=0, verbose=0)
        with self.assertRaisesRegex(ValueError, "`x` must be data"):
            tfmemsafe.plan(model, (batch for batch in [(x, y)]))
        with self.assertRaisesRegex(ValueError, "^`y` must not be passed"):
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
            tfmemsafe.plan(model, data, y)
        with self.assertRaisesRegex(ValueError, "must be compiled"):
            tfmemsafe.plan(keras.Sequential([keras.layers.Dense(1)]), x, y)

    def test_checkpointing_a_subclassed_model_is_refused_when_asked_for(self):
        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(3)

            def call(self, inputs):
                return self.dense(inputs)

        model = Subclassed()
        model.compile("adam", "mse")
        x, _ = _data()
        y = np.zeros((_ROWS, 3))
        with self.assertRaisesRegex(ValueError, "a model of its own class"):
            tfmemsafe.plan(model, x, y, checkpointing=True, verbose=0)
        plan = tfmemsafe.plan(model, x, y, batch_size=_BATCH, verbose=0)
        self.assertIn("checkpointing: a model of its own class", str(plan))

    def test_models_it_cannot_rebuild_are_planned_without_recomputing(self):
        x, _ = _data()
        tokens = (np.abs(x[:, :8]) * 10).astype("int32")
        keras.utils.set_random_seed(0)
        masked = keras.Sequential(
            [
                keras.Input((8,), dtype="int32"),
                keras.layers.Embedding(50, 8, mask_zero=True),
                keras.layers.GRU(8),
                keras.layers.Dense(3),
            ]
        )
        masked.compile("adam", "mse")

        class Unregistered(keras.metrics.MeanMetricWrapper):
            def __init__(self, name="unregistered", dtype=None):
                super().__init__(
                    keras.losses.mean_squared_error, name=name, dtype=dtype
                )

        unregistered = _residual()
        unregistered.compile("adam", "mse", metrics=[Unregistered()])
        for model, data, why in (
            (masked, tokens, "carry masks"),
            (unregistered, x, "cannot be made again from their config"),
        ):
            with self.subTest(why):
                y = np.zeros((_ROWS, 3))
                plan = tfmemsafe.plan(
                    model, data, y, batch_size=_BATCH, verbose=0
                )
                self.assertIn(why, "\n".join(plan.not_tried))
                self.assertFalse(any(c.checkpointing for c in plan.candidates))
                with self.assertRaisesRegex(ValueError, why):
                    tfmemsafe.plan(
                        model, data, y, checkpointing=True, verbose=0
                    )

    def test_a_model_not_built_yet_is_planned(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.layers.Dense(16, activation="relu") for _ in range(4)]
            + [keras.layers.Dense(3)]
        )
        model.compile("adam", "mse", steps_per_execution=2)
        x, _ = _data()
        plan = tfmemsafe.plan(
            model, x, np.zeros((_ROWS, 3)), batch_size=128, verbose=0
        )
        self.assertTrue(model.built)
        self.assertIsNotNone(plan.chosen.step_seconds, msg=str(plan))

    def test_a_plan_that_recomputes_refuses_a_model_compiled_again(self):
        model = _residual()
        x, y = _data()
        plan = tfmemsafe.plan(
            model, x, y, batch_size=_BATCH, checkpointing=True, verbose=0
        )
        plan.chosen = Candidate(1, _BATCH, True)
        model.compile("adam", "mse")
        with self.assertRaisesRegex(ValueError, "compiled again"):
            plan.apply(model)

    def test_a_plan_is_followed_only_for_its_model_and_batch(self):
        model = _residual()
        x, y = _data()
        plan = tfmemsafe.plan(model, x, y, batch_size=_BATCH, verbose=0)
        with self.assertRaisesRegex(ValueError, "`model` must be the model"):
            plan.apply(_residual())
        with self.assertRaisesRegex(ValueError, "made for batches of 512"):
            tfmemsafe.fit(model, x, y, batch_size=256, plan=plan)
        with self.assertRaisesRegex(TypeError, "`plan` must be None"):
            tfmemsafe.fit(model, x, y, batch_size=_BATCH, plan="fast")
        with self.assertRaisesRegex(ValueError, "pass an integer"):
            tfmemsafe.fit(model, x, y, batch_size="auto", plan="auto")


def planned_under_mirrored_strategy():
    """A plan on two logical CPUs, checkpointed, and a fit that follows it."""
    import _models

    strategy = _models.mirrored_on_two_cpus()
    with strategy.scope():
        model = _residual()
    x, y = _data()
    plan = tfmemsafe.plan(
        model, x, y, batch_size=_BATCH, checkpointing=True, verbose=0
    )
    plan.chosen = Candidate(2, _BATCH // 2, True)
    planned = plan.apply(model)
    history = tfmemsafe.fit(
        model, x, y, batch_size=_BATCH, verbose=0, plan=plan
    )
    return {
        "strategy": type(planned.distribute_strategy).__name__,
        "measured": [c.step_seconds is not None for c in plan.candidates],
        "epochs": len(history.history["loss"]),
        "iterations": int(model.optimizer.iterations.numpy()),
    }


class MirroredStrategyTest(tf.test.TestCase):
    def test_the_checkpointed_model_trains_under_the_models_strategy(self):
        result = testing.run_in_subprocess(planned_under_mirrored_strategy)
        self.assertEqual(result["strategy"], "MirroredStrategy")
        # Each model's whole batch; more micro-batches not measured.
        self.assertEqual(
            result["measured"], [True, False, True, False], msg=result
        )
        self.assertEqual(result["epochs"], 1)
        self.assertEqual(result["iterations"], _ROWS // _BATCH)


def planned_on_a_worker(batch):
    """A plan and a fit that follows it on one worker of a two-worker job
    (an `AccumulatingModel`: Keras 3 cannot fit a plain model under the
    strategy). On worker 1, more than half of its share runs out."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = _data(2 * batch)
    worker = tfmemsafe.distribute.worker_index(strategy)
    with strategy.scope():
        model = _residual(
            model_class=functools.partial(
                tfmemsafe.AccumulatingModel, accumulation_steps=1
            ),
            layers=[testing.OutOfMemoryAbove(batch // 4 if worker else None)],
        )
    plan = tfmemsafe.plan(model, x, y, batch_size=batch, verbose=0)
    made = {
        "plan": [
            (c.name, c.fits, c.predicted_peak_bytes, c.step_seconds)
            for c in plan.candidates
        ],
        "chosen": plan.chosen.name,
        "micro_batch_size": plan.micro_batch_size,
        "text": str(plan),
    }
    history = tfmemsafe.fit(model, x, y, batch_size=batch, plan=plan, verbose=0)
    return {
        **made,
        "split_into": [e.split_into for e in history.oom_events],
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
    }


class MultiWorkerTest(tf.test.TestCase):
    def test_every_worker_follows_one_plan_that_trained_on_all(self):
        first, second = testing.run_workers(
            planned_on_a_worker, 2, args=[_BATCH], timeout=600
        )
        text = f"{first['text']}\n{second['text']}"
        # The same candidates, figures and choice on both workers (each
        # measured its own share: the tables' limits are each its own).
        self.assertEqual(first["plan"], second["plan"], msg=text)
        self.assertEqual(
            first["text"].split("\n")[1:], second["text"].split("\n")[1:]
        )
        self.assertIn("checkpointing: not considered", first["text"])
        # The whole batch trained on worker 0 and ran out on worker 1: the
        # job's choice is two micro-batches of the global batch, 128 rows
        # of each worker's 256.
        whole, halves = first["plan"][:2]
        self.assertIsNone(whole[3], msg=text)
        self.assertIn(
            "did not train within the limit on every worker", first["text"]
        )
        self.assertEqual(first["chosen"], f"2 x {_BATCH // 2}", msg=text)
        self.assertEqual(first["micro_batch_size"], _BATCH // 2)
        self.assertIn(f"batch {_BATCH} ({_BATCH // 2} on each", first["text"])
        # Followed from the first step: nothing ran out, one update a
        # batch, the same weights on both workers.
        self.assertEqual(first["split_into"], [])
        self.assertEqual(second["split_into"], [])
        self.assertEqual(first["iterations"], 2)
        for a, b in zip(first["weights"], second["weights"], strict=True):
            self.assertAllClose(a, b)


def _exchanging_with(other_rows):
    """`_agreement.exchanged` beside another worker whose rows, one per
    exchange, are `other_rows`."""
    rows = iter(other_rows)

    def exchanged(strategy, work, width, caller):
        mine = np.asarray(work(), np.float64)
        other = np.asarray(next(rows), np.float64)
        assert mine.shape == other.shape == (width,)
        return np.stack([mine, other])

    return exchanged


class AgreementTest(tf.test.TestCase):
    """The rules by which workers agree, against a second worker's rows."""

    def _candidates(self):
        return [
            Candidate(1, 256, False, 100, "estimate", True),
            Candidate(2, 128, False, 60, "static bound", True),
            Candidate(4, 64, False, 40, "static bound", True),
            Candidate(8, 32, False, 30, "static bound", True),
        ]

    def test_a_split_fits_the_job_where_it_fits_every_worker(self):
        # The other worker: the whole share does not fit it, and predicts
        # higher; all its predictions are static bounds.
        other = [[120, 0, 1], [70, 1, 1], [45, 1, 1], [35, 1, 1]]
        with mock.patch.object(
            tfmemsafe._agreement,
            "exchanged",
            _exchanging_with([sum(other, [])]),
        ):
            agreed = _workers.agreed_predictions(
                None, self._candidates, splits=4
            )
        self.assertEqual(
            [(c.micro_batches, c.fits, c.predicted_peak_bytes) for c in agreed],
            [(1, False, 120), (2, True, 70), (4, True, 45)],
        )
        self.assertEqual(
            [c.predicted_by for c in agreed],
            ["estimate", "static bound", "static bound"],
        )

    def test_without_a_prediction_anywhere_the_whole_share_is_measured(self):
        with mock.patch.object(
            tfmemsafe._agreement,
            "exchanged",
            _exchanging_with([[np.nan] * 12]),
        ):
            agreed = _workers.agreed_predictions(
                None, self._candidates, splits=4
            )
        self.assertLen(agreed, 1)
        self.assertEqual((agreed[0].micro_batches, agreed[0].fits), (1, None))
        self.assertIn("another worker", agreed[0].predicted_by)

    def test_the_slowest_worker_times_and_what_ran_out_anywhere_is_out(self):
        candidates = [
            Candidate(1, 256, False, 100, "estimate", False),
            Candidate(2, 128, False, 60, "estimate", True),
            Candidate(4, 64, False, 40, "estimate", True),
        ]
        measured = {
            2: dataclasses.replace(
                candidates[1], step_seconds=0.5, measured_peak_bytes=50
            ),
            4: dataclasses.replace(
                candidates[2], step_seconds=0.6, measured_peak_bytes=35
            ),
        }
        # The other worker, one exchange per candidate measured: 2 x 128
        # ran out; 4 x 64 slower there.
        other = [[np.nan, np.nan], [0.7, 38]]
        with mock.patch.object(
            tfmemsafe._agreement, "exchanged", _exchanging_with(other)
        ):
            agreed = _workers.agreed_measurements(
                None,
                lambda c: measured[c.micro_batches],
                candidates,
            )
        self.assertEqual(agreed[0].note, "predicted not to fit")
        self.assertIsNone(agreed[1].step_seconds)
        self.assertEqual(
            agreed[1].note, "did not train within the limit on every worker"
        )
        self.assertEqual(
            (agreed[2].step_seconds, agreed[2].measured_peak_bytes), (0.7, 38)
        )
        self.assertEqual(_candidates.chosen(agreed), agreed[2])

    def test_more_micro_batches_are_measured_only_where_fewer_did_not(self):
        candidates = [
            Candidate(1, 256, False, 100, "estimate", False),
            Candidate(2, 128, False, 60, "estimate", True),
            Candidate(4, 64, False, 40, "estimate", True),
        ]
        # One exchange only (a second would find no row): 2 x 128 trained
        # on both workers.
        with mock.patch.object(
            tfmemsafe._agreement,
            "exchanged",
            _exchanging_with([[0.5, 50]]),
        ):
            agreed = _workers.agreed_measurements(
                None,
                lambda c: dataclasses.replace(
                    c, step_seconds=0.4, measured_peak_bytes=45
                ),
                candidates,
            )
        self.assertEqual(agreed[1].step_seconds, 0.5)
        self.assertIsNone(agreed[2].step_seconds)
        self.assertEqual(agreed[2].note, _measure.NOT_MEASURED)


class MeasuredTest(tf.test.TestCase):
    def test_candidates_are_measured_in_order_until_one_trains(self):
        candidates = [
            Candidate(1, 512, False, 100, "estimate", False),
            Candidate(2, 256, False, 60, "estimate", True),
            Candidate(4, 128, False, 40, "estimate", True),
            Candidate(8, 64, False, 30, "estimate", True),
        ]
        results = {
            2: dataclasses.replace(candidates[1], note="ran out of memory"),
            4: dataclasses.replace(candidates[2], step_seconds=0.3),
        }
        tried = []

        def measure_one(candidate):
            tried.append(candidate.micro_batches)
            return results[candidate.micro_batches]

        done = _measure.measured(candidates, measure_one)
        self.assertEqual(tried, [2, 4])
        self.assertEqual(
            [c.note for c in done],
            [
                "predicted not to fit",
                "ran out of memory",
                "",
                _measure.NOT_MEASURED,
            ],
        )


# Under this cap the residual net's batch of 4096 runs out whole.
_CAP_MB = 150


def planned_fit_under_cap():
    """`fit(plan="auto")` of a batch that does not fit whole."""
    model = _residual(width=128, blocks=6)
    x, y = _data(2 * 4096)
    with testing.AllocatorFailures() as failures:
        history = tfmemsafe.fit(
            model, x, y, batch_size=4096, epochs=2, verbose=0, plan="auto"
        )
    return {
        "oom_events": len(history.oom_events),
        "failures": failures.count,
        "iterations": int(model.optimizer.iterations),
        "finite": all(np.isfinite(v.numpy()).all() for v in model.variables),
    }


class RealCapTest(tf.test.TestCase):
    def test_a_batch_too_large_whole_trains_as_planned(self):
        result = testing.run_with_memory_cap(planned_fit_under_cap, _CAP_MB)
        self.assertEqual(result["iterations"], 4, msg=result)
        self.assertTrue(result["finite"], msg=result)


if __name__ == "__main__":
    tf.test.main()
