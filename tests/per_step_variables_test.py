"""Tests for steps without Grappler's `AddN` rewrite
(`_per_step_variables.py`): the scope's nesting, and that every retried
attempt and its recovery run inside it. What the rewrite did after an
error is recovery_test's `fixed_shape_batch_search_under_cap`.
"""

import _models
import keras
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.python.eager import context

import tfmemsafe
from tfmemsafe import _per_step_variables
from tfmemsafe import testing
from tfmemsafe.planning import _retry

_REWRITER = rewriter_config_pb2.RewriterConfig


def _memory_optimization():
    options = context.context().function_call_options
    config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
    return config.graph_options.rewrite_options.memory_optimization


def options_set_inside_stay():
    """Whether options that the user set inside a scope outlive it."""
    with _per_step_variables.without_per_step_variables():
        tf.config.optimizer.set_experimental_options({"layout_optimizer": True})
        theirs = context.context().function_call_options
    return context.context().function_call_options is theirs


class _Seen(keras.callbacks.Callback):
    """The memory optimization each batch of every phase ran with."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def _record(self, batch, logs=None):
        self.seen.add(_memory_optimization())

    on_train_batch_begin = on_test_batch_begin = _record
    on_predict_batch_begin = _record


class PerStepVariablesTest(tf.test.TestCase):
    def test_scopes_turn_the_rewrite_off_and_the_outermost_puts_it_back(self):
        found = context.context().function_call_options
        self.assertEqual(_memory_optimization(), _REWRITER.DEFAULT_MEM_OPT)
        with _per_step_variables.without_per_step_variables():
            with _per_step_variables.without_per_step_variables():
                self.assertEqual(
                    _memory_optimization(), _REWRITER.SWAPPING_HEURISTICS
                )
            self.assertEqual(
                _memory_optimization(), _REWRITER.SWAPPING_HEURISTICS
            )
        self.assertIs(context.context().function_call_options, found)

    def test_options_set_inside_stay(self):
        # Grappler's options are the process's: changed in a child.
        self.assertTrue(testing.run_in_subprocess(options_set_inside_stay))

    def test_every_attempt_and_recovery_runs_without_the_rewrite(self):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        seen = []

        def attempt():
            seen.append(("attempt", _memory_optimization()))
            if len(seen) == 1:
                raise tf.errors.ResourceExhaustedError(
                    None, None, "OOM when allocating tensor"
                )
            return "done"

        def recover(failure):
            seen.append(("recover", _memory_optimization()))

        result = _retry.retry_on_oom(model, attempt, lambda err: 0, recover)
        self.assertEqual(result, "done")
        swapping = _REWRITER.SWAPPING_HEURISTICS
        self.assertEqual(
            seen,
            [
                ("attempt", swapping),
                ("recover", swapping),
                ("attempt", swapping),
            ],
        )
        self.assertEqual(_memory_optimization(), _REWRITER.DEFAULT_MEM_OPT)

    def test_fit_evaluate_and_predict_run_without_the_rewrite(self):
        model = _models.dense_model()
        x, y = _models.table(32)
        seen = _Seen()
        tfmemsafe.fit(
            model,
            (x, y),
            batch_size=8,
            validation_data=(x, y),
            preflight=False,
            verbose=0,
            callbacks=[seen],
        )
        tfmemsafe.evaluate(
            model, (x, y), batch_size=8, verbose=0, callbacks=[seen]
        )
        tfmemsafe.predict(model, x, batch_size=8, verbose=0, callbacks=[seen])
        self.assertEqual(seen.seen, {_REWRITER.SWAPPING_HEURISTICS})
        self.assertEqual(_memory_optimization(), _REWRITER.DEFAULT_MEM_OPT)

    def test_memory_probes_run_without_the_rewrite(self):
        from unittest import mock

        from tfmemsafe.estimate import _probe

        model = _models.dense_model()
        x, y = _models.table(64)
        seen = []
        steps = _probe.Probe._steps

        def recorded(probe, *args, **kwargs):
            seen.append(_memory_optimization())
            return steps(probe, *args, **kwargs)

        with mock.patch.object(_probe.Probe, "_steps", recorded):
            try:
                tfmemsafe.estimate_memory(model, (x, y), batch_sizes=[4, 8])
            except tfmemsafe.MemoryEstimateError:
                pass  # No statistics here: the probes ran all the same.
        self.assertNotEmpty(seen)
        self.assertEqual(set(seen), {_REWRITER.SWAPPING_HEURISTICS})
        self.assertEqual(_memory_optimization(), _REWRITER.DEFAULT_MEM_OPT)


if __name__ == "__main__":
    tf.test.main()
