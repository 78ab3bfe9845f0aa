"""Each private Keras or TensorFlow name `tfmemsafe._compat` reads,
checked against the installed release: one that moves a name fails here,
loudly, before it changes what tfmemsafe does."""

import contextlib
import importlib
import warnings
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import AccumulatingModel
from tfmemsafe import _compat
from tfmemsafe import testing
from tfmemsafe import with_gradient_accumulation


def _nested():
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.5),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    return keras.Model(inputs, keras.layers.Dense(2)(inner(inputs)))


def _coordination_service():
    """A worker of `testing.run_workers`: its coordination service's
    settings once the strategy has started it, and an all-reduce."""
    from tensorflow.python.eager import context

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    total = strategy.reduce(
        "SUM", strategy.run(lambda: tf.constant(1.0)), axis=None
    )
    config = context.context().coordination_service
    return {
        "heartbeat_timeout_in_ms": config.heartbeat_timeout_in_ms,
        "leader": config.service_leader,
        "jobs": [(j.name, j.num_tasks) for j in config.coordinated_job_list],
        "sum": float(total),
    }


@contextlib.contextmanager
def _without(module: str, name: str):
    """`module` without `name`, as a release that moved it."""
    namespace = importlib.import_module(module).__dict__
    with mock.patch.dict(namespace):
        del namespace[name]
        yield


class PrivateNamesTest(tf.test.TestCase):
    def test_nested_layers_reach_inside_a_nested_model(self):
        self.assertTrue(hasattr(keras.layers.Layer, "_flatten_layers"))
        names = [
            type(layer).__name__ for layer in _compat.nested_layers(_nested())
        ]
        self.assertIn("BatchNormalization", names)
        self.assertIn("Dropout", names)

    def test_own_non_trainable_variables_are_the_moving_statistics(self):
        layer = keras.layers.BatchNormalization()
        layer.build((None, 3))
        self.assertTrue(hasattr(layer, "_non_trainable_variables"))
        names = {v.name for v in _compat.own_non_trainable_variables(layer)}
        self.assertEqual(names, {"moving_mean", "moving_variance"})

    def test_seed_generator_states_of_a_dropout(self):
        layer = keras.layers.Dropout(0.5)
        self.assertTrue(hasattr(layer, "_seed_generators"))
        (state,) = _compat.seed_generator_states(layer)
        before = np.array(state.numpy())
        layer(tf.ones((2, 3)), training=True)
        self.assertNotAllEqual(before, state.numpy())

    def test_a_keras_mask_is_read(self):
        from keras.src.backend.common.masking import get_keras_mask  # noqa: F401

        masked = keras.layers.Masking(0.0)(tf.constant([[[0.0], [1.0]]]))
        self.assertTrue(_compat.has_keras_mask(masked))
        self.assertFalse(_compat.has_keras_mask(tf.ones((1, 2))))

    def test_the_cached_validation_iterator_is_dropped(self):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        x = np.zeros((8, 4), "float32")
        stop = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: 1 / 0
        )
        with self.assertRaises(ZeroDivisionError):
            model.fit(
                x,
                x[:, :1],
                validation_data=(x, x[:, :1]),
                callbacks=[stop],
                verbose=0,
            )
        # A fit that raised leaves it behind.
        self.assertIsNotNone(model._eval_epoch_iterator)  # noqa: SLF001
        _compat.drop_cached_validation_iterator(model)
        self.assertIsNone(model._eval_epoch_iterator)  # noqa: SLF001

    def test_the_compiled_loss_and_metrics_are_read(self):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=["mae"])
        parts = _compat.compiled_loss_and_metrics(model)
        self.assertLen(parts, 2)
        self.assertIsInstance(parts[1], keras.losses.Loss)

    def test_the_per_output_losses_are_means_of_total_and_count(self):
        # What a split batch's per-output loss logs are put back from
        # (`recovery/_output_losses.py`).
        inputs = keras.Input((4,))
        model = keras.Model(
            inputs,
            {
                "a": keras.layers.Dense(1, name="a")(inputs),
                "b": keras.layers.Dense(1, name="b")(inputs),
            },
        )
        model.compile("sgd", {"a": "mse", "b": "mse"})
        x = np.zeros((4, 4), "float32")
        model.fit(x, {"a": x[:, :1], "b": x[:, :1]}, verbose=0)
        metrics = _compat.compiled_loss_and_metrics(model)[1].metrics
        self.assertEqual([m.name for m in metrics], ["a_loss", "b_loss"])
        for metric in metrics:
            self.assertIsInstance(metric, keras.metrics.Mean)
            names = sorted(v.name for v in metric.variables)
            self.assertEqual(names, ["count", "total"])

    def test_one_process_is_not_in_multi_worker_mode(self):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        self.assertTrue(
            hasattr(strategy.extended, "_in_multi_worker_mode"),
        )
        self.assertFalse(_compat.in_multi_worker_mode(strategy))

    def test_keras_scopes_are_read(self):
        self.assertFalse(_compat.in_symbolic_scope())
        self.assertFalse(_compat.in_stateless_scope())
        with keras.SymbolicScope():
            self.assertTrue(_compat.in_symbolic_scope())
        with keras.StatelessScope():
            self.assertTrue(_compat.in_stateless_scope())

    def test_autocast_off_reads_a_mixed_layers_variable_as_stored(self):
        layer = keras.layers.Dense(2, dtype="mixed_float16")
        layer.build((None, 3))
        from keras.src.backend.common.variables import AutocastScope

        with AutocastScope("float16"):
            self.assertEqual(layer.kernel.value.dtype, tf.float16)
            with _compat.autocast_off():
                self.assertEqual(layer.kernel.value.dtype, tf.float32)

    def test_the_global_seed_generator_is_made_and_read(self):
        known, generator = _compat.global_seed_generator(create=True)
        self.assertTrue(known)
        self.assertIsInstance(generator, keras.random.SeedGenerator)
        before = np.array(generator.state.numpy())
        keras.random.normal((2,))  # Unseeded: draws from it.
        self.assertNotAllEqual(before, generator.state.numpy())
        self.assertIs(_compat.global_seed_generator()[1], generator)

    def test_onednn_is_read_from_tensorflow(self):
        from tensorflow.python.util import _pywrap_util_port

        self.assertEqual(
            _compat.onednn_enabled(), bool(_pywrap_util_port.IsMklEnabled())
        )

    def test_the_eager_context_is_started_here_and_not_in_a_fresh_process(
        self,
    ):
        from tfmemsafe import testing

        tf.constant(1.0)  # Starts it.
        self.assertTrue(_compat.eager_context_started())
        self.assertFalse(
            testing.run_in_subprocess("tfmemsafe._compat:eager_context_started")
        )

    def test_a_pipeline_is_walked_to_its_sources(self):
        rows = tf.data.Dataset.range(8)
        batched = rows.batch(2)
        (inner,) = _compat.dataset_inputs(batched)
        self.assertEqual(int(inner.cardinality()), 8)
        zipped = tf.data.Dataset.zip((batched, rows))
        self.assertLen(_compat.dataset_inputs(zipped), 2)
        self.assertEmpty(_compat.dataset_inputs(rows))

    def test_transformation_arguments_are_read(self):
        rows = tf.data.Dataset.range(8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            batched = rows.batch(3, drop_remainder=True)
            self.assertEqual(
                int(_compat.transformation_argument(batched, "batch_size")), 3
            )
            self.assertTrue(
                bool(_compat.transformation_argument(batched, "drop_remainder"))
            )
            fetched = rows.prefetch(5)
            self.assertEqual(
                int(_compat.transformation_argument(fetched, "buffer_size")), 5
            )

    def test_function_call_options_are_read_and_set(self):
        found = _compat.function_call_options()
        config = tf.compat.v1.ConfigProto.FromString(
            found.config_proto_serialized
        )
        config.graph_options.rewrite_options.memory_optimization = 4
        made = _compat.make_function_call_options(found.executor_type, config)
        try:
            _compat.set_function_call_options(made)
            now = _compat.function_call_options()
            self.assertEqual(
                now.config_proto_serialized, made.config_proto_serialized
            )
        finally:
            _compat.set_function_call_options(found)
        self.assertEqual(
            _compat.function_call_options().config_proto_serialized,
            found.config_proto_serialized,
        )

    def test_stop_recording_pauses_every_tape(self):
        x = tf.constant(2.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            with _compat.stop_recording():
                y = x * x
        self.assertIsNone(tape.gradient(y, x))

    def test_one_process_is_one_worker(self):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        self.assertTrue(hasattr(strategy.extended, "_num_workers"))
        self.assertEqual(_compat.num_workers(strategy), 1)
        from tensorflow.python.eager import context

        self.assertTrue(callable(context.context().report_error_to_cluster))

    def test_workers_coordination_service_waits_a_minute(self):
        for worker in testing.run_workers(_coordination_service, 2):
            self.assertEqual(worker["heartbeat_timeout_in_ms"], 60_000)
            self.assertEqual(worker["leader"], "/job:worker/replica:0/task:0")
            self.assertEqual(worker["jobs"], [["worker", 2]])
            self.assertEqual(worker["sum"], 2.0)

    def test_a_cluster_without_chief_or_worker_is_not_coordinated(self):
        from tensorflow.python.eager import context

        evaluators = tf.train.ClusterSpec({"evaluator": ["localhost:1"]})
        self.assertFalse(_compat.configure_coordination_service(evaluators, 60))
        self.assertIsNone(
            getattr(context.context(), "coordination_service", None)
        )

    def test_cross_replica_calls_once_with_the_strategy(self):
        from tensorflow.python.distribute import merge_call_interim

        self.assertIs(
            merge_call_interim.maybe_merge_call,
            tf.__internal__.distribute.interim.maybe_merge_call,
        )
        calls = []
        self.assertEqual(_compat.cross_replica(calls.append), None)
        self.assertEqual(calls, [tf.distribute.get_strategy()])

    def test_custom_gradients_traced_inside_are_recorded_and_forgotten(self):
        from tensorflow.python.framework import ops

        @tf.custom_gradient
        def doubled(x):
            return 2 * x, lambda dy: 2 * dy

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = doubled(x)
            return tape.gradient(y, x)

        names = []
        with _compat.recording_custom_gradients(names):
            self.assertEqual(float(step(tf.constant(1.0))), 2.0)
        self.assertLen(names, 1)
        self.assertIn(names[0], ops._gradient_registry._registry)  # noqa: SLF001
        recorded = names[0]
        _compat.forget_custom_gradients(names)
        self.assertEmpty(names)
        self.assertNotIn(
            recorded,
            ops._gradient_registry._registry,  # noqa: SLF001
        )

    def test_functional_class_is_that_of_a_model_of_inputs_and_outputs(self):
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        self.assertIs(type(model), _compat.functional_class())

    def test_a_name_saved_under_is_not_loaded_back_as_the_class(self):
        class Variant(keras.layers.Layer):
            pass

        _compat.save_under_name(Variant, "tests>Registered")
        self.assertEqual(
            keras.saving.get_registered_name(Variant), "tests>Registered"
        )
        self.assertIsNone(
            keras.saving.get_registered_object("tests>Registered")
        )

    def test_keras_default_marks_a_method_keras_may_replace(self):
        from keras.src.utils import python_utils

        def get_config(self):
            return {}

        marked = _compat.keras_default(get_config)
        self.assertTrue(python_utils.is_default(marked))


class FallbackTest(tf.test.TestCase):
    """Where a name is gone, a warning, and the reading that refuses."""

    def setUp(self):
        super().setUp()
        _compat._warned.clear()  # noqa: SLF001

    def test_a_missing_walk_warns_and_gives_the_top_layers(self):
        class Bare:
            layers = ["a", "b"]

        with self.assertWarnsRegex(RuntimeWarning, "_flatten_layers"):
            self.assertEqual(_compat.nested_layers(Bare()), ["a", "b"])

    def test_a_missing_compiled_loss_counts_the_model_as_not_built(self):
        with self.assertWarnsRegex(RuntimeWarning, "_compile_loss"):
            self.assertEqual(_compat.compiled_loss_and_metrics(object()), [])

    def test_a_missing_multi_worker_mode_counts_the_cluster(self):
        class Extended:
            pass

        class Strategy:
            extended = Extended()
            cluster_resolver = None

        with self.assertWarnsRegex(RuntimeWarning, "_in_multi_worker_mode"):
            self.assertFalse(_compat.in_multi_worker_mode(Strategy()))

    def test_missing_scopes_leave_a_checkpointed_layer_unchecked(self):
        from tfmemsafe.checkpointing import Checkpointed

        layer = Checkpointed(keras.layers.Dense(2))
        layer.build((None, 3))
        x = tf.ones((4, 3))
        for module, name in (
            ("keras.src.backend.common.variables", "AutocastScope"),
            ("keras.src.random.seed_generator", "global_seed_generator"),
        ):
            with (
                _without(module, name),
                self.assertWarnsRegex(RuntimeWarning, name),
            ):
                self.assertAllClose(layer(x), layer.layer(x))
        for name in ("in_symbolic_scope", "in_stateless_scope"):
            module = f"keras.src.backend.common.{name[3:]}"
            with (
                _without(module, name),
                self.assertWarnsRegex(RuntimeWarning, name),
            ):
                self.assertTrue(getattr(_compat, name)())

    def test_without_stop_recording_checkpointing_keeps_its_gradients(
        self,
    ):
        from tfmemsafe.checkpointing import Checkpointed

        layer = Checkpointed(keras.layers.Dense(2))
        layer.build((None, 3))
        x = tf.random.normal((4, 3))
        gradients = []
        for gone in (False, True):
            with contextlib.ExitStack() as stack:
                if gone:
                    stack.enter_context(
                        _without(
                            "tensorflow.python.eager.record", "stop_recording"
                        )
                    )
                    stack.enter_context(
                        self.assertWarnsRegex(RuntimeWarning, "stop_recording")
                    )
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(layer(x) ** 2)
                gradients.append(tape.gradient(loss, layer.trainable_variables))
        for with_it, without in zip(*gradients, strict=True):
            self.assertAllClose(with_it, without)

    def test_a_missing_worker_count_counts_the_cluster(self):
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        count = strategy.extended._num_workers
        del strategy.extended._num_workers
        try:
            with self.assertWarnsRegex(RuntimeWarning, "_num_workers"):
                self.assertEqual(_compat.num_workers(strategy), 1)
        finally:
            strategy.extended._num_workers = count

    def test_without_the_service_settings_tensorflows_default_stays(self):
        with mock.patch(
            "tensorflow.python.eager.context.context", return_value=object()
        ):
            with self.assertWarnsRegex(
                RuntimeWarning, "configure_coordination_service"
            ):
                self.assertFalse(
                    _compat.configure_coordination_service(None, 60)
                )

    def test_other_strategies_are_one_worker_without_a_warning(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertEqual(
                _compat.num_workers(tf.distribute.get_strategy()), 1
            )

    def test_without_maybe_merge_call_each_replica_calls(self):
        calls = []
        with (
            _without(
                "tensorflow.python.distribute.merge_call_interim",
                "maybe_merge_call",
            ),
            self.assertWarnsRegex(RuntimeWarning, "maybe_merge_call"),
        ):
            _compat.cross_replica(calls.append)
        self.assertEqual(calls, [tf.distribute.get_strategy()])

    def test_without_the_gradient_registry_nothing_is_recorded(self):
        names = []
        with (
            _without("tensorflow.python.framework.ops", "_gradient_registry"),
            self.assertWarnsRegex(RuntimeWarning, "_gradient_registry"),
            _compat.recording_custom_gradients(names),
        ):
            pass
        self.assertEmpty(names)

    def test_without_a_transformation_argument_it_is_unknown(self):
        with self.assertWarnsRegex(RuntimeWarning, "_batch_size"):
            self.assertIsNone(
                _compat.transformation_argument(object(), "batch_size")
            )

    def test_without_the_pipeline_walk_batches_are_not_recognised(self):
        from tfmemsafe import _pipelines

        source = tf.data.Dataset.range(2)
        _compat._dataset_walk_works.cache_clear()  # noqa: SLF001
        try:
            with (
                mock.patch.object(
                    tf.data.Dataset, "batch", lambda self, *a, **k: source
                ),
                self.assertWarnsRegex(RuntimeWarning, "_input_dataset"),
            ):
                self.assertEmpty(_compat.dataset_inputs(source.map(abs)))
            batched = source.batch(2).map(abs)
            self.assertEqual(_pipelines.batching_of(batched), (False, None))
        finally:
            _compat._dataset_walk_works.cache_clear()  # noqa: SLF001
        self.assertEqual(_pipelines.batching_of(batched), (True, 2))

    def test_without_function_call_options_the_rewrite_stays(self):
        from tensorflow.python.eager import context

        with (
            mock.patch.object(
                type(context.context()), "function_call_options", None
            ),
            self.assertWarnsRegex(RuntimeWarning, "function_call_options"),
        ):
            self.assertIsNone(_compat.function_call_options())

    def test_without_the_functional_class_it_says_what_to_use_instead(self):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(2)(inputs)
        with (
            _without("keras.src.models.functional", "Functional"),
            self.assertWarnsRegex(RuntimeWarning, "Functional"),
            self.assertRaisesRegex(
                NotImplementedError, "with_gradient_accumulation"
            ),
        ):
            AccumulatingModel(inputs, outputs, accumulation_steps=2)
        # The way it names still works there: the model is wrapped.
        model = keras.Model(inputs, outputs)
        with _without("keras.src.models.functional", "Functional"):
            wrapped = with_gradient_accumulation(model, 2)
        self.assertEqual(wrapped.accumulation_steps, 2)

    def test_without_the_custom_names_a_variant_keeps_its_own_name(self):
        class Variant(keras.layers.Layer):
            pass

        with (
            _without(
                "keras.src.saving.object_registration", "GLOBAL_CUSTOM_NAMES"
            ),
            self.assertWarnsRegex(RuntimeWarning, "custom_objects"),
        ):
            _compat.save_under_name(Variant, "tests>Other")
        self.assertNotEqual(
            keras.saving.get_registered_name(Variant), "tests>Other"
        )

    def test_without_the_default_marker_the_method_is_unmarked(self):
        def get_config(self):
            return {}

        with (
            _without("keras.src.utils.python_utils", "default"),
            self.assertWarnsRegex(RuntimeWarning, "python_utils.default"),
        ):
            self.assertIs(_compat.keras_default(get_config), get_config)

    def test_a_missing_mask_reader_takes_every_output_as_masked(self):
        with (
            _without("keras.src.backend.common.masking", "get_keras_mask"),
            mock.patch.object(_compat, "_version", return_value=(3, 20)),
            self.assertWarnsRegex(RuntimeWarning, "get_keras_mask"),
        ):
            self.assertTrue(_compat.has_keras_mask(tf.ones((1, 2))))


if __name__ == "__main__":
    tf.test.main()
