"""Everything a training step changes in a model, saved to put back.

`estimate_memory` trains at its probe sizes and then puts the model back
exactly with a `ModelState`. Unlike `Snapshot` (the weights and
optimizer state `fit` restores after a failed epoch), it also keeps the
accumulation windows whole, the global seed generator and each
per-replica part of a distributed variable, and the attributes `fit`
replaces.
"""

from __future__ import annotations

import keras
import numpy as np
from absl import logging

from tfmemsafe.accumulation import GradientAccumulator

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


class Snapshot:
    """Host copies of a model's variables and its optimizers', to put back.

    The optimizers are the compiled one and any the model holds as
    attributes (a GAN's `generator_optimizer`, say). Copies are per
    variable, so under `tf.distribute` a mirrored variable is read once
    and assigned back to every replica.
    """

    def __init__(self, model: keras.Model):
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            # Its variables must exist to be saved (and restored to zeros).
            # Only the compiled optimizer is known to update exactly the
            # model's trainable variables; others are saved as they are.
            with model.distribute_strategy.scope():
                optimizer.build(model.trainable_variables)
        optimizers = optimizers_of(model)
        variables = list(model.variables)
        for each in optimizers:
            variables += each.variables
        self.model = model
        self.unbuilt = [each for each in optimizers if not each.built]
        self.variables = list({id(v): v for v in variables}.values())
        self.values = [np.array(v.numpy(), copy=True) for v in self.variables]

    def restore(self) -> None:
        for variable, value in zip(self.variables, self.values, strict=True):
            variable.assign(value)
        for optimizer in self.unbuilt:
            if optimizer.built:
                logging.warning(
                    "tfmemsafe: optimizer %r of %s was built after its "
                    "state was saved, so what it gathered since (such as "
                    "Adam's moments) is kept, not rewound. Build it in "
                    "`compile`.",
                    optimizer.name,
                    self.model.name,
                )
        self.unbuilt = [each for each in self.unbuilt if not each.built]
        # An `AccumulatingModel`'s partial window is state too; at the start
        # of an epoch it is empty.
        for accumulator in gradient_accumulators_of(self.model):
            accumulator.reset()


def gradient_accumulators_of(model) -> list:
    return [
        value
        for value in vars(model).values()
        if isinstance(value, GradientAccumulator)
    ]


def optimizers_of(model) -> list:
    """The compiled optimizer and those the model holds as attributes."""
    found = [model.optimizer, *vars(model).values()]
    optimizers = [o for o in found if isinstance(o, keras.optimizers.Optimizer)]
    return list({id(o): o for o in optimizers}.values())
