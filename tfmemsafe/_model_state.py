"""Everything a training step changes in a model, saved to put back.

`estimate_memory` trains at its probe sizes and then puts the model back
exactly with a `ModelState`. Unlike `_resume.Snapshot` (the weights and
optimizer state `fit` restores after a failed epoch), it also keeps the
accumulation windows whole, the global seed generator and each
per-replica part of a distributed variable, and the attributes `fit`
replaces.
"""

from __future__ import annotations

import keras
import numpy as np

from tfmemsafe._resume import gradient_accumulators_of
from tfmemsafe._resume import optimizers_of

# Keras has no public name for the generator that `keras.random` draws
# from when no seed is given.
from keras.src.backend.common import global_state  # isort: skip


class ModelState:
    """Everything a training step changes in a model, to put back exactly.

    The variables of the model, its metrics, its optimizers (the compiled
    one and any held as attributes) and gradient accumulators (the whole
    window, not reset), and the global random-seed generator; and the
    attributes `fit` replaces: `history`, the compiled functions,
    `stop_training`. Each per-replica part of a distributed variable is
    saved on its own.
    """

    _ATTRIBUTES = (
        "history",
        "train_function",
        "test_function",
        "predict_function",
        "stop_training",
    )

    def __init__(self, model: keras.Model):
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            # Its variables must exist to be saved, as `fit` would build it.
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        variables = [*model.variables, *model.metrics_variables]
        for optimizer in optimizers_of(model):
            variables += optimizer.variables
        for accumulator in gradient_accumulators_of(model):
            variables += accumulator.state_variables()
        generator = global_state.get_global_attribute("global_seed_generator")
        if generator is not None:
            variables.append(generator.state)
        self.model = model
        self.parts = []
        seen = set()
        for variable in variables:
            for part in _local_parts(variable):
                if id(part) not in seen:
                    seen.add(id(part))
                    self.parts.append((part, np.array(part.numpy(), copy=True)))
        self.attributes = {
            name: getattr(model, name, None) for name in self._ATTRIBUTES
        }

    def restore(self) -> None:
        for part, value in self.parts:
            part.assign(value)
        for name, value in self.attributes.items():
            setattr(self.model, name, value)
        # Keras' cached validation iterator; Keras has no public way to drop it.
        self.model._eval_epoch_iterator = None


def _local_parts(variable) -> list:
    """The variables that hold `variable`'s value: one per replica."""
    inner = getattr(variable, "value", None)
    if (
        not hasattr(variable, "values")
        and inner is not None
        and hasattr(inner, "assign")
    ):
        variable = inner  # A Keras variable: its TensorFlow variable.
    values = getattr(variable, "values", None)  # A distributed variable.
    if isinstance(values, tuple) and values and hasattr(values[0], "assign"):
        return list(values)
    return [variable]
