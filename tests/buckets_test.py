"""Tests for tfmemsafe.data's length buckets sized by predicted memory.

`RealCapTest` plans the buckets of a GRU's and a transformer's token
sequences (log-normal lengths) under a real allocator cap, each in its
own process, both at once, and trains an epoch on them with plain
`model.fit`. The other tests use a `MemoryEstimate` built by hand, so
they need no probe.
"""

import concurrent.futures
import dataclasses
import os
from unittest import mock

# The CPU allocator keeps statistics only with BFC (or oneDNN) on; it must
# be chosen before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import _models  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import parameterized  # noqa: E402

import tfmemsafe  # noqa: E402
from tfmemsafe import distribute  # noqa: E402
from tfmemsafe import testing  # noqa: E402
from tfmemsafe.data import _workers as data_workers  # noqa: E402

_MB = 1024 * 1024
# Under this cap the buckets' batches are smaller than the buckets (of
# `_EXAMPLES`), so that full batches at the predicted sizes train.
_CAP_MB = 160
_EXAMPLES = 4000


def _sequences(count=_EXAMPLES, median=48, longest=512, seed=0):
    """Unbatched `(token ids, id)`: log-normal lengths, one at `longest`.

    The label is the example's index, so that a test can count which
    examples a pass went through (the models take it as a class id).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(median), 0.7, count).astype(int)
    lengths = np.clip(lengths, 1, longest)
    lengths[count // 2] = longest
    tokens = tf.ragged.constant(
        [rng.integers(1, 2000, n) for n in lengths], dtype=tf.int32
    )
    ids = np.arange(count, dtype="int32")
    return tf.data.Dataset.from_tensor_slices((tokens, ids)), lengths


def _estimate(**kwargs):
    return _models.length_estimate(**kwargs)


def _labelled(data):
    """The models' classes: the id's parity and more, 4 of them."""
    return data.map(lambda tokens, ids: (tokens, ids % 4))


def buckets_under_cap(name):
    """Plans the buckets of `name` under the cap, trains an epoch on them."""
    model = testing.reference_model(name, (None,))
    data, lengths = _sequences()
    train = _labelled(data)
    buckets = tfmemsafe.data.memory_buckets(train, model)
    seen, shapes = [], []
    for x, ids in buckets.apply(data):
        seen.extend(ids.numpy().tolist())
        shapes.append(tuple(x.shape))
    with testing.AllocatorFailures() as failures:
        history = model.fit(
            tfmemsafe.data.bucket_by_memory(
                train, model, estimate=buckets.estimate
            ),
            epochs=1,
            verbose=0,
        )
    full = [
        length
        for length, size, count in zip(
            buckets.lengths,
            buckets.bucket_batch_sizes,
            buckets.counts,
            strict=False,
        )
        if count >= size
    ]
    # The buckets' measurements (`memory_buckets` adds one a bucket, last)
    # that the prediction falls below, leaving out those on the floor.
    estimate = buckets.estimate
    measured = estimate.length_measurements[-len(buckets.lengths) :]
    below = [
        (size, length, peak, estimate.peak_bytes(size, length))
        for size, length, peak in measured
        if estimate.peak_bytes(size, length) < peak
        and size * estimate._fitted_per_sample(length)
        >= estimate.fixed_bytes_at(length)
    ]
    return {
        "measured": [(size, length) for size, length, _ in measured],
        "below": below,
        "full": full,
        "lengths": list(buckets.lengths),
        "sizes": list(buckets.bucket_batch_sizes),
        "counts": list(buckets.counts),
        "peaks": list(buckets.predicted_peak_bytes),
        "limit": buckets.estimate.limit_bytes,
        "seen": seen,
        "shapes": shapes,
        "longest": int(lengths.max()),
        "largest": [
            estimate.largest_tensor_bytes_at(n) for n in buckets.lengths
        ],
        "failures": failures.count,
        "loss": history.history["loss"],
        "text": f"{buckets}\n{buckets.estimate}",
    }


class _Seen(keras.layers.Layer):
    """Counts, in a variable, the training steps each example id was in.

    Under a multi-worker strategy (`aggregation="mean"`) a step adds the
    mean of the workers' counts: each example trained once adds
    1 / workers.
    """

    def __init__(self, count, aggregation="none", **kwargs):
        super().__init__(**kwargs)
        self.count = count
        self.aggregation = aggregation
        self.seen = self.add_weight(
            shape=(count,),
            initializer="zeros",
            trainable=False,
            aggregation=aggregation,
        )

    def call(self, x, ids, training=False):
        if training:
            self.seen.assign_add(
                tf.math.bincount(
                    ids,
                    minlength=self.count,
                    maxlength=self.count,
                    dtype="float32",
                )
            )
        return x

    def get_config(self):
        return {
            **super().get_config(),
            "count": self.count,
            "aggregation": self.aggregation,
        }


def _counting_gru():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    ids = keras.Input((), dtype="int32", name="id")
    x = keras.layers.Embedding(2000, 64)(tokens)
    x = keras.layers.GRU(128)(x)
    x = _Seen(_EXAMPLES, name="seen")(x, ids)
    model = keras.Model({"tokens": tokens, "id": ids}, keras.layers.Dense(4)(x))
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def fit_auto_under_cap():
    """Two epochs of `tfmemsafe.fit(batch_size="auto")` on the examples,
    the allocator full but for 64 MB at epoch 1, step 1 until the next
    (the step's batch needs more than 96 MB). Epoch 0 shows the planned
    sizes training without an error, epoch 1 the split of a batch that
    ran out.

    On a CPU tf.data pads the next batch in the allocator the step runs
    out of: a step that runs out fills it first, and a padding made in
    that instant runs out too, at random. Then the run stops with the
    pipeline's error, as documented, and this returns it as
    `pipeline_error`, beside what the first epoch trained."""
    data, _ = _sequences()
    examples = data.map(lambda tokens, i: ({"tokens": tokens, "id": i}, i % 4))
    model = _counting_gru()
    first_epoch = {}
    with (
        testing.AllocatorFailures() as failures,
        _models.absl_messages() as logged,
    ):

        def ran_out():
            # `SplitBatchOnOOM` logs a line per error it recovers from.
            return [m for m in logged if m.startswith("Out of memory")]

        def after_the_first_epoch(epoch, logs):
            if epoch == 0:
                seen = model.get_layer("seen").seen.numpy()
                first_epoch["seen"] = sorted(set(seen.tolist()))
                first_epoch["ran_out"] = ran_out()

        callbacks = [
            keras.callbacks.LambdaCallback(on_epoch_end=after_the_first_epoch),
            testing.HeldMemory(1, 1, leave_mb=64),
        ]
        try:
            history = tfmemsafe.fit(
                model,
                examples,
                batch_size="auto",
                epochs=2,
                grow_back_after=5,
                callbacks=callbacks,
                verbose=0,
            )
        except tfmemsafe.OutOfMemoryError as err:
            if str(err).startswith("The data pipeline ran out"):
                return {"pipeline_error": str(err), "first_epoch": first_epoch}
            raise
    result = _fit_result(model, history, failures)
    result["first_epoch"] = first_epoch
    result["ran_out_logged"] = ran_out()
    result["grown"] = [dataclasses.asdict(e) for e in history.grow_back_events]
    return result


def fit_with_a_long_bucket_too_large_under_cap():
    """One epoch of `tfmemsafe.fit(batch_size="auto")` on a plan whose
    longest bucket that holds many examples gets a batch 2 to 4 times as
    large: as a length the plan did not foresee, its batch runs out and
    the rest fit."""
    data, _ = _sequences()
    examples = data.map(lambda tokens, i: ({"tokens": tokens, "id": i}, i % 4))
    model = _counting_gru()
    plan = tfmemsafe.data.memory_buckets(examples, model)
    sizes = list(plan.bucket_batch_sizes)
    # The longest bucket of at least two full batches (the log-normal
    # lengths give several): its first batch is 2 to 4 times as large.
    long = max(i for i, n in enumerate(plan.counts) if n >= 2 * sizes[i])
    sizes[long] = min(4 * sizes[long], plan.counts[long])
    plan = dataclasses.replace(plan, bucket_batch_sizes=tuple(sizes))
    with (
        mock.patch.object(tfmemsafe.data, "memory_buckets", return_value=plan),
        testing.AllocatorFailures() as failures,
    ):
        history = tfmemsafe.fit(model, examples, batch_size="auto", verbose=0)
    result = _fit_result(model, history, failures)
    result.update(sizes=sizes, long_length=plan.lengths[long])
    return result


def _fit_result(model, history, failures):
    """What the run gave: each example's training count among them."""
    seen = model.get_layer("seen").seen.numpy()
    return {
        "seen": sorted(set(seen.tolist())),
        "batch_size": history.batch_size,
        "events": [dataclasses.asdict(e) for e in history.oom_events],
        "failures": failures.count,
        "loss": history.history["loss"],
        "epochs": len(history.history["loss"]),
    }


class RealCapTest(parameterized.TestCase, tf.test.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        scenarios = {
            "gru": (buckets_under_cap, ["gru"]),
            "transformer": (buckets_under_cap, ["transformer"]),
            "fit": (fit_auto_under_cap, []),
            "fit_long": (fit_with_a_long_bucket_too_large_under_cap, []),
        }
        cls._pool = concurrent.futures.ThreadPoolExecutor(len(scenarios))
        cls._results = {
            name: cls._pool.submit(
                testing.run_with_memory_cap, target, _CAP_MB, args=args
            )
            for name, (target, args) in scenarios.items()
        }

    @classmethod
    def tearDownClass(cls):
        cls._pool.shutdown(wait=True)
        super().tearDownClass()

    @parameterized.parameters("gru", "transformer")
    def test_every_example_is_batched_once_within_its_bucket(self, name):
        result = self._results[name].result()
        self.assertCountEqual(result["seen"], range(_EXAMPLES))
        sizes = dict(zip(result["lengths"], result["sizes"], strict=False))
        for batch, length in result["shapes"]:
            self.assertIn(length, sizes, msg=result["text"])
            self.assertLessEqual(batch, sizes[length], msg=result["text"])
        self.assertEqual(result["lengths"][-1], result["longest"])
        # Each bucket's batch was measured, and no prediction is below it.
        self.assertEqual(
            [length for _, length in result["measured"]], result["lengths"]
        )
        for (measured, _), size, count in zip(
            result["measured"], result["sizes"], result["counts"], strict=False
        ):
            self.assertGreaterEqual(measured, min(size, count))
        self.assertEqual(result["below"], [], msg=result["text"])
        if name == "transformer":
            # The room kept beside each bucket's peak is at least its
            # attention scores (4 heads, float32: 16 l^2 bytes a sample),
            # which grow with the square of the length. Scaled with the
            # per-sample part from the data's length it was 37% of them
            # at 328, and batch 16 ran out there (once in CI).
            for length, largest in zip(
                result["lengths"], result["largest"], strict=True
            ):
                self.assertGreaterEqual(largest, 0.999 * 16 * length**2, length)

    @parameterized.parameters("gru", "transformer")
    def test_longer_buckets_get_smaller_batches_that_train_without_oom(
        self, name
    ):
        result = self._results[name].result()
        self.assertEqual(result["failures"], 0, msg=result["text"])
        # Most buckets had a batch at their full predicted size.
        self.assertGreaterEqual(len(result["full"]), 4, msg=result["text"])
        self.assertTrue(np.isfinite(result["loss"]).all())
        sizes = result["sizes"][:-1]
        self.assertEqual(sizes, sorted(sizes, reverse=True))
        self.assertGreater(sizes[0], 4 * sizes[-1], msg=result["text"])
        for peak in result["peaks"]:
            self.assertLessEqual(peak, 0.8 * result["limit"])

    def test_fit_auto_trains_every_example_once_an_epoch(self):
        result = self._results["fit"].result()
        # The first epoch, before anything else held memory: the planned
        # sizes trained every example once, without running out.
        self.assertEqual(result["first_epoch"]["seen"], [1.0], msg=result)
        self.assertEqual(result["first_epoch"]["ran_out"], [], msg=result)
        if "pipeline_error" in result:
            self.skipTest("tf.data ran out beside the held step")
        self.assertNotIn(0, [event["epoch"] for event in result["events"]])
        self.assertEqual(result["seen"], [2.0], msg=result)
        self.assertEqual(result["epochs"], 2)
        self.assertTrue(np.isfinite(result["loss"]).all())

    def test_fit_auto_splits_only_the_batch_that_ran_out(self):
        result = self._results["fit"].result()
        if "pipeline_error" in result:
            # The pipeline's padding ran out beside the step (see
            # `fit_auto_under_cap`): a clear stop, not a wrong update.
            self.assertIn("training stops", result["pipeline_error"])
            self.skipTest("tf.data ran out beside the held step")
        # The held step ran out; its batch was trained again as
        # micro-batches that fit beside what was held, in the same step,
        # every bucket at its planned size.
        events = result["events"]
        self.assertNotEmpty(events, msg=result)
        # One log line per event: what the first epoch's check reads.
        self.assertLen(result["ran_out_logged"], len(events), msg=result)
        for event in events:
            self.assertEqual((event["epoch"], event["phase"]), (1, "training"))
            self.assertGreaterEqual(event["split_into"], 2)
            self.assertEqual(
                event["batch_size_after"], event["batch_size_before"]
            )
        self.assertEqual(events[0]["step"], 1)
        # Each example counted once an epoch, the split one too.
        self.assertEqual(result["seen"], [2.0], msg=result)
        self.assertEqual(result["epochs"], 2)
        self.assertTrue(np.isfinite(result["loss"]).all())

    def test_fit_auto_splits_a_long_batch_and_keeps_every_size(self):
        result = self._results["fit_long"].result()
        events = result["events"]
        self.assertNotEmpty(events, msg=result)
        # Only the long bucket's batches ran out; each was split (finer
        # where 2 did not fit) and no bucket's size changed.
        for event in events:
            self.assertGreaterEqual(event["split_into"], 2, msg=result)
            self.assertEqual(
                event["batch_size_after"], event["batch_size_before"]
            )
        self.assertEqual(result["batch_size"], result["sizes"][0])
        self.assertEqual(result["seen"], [1.0], msg=result)
        self.assertTrue(np.isfinite(result["loss"]).all())


# The second worker's cap: alone it would choose larger batches.
_WIDER_CAP_MB = 220
_WORKER_EXAMPLES = 1200


def plan_and_fit_on_a_worker():
    """`memory_buckets`, then an epoch of `tfmemsafe.fit(batch_size="auto")`
    on its plan, on one worker of a two-worker job (an `AccumulatingModel`:
    Keras 3 cannot fit a plain model under the strategy)."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    data, _ = _sequences(count=_WORKER_EXAMPLES, longest=300)
    examples = data.map(lambda tokens, i: ({"tokens": tokens, "id": i}, i % 4))
    with strategy.scope():
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        ids = keras.Input((), dtype="int32", name="id")
        x = keras.layers.Embedding(2000, 64)(tokens)
        x = keras.layers.GRU(128)(x)
        x = _Seen(_WORKER_EXAMPLES, aggregation="mean", name="seen")(x, ids)
        model = tfmemsafe.AccumulatingModel(
            {"tokens": tokens, "id": ids},
            keras.layers.Dense(4)(x),
            accumulation_steps=1,
        )
        model.compile(
            keras.optimizers.Adam(1e-3),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    plan = tfmemsafe.data.memory_buckets(examples, model)
    # The size this worker's own memory model gives each bucket, by
    # `memory_buckets`' rule, with what else was in use when it planned.
    estimate, headroom = plan.estimate, 0.2  # `memory_buckets`' default.
    held = plan.predicted_peak_bytes[0] - estimate.peak_bytes(
        plan.bucket_batch_sizes[0], length=plan.lengths[0]
    )
    usable = int(estimate.limit_bytes - held / (1 - headroom))
    # No batch above the most examples a bucket holds, the job's.
    replicas = strategy.num_replicas_in_sync
    most = -(-max(plan.counts) * replicas // plan.multiple) * plan.multiple
    own = [
        min(
            estimate.max_batch_size(
                usable, headroom=headroom, multiple=plan.multiple, length=n
            ),
            4096,
            most,
        )
        for n in plan.lengths
    ]
    with (
        mock.patch.object(tfmemsafe.data, "memory_buckets", return_value=plan),
        testing.AllocatorFailures() as failures,
    ):
        history = tfmemsafe.fit(model, examples, batch_size="auto", verbose=0)
    seen = model.get_layer("seen").seen.numpy() * strategy.num_replicas_in_sync
    return {
        "boundaries": list(plan.bucket_boundaries),
        "sizes": list(plan.bucket_batch_sizes[:-1]),
        "own": own,
        "counts": list(plan.counts),
        "peaks": list(plan.predicted_peak_bytes),
        "limit": estimate.limit_bytes,
        "seen": sorted(set(seen.round(6).tolist())),
        "failures": failures.count,
        "events": len(history.oom_events),
        "text": str(plan),
    }


class SharedAndGrownRealCapTest(tf.test.TestCase):
    """Two workers planning one job: apart from `RealCapTest`'s five
    processes, so that neither set runs beside the other's load (readings
    move with the machine's)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._pool = concurrent.futures.ThreadPoolExecutor(2)
        cls._results = {
            "workers": cls._pool.submit(
                testing.run_workers,
                plan_and_fit_on_a_worker,
                2,
                env=testing.memory_cap_environment(_CAP_MB),
                worker_env=[
                    {},
                    {"TF_CPU_BFC_MEM_LIMIT_IN_MB": str(_WIDER_CAP_MB)},
                ],
            ),
        }

    @classmethod
    def tearDownClass(cls):
        cls._pool.shutdown(wait=True)
        super().tearDownClass()

    def test_two_workers_agree_on_the_buckets_and_train_each_example_once(
        self,
    ):
        first, second = self._results["workers"].result()
        text = f"{first['text']}\n{second['text']}"
        self.assertEqual(first["boundaries"], second["boundaries"])
        self.assertEqual(first["counts"], second["counts"])
        self.assertEqual(first["sizes"], second["sizes"], msg=text)
        # Each bucket at most what each worker's memory model gives it
        # (`own`: by its final estimate; a size is also never above what
        # the estimate gave before the buckets were measured, which `own`
        # cannot see), and about the smaller of the two; the worker with
        # the wider cap would have chosen larger batches.
        for size, a, b in zip(
            first["sizes"], first["own"], second["own"], strict=True
        ):
            self.assertBetween(size, 0.9 * min(a, b), min(a, b), msg=text)
        self.assertTrue(
            any(
                own > size
                for own, size in zip(
                    second["own"], second["sizes"], strict=True
                )
            ),
            msg=text,
        )
        for worker in (first, second):
            for peak in worker["peaks"]:
                self.assertLess(peak, 0.8 * worker["limit"], msg=text)
            # The epoch trained every example exactly once, on one worker
            # or the other, with no out-of-memory error.
            self.assertEqual(worker["seen"], [1.0], msg=text)
            self.assertEqual((worker["failures"], worker["events"]), (0, 0))


def plan_with_a_bad_length_on_the_second_worker():
    """`memory_buckets` on a two-worker job whose second worker's
    `length_fn` gives a negative length: each worker's error."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = testing.reference_model("gru", (None,))
    data, _ = _sequences(count=40, longest=100)
    shift = 1000 * distribute.worker_index(strategy)
    try:
        tfmemsafe.data.memory_buckets(
            _labelled(data),
            model,
            length_fn=lambda tokens, label: tf.shape(tokens)[0] - shift,
        )
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def plan_with_a_too_long_example_on_the_second_worker():
    """`memory_buckets` on a two-worker job, from a hand-built estimate,
    whose second worker alone has an example that fits in no batch."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = testing.reference_model("gru", (None,))
    longest = 100 if distribute.worker_index(strategy) == 0 else 2_000_000
    data, _ = _sequences(count=40, longest=longest)
    try:
        tfmemsafe.data.memory_buckets(
            _labelled(data), model, estimate=_estimate()
        )
    except ValueError as err:
        return str(err)
    return None


class MultiWorkerTest(tf.test.TestCase):
    def test_a_worker_that_cannot_plan_stops_every_worker(self):
        first, second = testing.run_workers(
            plan_with_a_bad_length_on_the_second_worker, 2, timeout=120
        )
        self.assertStartsWith(
            first, "RuntimeError: `memory_buckets` stopped: another worker"
        )
        self.assertStartsWith(
            second, "ValueError: `length_fn` must return lengths >= 0"
        )

    def test_every_worker_names_the_longest_example_of_the_job(self):
        errors = testing.run_workers(
            plan_with_a_too_long_example_on_the_second_worker, 2, timeout=120
        )
        for error in errors:
            self.assertStartsWith(
                error, "`dataset` holds an example of length 2000000,"
            )

    def test_the_copy_measured_must_be_made_outside_the_scope(self):
        model = testing.reference_model("gru", (None,))
        with tf.distribute.MirroredStrategy(["CPU:0"]).scope():
            with self.assertRaisesRegex(
                ValueError, r"must be called outside `strategy.scope\(\)`"
            ):
                with data_workers.local_copy(model):
                    pass

    def test_a_model_that_cannot_be_copied_is_said(self):
        class Uncopyable(keras.layers.Layer):
            def __init__(self, units):  # No `get_config` for `units`.
                super().__init__()
                self.dense = keras.layers.Dense(units)

            def call(self, x):
                return self.dense(x)

        inputs = keras.Input((3,))
        model = keras.Model(inputs, Uncopyable(2)(inputs))
        model.compile("adam", "mse")
        with self.assertRaisesRegex(
            ValueError, r"(?s)could not copy this one: .*complete `get_config`"
        ):
            with data_workers.local_copy(model):
                pass

    def test_one_devices_estimate_becomes_one_replicas_of_the_job(self):
        one = _estimate()
        job = data_workers.global_estimate(one, 4)
        for size, length in ((8, 64), (100, 16), (32, 300)):
            self.assertAllClose(
                job.peak_bytes(4 * size, length=length),
                one.peak_bytes(size, length=length),
                atol=1,
            )
        self.assertEqual(
            job.max_batch_size(length=64) // 4,
            one.max_batch_size(length=64),
        )


class MemoryBucketsTest(tf.test.TestCase):
    """Sizes from a hand-built estimate: no probe runs."""

    def setUp(self):
        super().setUp()
        self.data, self.lengths = _sequences(count=300, longest=300)
        self.train = _labelled(self.data)
        self.model = testing.reference_model("gru", (None,))

    def _buckets(self, **kwargs):
        return tfmemsafe.data.memory_buckets(
            self.train, self.model, estimate=_estimate(), **kwargs
        )

    def test_default_buckets_grow_by_half_in_multiples_of_8(self):
        buckets = self._buckets()
        lengths = list(buckets.lengths)
        self.assertEqual(lengths[-1], 304)  # 300, rounded up to 8.
        # Each 1.5 times the last, up to a multiple of 8; the last is the
        # longest example's.
        for shorter, longer in zip(lengths, lengths[1:-1], strict=False):
            self.assertEqual(longer % 8, 0)
            self.assertBetween(longer, 1.5 * shorter, 1.5 * shorter + 8)
        self.assertEqual(sum(buckets.counts), 300)
        self.assertNotIn(0, buckets.counts)
        self.assertEqual(
            list(buckets.bucket_boundaries), [n + 1 for n in lengths]
        )

    def test_the_arrays_an_estimate_was_made_on_are_left_out(self):
        # An estimate made on 200 MiB of arrays counts them in its line; a
        # bucketed pipeline does not hold them.
        data = 200 * 2**20
        plain = _estimate(length_measurements=((16, 128, 130 * 2**20),))
        on_arrays = _estimate(
            fixed_bytes=plain.fixed_bytes + data,
            measurements=tuple((b, p + data) for b, p in plain.measurements),
            length_measurements=((16, 128, 130 * 2**20 + data),),
            data_bytes=data,
        )
        buckets = tfmemsafe.data.memory_buckets(
            self.train, self.model, estimate=on_arrays
        )
        # The plan sizes by the estimate without them, exactly. (Not two
        # plans' sizes compared: each reads what is in use when it plans,
        # and two calls may read it apart.)
        self.assertEqual(buckets.estimate, plain)

    def test_each_bucket_gets_the_largest_batch_predicted_to_fit(self):
        estimate = _estimate()
        buckets = self._buckets(multiple=8, max_batch_size=10**6)
        held = tfmemsafe.estimate.held_bytes("CPU:0", estimate.state_bytes)
        # `fit`'s rule: the peak and what is held, within 80% of the limit.
        usable = 0.8 * estimate.limit_bytes - held
        for length, size in zip(
            buckets.lengths, buckets.bucket_batch_sizes, strict=False
        ):
            self.assertEqual(size % 8, 0)
            self.assertLessEqual(estimate.peak_bytes(size, length), usable)
            self.assertGreater(estimate.peak_bytes(size + 8, length), usable)

    def test_a_measured_batch_that_runs_out_counts_as_the_limit(self):
        from tfmemsafe.data import _plan

        sizes = []

        class Probe:  # Two buckets' steps, then the third runs out.
            def __init__(self, *args, **kwargs):
                pass

            def step_peaks(self, batch_size, arguments):
                sizes.append(batch_size)
                if len(sizes) == 1:
                    error = tf.errors.ResourceExhaustedError(None, None, "OOM")
                    return {"CPU:0": [10, 12, 11, 20, 21, 22, 30]}, error
                return {"CPU:0": [40, 41, 42]}, None

            def close(self):
                pass

        def resized(source, size, length, steps):
            return {"x": tf.data.Dataset.range(steps)}

        estimate = _estimate()
        batches = [(8, 16), (4, 32), (2, 64), (1, 128)]
        with (
            mock.patch.object(_plan.estimate_lib, "Probe", Probe),
            mock.patch.object(_plan.estimate_lib, "resized_arguments", resized),
        ):
            measured = _plan._measured(self.model, None, estimate, batches)
        # The steps went on with the bucket after the one that ran out.
        self.assertEqual(sizes, [8, 1])
        self.assertEqual(
            measured.length_measurements[-4:],
            (
                (8, 16, 12),
                (4, 32, 22),
                (2, 64, estimate.limit_bytes),
                (1, 128, 42),
            ),
        )

    def _largest_probed(self, **kwargs):
        from tfmemsafe.data import _plan

        class Stop(Exception):
            pass

        with mock.patch.object(
            _plan.estimate_lib, "estimate_source", side_effect=Stop
        ) as estimate_source:
            with self.assertRaises(Stop):
                tfmemsafe.data.memory_buckets(self.train, self.model, **kwargs)
        return estimate_source.call_args.kwargs["largest"]

    def test_no_probe_is_larger_than_the_most_examples_a_bucket_holds(self):
        most = max(self._buckets().counts)
        self.assertBetween(most, 40, 299)
        self.assertEqual(self._largest_probed(), most)
        self.assertEqual(self._largest_probed(max_batch_size=40), 40)
        # Fewer than two default probe sizes would be no line.
        self.assertEqual(self._largest_probed(max_batch_size=8), 32)

    def test_no_batch_is_larger_than_the_most_examples_a_bucket_holds(self):
        from tfmemsafe.data import _plan

        class Probe:  # Every measured step well below the prediction.
            def __init__(self, *args, **kwargs):
                pass

            def step_peaks(self, batch_size, arguments):
                return {"CPU:0": [1] * int(arguments["x"].cardinality())}, None

            def close(self):
                pass

        def resized(source, size, length, steps):
            return {"x": tf.data.Dataset.range(steps)}

        with (
            mock.patch.object(
                _plan.estimate_lib, "estimate_source", return_value=_estimate()
            ),
            mock.patch.object(_plan.estimate_lib, "Probe", Probe),
            mock.patch.object(_plan.estimate_lib, "resized_arguments", resized),
        ):
            buckets = tfmemsafe.data.memory_buckets(
                self.train, self.model, multiple=8
            )
        most = max(buckets.counts)
        # The most examples, rounded up to 8: the short buckets' size, which
        # the estimate alone would make larger.
        self.assertEqual(max(buckets.bucket_batch_sizes), -(-most // 8) * 8)
        given = self._buckets(multiple=8)
        self.assertGreater(max(given.bucket_batch_sizes), most + 8)

    def test_sizes_stop_at_max_batch_size(self):
        buckets = self._buckets(max_batch_size=100)
        self.assertLessEqual(max(buckets.bucket_batch_sizes), 100)
        self.assertEqual(buckets.bucket_batch_sizes[0], 100)

    def test_no_batch_holds_more_than_max_tokens(self):
        free = self._buckets()
        capped = self._buckets(max_tokens=4000)
        for size, length, was in zip(
            capped.bucket_batch_sizes,
            capped.lengths,
            free.bucket_batch_sizes,
            strict=False,
        ):
            self.assertLessEqual(size * length, 4000)
            # As many as the tokens allow, or as memory does.
            self.assertEqual(size, min(was, 4000 // length))

    def test_bucket_by_memory_batches_every_example_once(self):
        batched = tfmemsafe.data.bucket_by_memory(
            self.data, self.model, estimate=_estimate(), max_batch_size=16
        )
        ids = [i for _, batch in batched for i in batch.numpy().tolist()]
        self.assertCountEqual(ids, range(300))
        buckets = self._buckets(max_batch_size=16)
        self.assertEqual(buckets.num_batches(), len(list(batched)))
        # Not asserted on the dataset: lengths may change between passes.
        self.assertEqual(
            int(batched.cardinality()), tf.data.UNKNOWN_CARDINALITY
        )

    def test_buckets_without_examples_are_left_out(self):
        buckets = self._buckets(bucket_boundaries=[16, 32, 5000, 100_000])
        self.assertEqual(list(buckets.bucket_boundaries), [16, 32, 5000])
        self.assertNotIn(0, buckets.counts)
        self.assertNotIn(0, buckets.bucket_batch_sizes)

    def test_grouping_without_batching_is_not_a_batched_dataset(self):
        from tfmemsafe import _pipelines

        grouped = self.data.group_by_window(
            lambda x, i: tf.cast(i % 2, "int64"), lambda k, w: w, 8
        )
        self.assertEqual(_pipelines.batching_of(grouped), (False, None))
        batched = self._buckets().apply(self.data)
        self.assertEqual(_pipelines.batching_of(batched), (True, None))

    def test_given_boundaries_are_kept_and_the_longest_covered(self):
        buckets = self._buckets(bucket_boundaries=[32, 128])
        self.assertEqual(list(buckets.bucket_boundaries), [32, 128, 301])
        self.assertEqual(list(buckets.lengths), [31, 127, 300])

    def test_a_length_fn_of_the_caller(self):
        # Lengths counted without the padding token 0 of a padded copy.
        padded = self.data.map(lambda x, i: (tf.pad(x, [[0, 4]]), i))
        buckets = tfmemsafe.data.memory_buckets(
            padded,
            self.model,
            estimate=_estimate(),
            length_fn=lambda x, i: tf.math.count_nonzero(x),
        )
        self.assertEqual(buckets.lengths[-1], 304)

    def test_the_table_names_each_bucket(self):
        text = str(self._buckets())
        self.assertStartsWith(text, "MemoryBuckets on CPU:0 (limit 1000.0 MiB)")
        self.assertIn("length   examples   batch   predicted peak", text)


class ArgumentTest(parameterized.TestCase, tf.test.TestCase):
    def setUp(self):
        super().setUp()
        self.data, _ = _sequences(count=40, longest=100)
        self.model = testing.reference_model("gru", (None,))

    def _plan(self, data=None, **kwargs):
        kwargs.setdefault("estimate", _estimate())
        return tfmemsafe.data.memory_buckets(
            self.data if data is None else data, self.model, **kwargs
        )

    def test_a_batched_dataset_is_refused(self):
        with self.assertRaisesRegex(ValueError, "must be unbatched.*by 8"):
            self._plan(self.data.batch(8))

    def test_an_endless_dataset_is_refused(self):
        with self.assertRaisesRegex(ValueError, "must be finite"):
            self._plan(self.data.repeat())

    def test_an_empty_dataset_is_refused(self):
        with self.assertRaisesRegex(ValueError, "at least one example"):
            self._plan(self.data.take(0))

    def test_not_a_dataset_is_refused(self):
        with self.assertRaisesRegex(TypeError, "unbatched tf.data.Dataset"):
            self._plan([1, 2, 3])

    @parameterized.named_parameters(
        (
            "float",
            lambda x, i: tf.cast(tf.size(x), "float32"),
            "scalar integer",
        ),
        ("vector", lambda x, i: tf.shape(x), "scalar integer"),
    )
    def test_a_length_fn_that_returns_no_length_is_refused(self, fn, text):
        with self.assertRaisesRegex(TypeError, text):
            self._plan(length_fn=fn)

    def test_a_length_fn_that_returns_nothing_is_refused(self):
        with self.assertRaisesRegex(
            TypeError, "`length_fn` must return a scalar integer"
        ):
            self._plan(length_fn=lambda x, i: None)

    def test_padded_batches_are_refused_where_they_would_be_batched_again(
        self,
    ):
        model = testing.reference_model("gru", (None,))
        padded = _labelled(_sequences(count=40, longest=100)[0]).padded_batch(8)
        with self.assertRaisesRegex(ValueError, "`x` is batched already"):
            tfmemsafe.fit(model, padded, batch_size="auto", verbose=0)
        with self.assertRaisesRegex(ValueError, "`data` is batched, and its"):
            tfmemsafe.estimate_memory(model, padded, lengths=[16, 32])

    def test_a_negative_length_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, "lengths >= 0.*-1 for example 0"
        ):
            self._plan(length_fn=lambda x, i: tf.where(i == 0, -1, 5))

    def test_lengths_all_zero_are_refused(self):
        with self.assertRaisesRegex(ValueError, "longer than 0"):
            self._plan(length_fn=lambda x, i: 0)

    def test_an_input_of_fixed_shape_needs_an_estimate(self):
        mixed = self.data.map(
            lambda x, i: ({"tokens": x, "features": tf.zeros([3])}, i)
        )
        with self.assertRaisesRegex(ValueError, "inputs of fixed shape"):
            tfmemsafe.data.memory_buckets(mixed, self.model)

    def test_fixed_length_inputs_need_a_length_fn(self):
        fixed = tf.data.Dataset.from_tensor_slices(
            (np.zeros((4, 8), "int32"), np.zeros(4, "int32"))
        )
        with self.assertRaisesRegex(ValueError, "no axis of varying length"):
            self._plan(fixed)

    @parameterized.named_parameters(
        ("unsorted", [64, 32]),
        ("empty", []),
        ("zero", [0, 8]),
        ("one", [1, 8]),
        ("float", [8.0, 16]),
    )
    def test_bad_boundaries_are_refused(self, boundaries):
        with self.assertRaisesRegex(ValueError, "bucket_boundaries"):
            self._plan(bucket_boundaries=boundaries)

    def test_an_estimate_without_lengths_is_refused(self):
        flat = _estimate(length=None, length_coefficients=())
        with self.assertRaisesRegex(ValueError, "made with `lengths`"):
            self._plan(estimate=flat)

    def test_max_tokens_too_few_for_the_longest_bucket_is_refused(self):
        with self.assertRaisesRegex(
            ValueError,
            r"`max_tokens` must hold a batch of 1 \(`multiple`\) of the "
            r"longest bucket's examples, padded to 104: at least 104\. "
            r"Received: max_tokens=100",
        ):
            self._plan(max_tokens=100)

    def test_max_batch_size_below_the_multiple_is_refused(self):
        with self.assertRaisesRegex(ValueError, "`max_batch_size` must be"):
            self._plan(max_batch_size=4, multiple=8)

    def test_an_example_that_fits_not_even_alone_is_named(self):
        # About 800 MB left at 90%, 1 KiB a token: some 800,000 tokens.
        long = tf.data.Dataset.from_generator(
            lambda: iter([(np.zeros(900_000, "int32"), 0)]),
            output_signature=(
                tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([], tf.int32),
            ),
        )
        with self.assertRaisesRegex(
            ValueError, "length 900000, .* the longest that fits is [0-9]{6}\\."
        ):
            self._plan(long)
