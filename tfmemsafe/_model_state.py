"""Everything a training step changes in a model, saved to put back.

`estimate_memory` trains at its probe sizes, `find_max_batch_size` at its
trials and `tfmemsafe.plan` at its candidates, and each then puts the
model back exactly with a `ModelState`: its weights, its optimizers'
state, the accumulation windows whole, the global seed generator and each
per-replica part of a distributed variable.

It keeps the values on disk, in a `DiskCopy` (see `_disk_copy`), so that
the host memory it takes does not grow with the model.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmemsafe import _compat
from tfmemsafe._disk_copy import DiskCopy
from tfmemsafe.accumulation import GradientAccumulator


class ModelState:
    """Everything a training step changes in a model, to put back exactly.

    The variables of the model, its metrics, its optimizers (the compiled
    one and any held as attributes) and gradient accumulators (the whole
    window, not reset), and the global random-seed generator; and the
    attributes `fit` replaces: `history`, the compiled functions,
    `stop_training`. Each per-replica part of a distributed variable is
    saved on its own. An optimizer held as an attribute and not yet built
    has no state to save; if a step builds it, `restore` says so.
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
        _, generator = _compat.global_seed_generator()
        if generator is not None:
            variables.append(generator.state)
        self.model = model
        self.unbuilt = [each for each in optimizers_of(model) if not each.built]
        parts = {}
        for variable in variables:
            for part in local_parts(variable):
                parts.setdefault(id(part), part)
        self.copy = DiskCopy([(part, [part]) for part in parts.values()])
        self.attributes = {
            name: getattr(model, name, None) for name in self._ATTRIBUTES
        }

    def restore(self) -> None:
        """Puts back the values and the attributes `fit` replaces."""
        self.restore_values()
        for name, value in self.attributes.items():
            setattr(self.model, name, value)
        _compat.drop_cached_validation_iterator(self.model)

    def restore_values(self) -> None:
        """Puts back the values alone: the compiled functions and their
        traces stay, for the next `fit` on the model."""
        self.copy.restore()
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

    def close(self) -> None:
        """Deletes the saved values; `restore` cannot be called after."""
        self.copy.close()


def local_parts(variable) -> list:
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
