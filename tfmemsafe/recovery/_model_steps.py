"""The model's own train, test and predict steps, compiled once for a run
of `SplitBatchOnOOM`: `ModelSteps`."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmemsafe.recovery._held_batches import local_shares
from tfmemsafe.recovery._held_batches import sliced
from tfmemsafe.recovery._held_batches import without_optionals


class ModelSteps:
    """`model.train_step`, `test_step` and `predict_step`, each run under
    the model's strategy, compiled as Keras compiles them (not for a model
    that runs eagerly).

    Args:
        model: The compiled `keras.Model`.
    """

    def __init__(self, model):
        self.model = model
        self.strategy = model.distribute_strategy
        self._traced = set()  # The steps traced on the data's spec.
        self._spec_rows = {}  # The rows of the spec each was traced on.
        self._steps = {}
        for name, step in (
            ("train", model.train_step),
            ("test", model.test_step),
            ("predict", model.predict_step),
        ):

            def run(data, step=step):
                return self.strategy.run(step, args=(data,))

            if not model.run_eagerly:
                # Not converted by AutoGraph, as Keras compiles its own
                # step: its errors reach the user as Keras' would.
                run = tf.function(
                    run,
                    autograph=False,
                    reduce_retracing=True,
                    jit_compile=model.jit_compile is True,
                )
            self._steps[name] = run

    def __call__(self, name: str, data):
        """The `name` step's per-replica outputs on `data`."""
        return self._steps[name](data)

    def trace_on(self, name: str, iterator) -> None:
        """Traces the `name` step once for the data's own element spec,
        as Keras traces its step on the iterator, before a batch of
        known rows comes: what Keras reads from a batch's static shape
        (the rows a multi-output model's per-output losses are averaged
        by) is then what it reads under Keras' own step."""
        if (
            name in self._traced
            or self.strategy.num_replicas_in_sync > 1
            or self.model.run_eagerly
        ):
            return
        self._traced.add(name)
        spec = getattr(iterator, "element_spec", None)
        if spec is not None:
            spec = without_optionals(spec)
            self._steps[name].get_concrete_function(spec)
            self._spec_rows[name] = tf.nest.flatten(spec)[0].shape[0]

    def static_rows(self, name: str, rows: int) -> int | None:
        """The rows of a batch of `rows` that the `name` step's static
        shapes show, as Keras' step would see them: all of them when it
        runs eagerly, the data's static batch size when it was traced on
        the data's spec, else `None` (unknown)."""
        if self.model.run_eagerly:
            return rows
        return self._spec_rows.get(name)

    def build_optimizer(self, batch) -> None:
        """Builds the optimizer before the first step: built in that
        step's trace, a step that ran out would leave it unusable. A model
        not built yet (subclassed, or without an `Input`) is built first,
        by its call on one example of `batch`, as Keras' first step
        would."""
        optimizer = self.model.optimizer
        if optimizer is None or optimizer.built:
            return
        if not self.model.built:
            x = keras.utils.unpack_x_y_sample_weight(batch)[0]
            one = sliced(local_shares(x, self.strategy)[0], 0, 1)
            self.model(one, training=False)
        with self.strategy.scope():
            optimizer.build(self.model.trainable_variables)
