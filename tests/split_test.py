"""Tests for splitting a batch that ran out (`recovery/_split.py`) on
examples of varying length.

`tfmemsafe.fit(batch_size="auto")` on examples in memory buckets planned
from a hand-built estimate (no probe), with a model whose first layer runs
out of memory on batches of more rows than it allows: the buckets' large
batches split, the others train whole. The real-cap scenario of a batch
that runs out while memory is held is in buckets_test.
"""

import concurrent.futures
import contextlib
import dataclasses
from unittest import mock

import _models
import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfmemsafe
from tfmemsafe import testing

_EXAMPLES = 96


def _examples(shuffled=False, per_token=False):
    """Unbatched `(token ids, label)`, 2 to 40 tokens long; the label is
    one per token with `per_token`."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 41, _EXAMPLES)
    tokens = tf.ragged.constant(
        [rng.integers(1, 100, n) for n in lengths], dtype=tf.int32
    )
    labels = (lengths % 3).astype("int32")
    if per_token:
        labels = tokens % 3
    data = tf.data.Dataset.from_tensor_slices((tokens, labels))
    if shuffled:
        data = data.shuffle(_EXAMPLES)
    return data


class OwnStep(keras.Sequential):
    """A model with a `train_step` of its own (here Keras' again)."""

    def train_step(self, data):
        return super().train_step(data)


def _model(
    accumulation=None, kind=keras.Sequential, strategy=None, runs_out_above=None
):
    """The model; `accumulation`: its `accumulation_steps`, or a dict of
    `with_gradient_accumulation`'s keywords (an update size); built and
    compiled under `strategy`, if any; running out of memory on batches
    (or replica shares) of more than `runs_out_above` rows."""
    first = [_models.RunsOutAbove(runs_out_above)]
    with strategy.scope() if strategy else contextlib.nullcontext():
        return _built(accumulation, kind, first=first)


def _built(accumulation, kind, first=(), vocabulary=100):
    """`first`: layers before the embedding of `vocabulary` token ids."""
    keras.utils.set_random_seed(0)
    model = kind(
        [
            keras.Input((None,), dtype="int32"),
            *first,
            keras.layers.Embedding(vocabulary, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(16, "relu"),
            keras.layers.Dense(3),
        ]
    )
    if isinstance(accumulation, dict):
        model = tfmemsafe.with_gradient_accumulation(model, **accumulation)
    elif accumulation:
        model = tfmemsafe.with_gradient_accumulation(model, accumulation)
    model.compile(
        keras.optimizers.Adam(1e-2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _buckets(model):
    """Buckets of 8, 16, 24 and 40 tokens, of at most 16 examples."""
    return tfmemsafe.data.memory_buckets(
        _examples(),
        model,
        estimate=_models.length_estimate(),
        bucket_boundaries=[9, 17, 25],
        max_batch_size=16,
    )


def _reference(accumulation=None, epochs=1, strategy=None):
    """The model after plain `model.fit` on the same batches.

    Their number is asserted, so that Keras takes no step past the last
    batch (`tfmemsafe.fit` takes none either, see `StepGuard`)."""
    model = _model(accumulation, strategy=strategy)
    buckets = _buckets(model)
    batches = buckets.apply(_examples()).apply(
        tf.data.experimental.assert_cardinality(buckets.num_batches())
    )
    history = model.fit(batches, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def _fit(model, shuffled=False, epochs=1, per_token=False, **kwargs):
    with mock.patch.object(
        tfmemsafe.data, "memory_buckets", return_value=_buckets(model)
    ):
        return tfmemsafe.fit(
            model,
            _examples(shuffled, per_token),
            batch_size="auto",
            epochs=epochs,
            verbose=0,
            **kwargs,
        )


class SplitBatchTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("plain", None, False),
        # Batches in a new order each pass: nothing is read again.
        ("data_in_a_new_order_each_pass", None, True),
        ("accumulating", 2, False),
        # Windows of 300 tokens or more: 2 to 3 batches of 128 to 640.
        ("tokens_per_update", {"tokens_per_update": 300}, False),
    )
    def test_a_split_batch_makes_the_update_of_the_whole_batch(
        self, accumulation, shuffled
    ):
        expected, logs = _reference(accumulation, epochs=2)
        model = _model(accumulation, runs_out_above=8)
        history = _fit(model, shuffled=shuffled, epochs=2)
        self.assertNotEmpty(history.oom_events)
        for event in history.oom_events:
            self.assertGreaterEqual(event.split_into, 2)
            self.assertEqual(event.batch_size_after, event.batch_size_before)
        self.assertEqual(history.batch_size, 16)  # The first bucket's.
        if shuffled:
            return  # Another order: other updates, every one exact.
        for got, want in zip(
            model.get_weights(), expected.get_weights(), strict=True
        ):
            self.assertAllClose(got, want, rtol=1e-5, atol=1e-6)
        # The split step's metrics count its samples once.
        self.assertAllClose(history.history["loss"], logs["loss"], rtol=1e-5)
        self.assertAllClose(
            history.history["accuracy"], logs["accuracy"], rtol=1e-5
        )
        self.assertEqual(
            int(model.optimizer.iterations.numpy()),
            int(expected.optimizer.iterations.numpy()),
        )

    def test_a_train_step_of_its_own_runs_once_per_micro_batch(self):
        model = _model(kind=OwnStep, runs_out_above=8)
        history = _fit(model)
        self.assertNotEmpty(history.oom_events)
        reference, _ = _reference()
        # Each micro-batch made its own update.
        self.assertGreater(
            int(model.optimizer.iterations.numpy()),
            int(reference.optimizer.iterations.numpy()),
        )

    def test_a_loss_over_unmasked_tokens_is_refused(self):
        # Its loss averages over a micro-batch's tokens, not its rows.
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((None,), dtype="int32"),
                _models.RunsOutAbove(8),
                keras.layers.Embedding(100, 8, mask_zero=True),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError, "outputs carry a mask"
        ):
            _fit(model, per_token=True)

    def test_max_retries_stops_the_run(self):
        with self.assertRaisesRegex(
            tfmemsafe.OutOfMemoryError, "`max_retries=0` errors"
        ):
            _fit(_model(runs_out_above=8), max_retries=0)

    def test_the_event_says_what_was_split(self):
        event = tfmemsafe.OOMEvent(
            epoch=0,
            step=5,
            phase="training",
            batch_size_before=64,
            batch_size_after=64,
            accumulation_steps=None,
            error="OOM",
            resumed_at_step=5,
            split_into=4,
        )
        self.assertEqual(
            str(event),
            "epoch 1, training step 5: its batch split into 4 "
            "micro-batches for one update, batch size 64 kept",
        )
        self.assertEqual(dataclasses.asdict(event)["split_into"], 4)


def _compared(model, history, expected, logs) -> dict:
    """A split run's model and history beside the run without a split."""
    return {
        "events": [dataclasses.asdict(e) for e in history.oom_events],
        "batch_size": history.batch_size,
        "differences": [
            float(np.max(np.abs(got - want)))
            for got, want in zip(
                model.get_weights(), expected.get_weights(), strict=True
            )
        ],
        "scales": [float(np.max(np.abs(w))) for w in expected.get_weights()],
        "history": history.history,
        "expected_history": logs,
        "iterations": [
            int(model.optimizer.iterations.numpy()),
            int(expected.optimizer.iterations.numpy()),
        ],
    }


def _assert_the_update_of_the_whole_batch(test, result):
    """The weights, metrics and update count of a `_compared` run are
    those of the run without a split."""
    for difference, scale in zip(
        result["differences"], result["scales"], strict=True
    ):
        test.assertLessEqual(difference, 1e-6 + 1e-5 * scale, result)
    for metric in ("loss", "accuracy"):
        test.assertAllClose(
            result["history"][metric],
            result["expected_history"][metric],
            rtol=1e-5,
        )
    test.assertEqual(*result["iterations"])


def splits_under_a_mirrored_strategy(runs):
    """The split test's run for each `(runs_out_above, accumulation)` of
    `runs` under a `MirroredStrategy` of two CPU devices, beside plain
    `model.fit` under the same (in a fresh process: the devices are set
    before TensorFlow makes its own). One process for all: the models
    are small, and a process costs more than their runs."""
    strategy = _models.mirrored_on_two_cpus()
    references, results = {}, []
    for runs_out_above, accumulation in runs:
        key = repr(accumulation)
        if key not in references:
            references[key] = _reference(
                accumulation, epochs=2, strategy=strategy
            )
        expected, logs = references[key]
        model = _model(
            accumulation, strategy=strategy, runs_out_above=runs_out_above
        )
        history = _fit(model, epochs=2)
        results.append(_compared(model, history, expected, logs))
    return results


# (runs_out_above, accumulation) of each run under a `MirroredStrategy`:
# replica shares of more than 4 rows (of 8 a replica) or of more than 5
# (the 11 examples of an epoch's last batch, shared 6 and 5) run out; also
# into windows of 2 batches, and of tokens.
_MIRRORED = {
    "plain": (4, None),
    "plain_last_batch": (5, None),
    "accumulating": (4, 2),
    "tokens_per_update": (4, {"tokens_per_update": 300}),
}


class MirroredStrategyTest(parameterized.TestCase, tf.test.TestCase):
    """A split under a `MirroredStrategy`: each replica trains its share
    of the batch in pieces, and the one update all-reduces them."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        results = testing.run_in_subprocess(
            splits_under_a_mirrored_strategy, args=[list(_MIRRORED.values())]
        )
        cls.results = dict(zip(_MIRRORED, results, strict=True))

    @parameterized.parameters(*_MIRRORED)
    def test_a_split_batch_makes_the_update_of_the_whole_batch(self, name):
        result = self.results[name]
        self.assertNotEmpty(result["events"])
        for event in result["events"]:
            self.assertGreaterEqual(event["split_into"], 2, result)
            self.assertEqual(
                event["batch_size_after"], event["batch_size_before"]
            )
        _assert_the_update_of_the_whole_batch(self, result)


# A token no other example holds (the data's are 1 to 99).
_MARKER = 100


class RunsOutWithTheMarker(keras.layers.Layer):
    """Asks the allocator for 2**60 bytes, which it refuses (a genuine
    allocation failure), when its share of a batch
    holds the marked example and more than `rows` rows: the failure of
    one worker's share, and of the pieces of more than `rows` rows."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, tokens):
        fails = tf.logical_and(
            tf.reduce_any(tf.equal(tokens, _MARKER)),
            tf.shape(tokens)[0] > self.rows,
        )
        elements = tf.where(fails, tf.constant(2**58, tf.int64), 1)
        asked = tf.zeros(tf.reshape(elements, [1]))
        return tokens + tf.cast(asked[0] * 0.0, tokens.dtype)


def _marked_examples():
    """`_examples()`, with the marker as example 5's first token."""
    tokens, labels = next(iter(_examples().batch(_EXAMPLES)))
    rows = tokens.to_list()
    rows[5][0] = _MARKER
    return tf.data.Dataset.from_tensor_slices(
        (tf.ragged.constant(rows, dtype=tf.int32), labels)
    )


def _worker_model(runs_out_above, accumulation):
    """The split test's model as every model under the multi-worker
    strategy must be (an `AccumulatingModel`), with a
    `RunsOutWithTheMarker` first unless `runs_out_above` is `None`."""
    first = (
        () if runs_out_above is None else [RunsOutWithTheMarker(runs_out_above)]
    )
    return _built(
        accumulation, keras.Sequential, first=first, vocabulary=_MARKER + 1
    )


def split_on_two_workers(cases):
    """Each of `cases`, `(runs_out_above, accumulation, epochs)`, trained
    by `tfmemsafe.fit` on the marked examples in buckets, beside the same
    model without the failing layer; on each worker of two."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    batch_losses = []

    class BatchLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batch_losses.append(float(logs["loss"]))

    def fit(model, epochs):
        plan = tfmemsafe.data.memory_buckets(
            _marked_examples(),
            model,
            estimate=_models.length_estimate(),
            bucket_boundaries=[9, 17, 25],
            max_batch_size=16,
        )
        with mock.patch.object(
            tfmemsafe.data, "memory_buckets", return_value=plan
        ):
            return tfmemsafe.fit(
                model,
                _marked_examples(),
                batch_size="auto",
                epochs=epochs,
                callbacks=[BatchLosses()],
                verbose=0,
            )

    results = []
    for runs_out_above, accumulation, epochs in cases:
        batch_losses.clear()
        with strategy.scope():
            model = _worker_model(runs_out_above, accumulation)
        try:
            history = fit(model, epochs)
        except tfmemsafe.OutOfMemoryError as err:
            results.append({"stopped": str(err)})
            continue
        split_losses = list(batch_losses)
        # The reference only where the split run trained.
        with strategy.scope():
            expected = _worker_model(None, accumulation)
        logs = fit(expected, epochs).history
        results.append(
            {
                **_compared(model, history, expected, logs),
                "worker": tfmemsafe.distribute.worker_index(strategy),
                "batch_losses": split_losses,
            }
        )
    return results


# (runs_out_above, accumulation, epochs): a share over 4 rows runs out, so
# the 16-row batch (8 a worker) trains as 2 pieces, in both epochs, also
# into windows of 2; over 1 row: as 2, 4, then 8 pieces; always: every
# piece runs out, and every worker stops.
_ON_WORKERS = {
    "halves": (4, 1, 2),
    "halves_into_windows": (4, 2, 1),
    "finer": (1, 1, 1),
    "never_fits": (0, 1, 1),
}


class MultiWorkerTest(parameterized.TestCase, tf.test.TestCase):
    """A batch that runs out on one worker of two
    (`MultiWorkerMirroredStrategy`): every worker splits it the same way,
    and the update is the one the whole batch makes."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        groups = [["halves", "halves_into_windows"], ["finer", "never_fits"]]
        # Two jobs at once: a job's workers mostly wait for each other.
        with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
            runs = pool.map(
                lambda names: testing.run_workers(
                    split_on_two_workers,
                    2,
                    args=[[_ON_WORKERS[name] for name in names]],
                    # oneDNN's CPU allocator hands a large request to a BFC
                    # allocator, which retries for 10 s; TensorFlow's
                    # default CPU allocator refuses at once.
                    env={
                        "CUDA_VISIBLE_DEVICES": "",
                        "TF_ENABLE_ONEDNN_OPTS": "0",
                    },
                    timeout=420,
                ),
                groups,
            )
            cls.results = {}
            for names, workers in zip(groups, runs, strict=True):
                for index, name in enumerate(names):
                    cls.results[name] = [worker[index] for worker in workers]

    @parameterized.parameters("halves", "halves_into_windows", "finer")
    def test_every_worker_splits_the_batch_the_same_way(self, name):
        workers = self.results[name]
        first, second = (
            [(e["epoch"], e["split_into"]) for e in w["events"]]
            for w in workers
        )
        self.assertNotEmpty(first)
        self.assertEqual(first, second)
        for result in workers:
            for event in result["events"]:
                self.assertEqual(
                    event["batch_size_after"], event["batch_size_before"]
                )
            _assert_the_update_of_the_whole_batch(self, result)

    def test_every_worker_logs_the_jobs_averages(self):
        # Keras averages each step's logs over the workers; so does the
        # step that agrees (a worker's own would differ: its own share).
        first, second = self.results["halves"]
        self.assertNotEmpty(first["batch_losses"])
        self.assertAllClose(
            first["batch_losses"], second["batch_losses"], rtol=1e-6
        )

    def test_the_worker_that_ran_out_is_named_on_the_other(self):
        errors = [
            {e["error"] for e in result["events"]}
            for result in self.results["halves"]
        ]
        (ran_out,) = [
            r["worker"]
            for r, e in zip(self.results["halves"], errors, strict=True)
            if all("OOM when allocating" in line for line in e)
        ]
        (other,) = errors[1 - ran_out]
        self.assertStartsWith(
            other,
            f"Worker {ran_out} of 2 ran out of memory in this training step",
        )

    def test_a_batch_that_never_fits_stops_every_worker_alike(self):
        # Each worker with its own error: its own, or the other's report.
        for result in self.results["never_fits"]:
            self.assertRegex(
                result["stopped"],
                r"^A batch of 8 ran out of memory even as micro-batches of "
                r"one example",
            )


class UpdateSizeTest(parameterized.TestCase, tf.test.TestCase):
    @parameterized.named_parameters(
        ("samples", {"samples_per_update": 48}, {"max_batch_size": 48}),
        ("tokens", {"tokens_per_update": 600}, {"max_tokens": 600}),
    )
    def test_fit_caps_the_buckets_at_the_update_size(self, by_size, cap):
        # So that an update averages under twice the size asked for.
        model = _model(by_size)
        with mock.patch.object(
            tfmemsafe.data, "memory_buckets", return_value=_buckets(model)
        ) as planned:
            tfmemsafe.fit(model, _examples(), batch_size="auto", verbose=0)
        # `fit`'s `verbose` goes to the probes' progress bar.
        self.assertEqual(planned.call_args.kwargs, {**cap, "verbose": 0})

    def test_accumulation_steps_over_buckets_are_said_to_vary(self):
        model = _model(2)
        plan = _buckets(model)
        sizes = [16, 8, 8, 4][: len(plan.lengths)]
        plan = dataclasses.replace(plan, bucket_batch_sizes=(*sizes, sizes[-1]))
        with (
            mock.patch.object(
                tfmemsafe.data, "memory_buckets", return_value=plan
            ),
            self.assertLogs(level="WARNING") as logs,
        ):
            tfmemsafe.fit(model, _examples(), batch_size="auto", verbose=0)
        self.assertIn(
            "accumulation_steps=2 counts batches, and the buckets' batches "
            "hold 4 to 16 samples: updates of 8 to 32 samples.",
            logs.output[0],
        )
        self.assertIn(
            "build the model with `samples_per_update`", logs.output[0]
        )


if __name__ == "__main__":
    tf.test.main()
