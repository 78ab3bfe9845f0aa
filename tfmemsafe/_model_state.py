"""Everything a training step changes in a model, saved to put back.

`estimate_memory` trains at its probe sizes and then puts the model back
exactly with a `ModelState`. Unlike `Snapshot` (the weights and
optimizer state `fit` restores after a failed epoch), it also keeps the
accumulation windows whole, the global seed generator and each
per-replica part of a distributed variable, and the attributes `fit`
replaces.

Both keep the values in a `_DiskCopy`: files in a temporary directory,
written and read back in pieces of at most 16 MiB by TensorFlow ops. So
the host memory they take does not grow with the model (a host copy of
a 1B-parameter model's Adam state would be 12 GB), and putting a value
back never converts a host array to a tensor: that conversion ends the
process inside TensorFlow when memory is short, where an op raises.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import keras
import numpy as np
import tensorflow as tf
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
        parts = {}
        for variable in variables:
            for part in _local_parts(variable):
                parts.setdefault(id(part), part)
        self.copy = _DiskCopy([(part, [part]) for part in parts.values()])
        self.attributes = {
            name: getattr(model, name, None) for name in self._ATTRIBUTES
        }

    def restore(self) -> None:
        self.copy.restore()
        for name, value in self.attributes.items():
            setattr(self.model, name, value)
        # Keras' cached validation iterator; Keras has no public way to drop it.
        self.model._eval_epoch_iterator = None

    def close(self) -> None:
        """Deletes the saved values; `restore` cannot be called after."""
        self.copy.close()


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
    """A model's variables and its optimizers', saved to put back.

    The optimizers are the compiled one and any the model holds as
    attributes (a GAN's `generator_optimizer`, say). Under `tf.distribute`
    a mirrored variable is read once (from its first replica) and put
    back on every replica.
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
        unique = {id(v): v for v in variables}.values()
        self.copy = _DiskCopy(
            [(parts[0], parts) for parts in map(_local_parts, unique)]
        )

    def restore(self) -> None:
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
        # An `AccumulatingModel`'s partial window is state too; at the start
        # of an epoch it is empty.
        for accumulator in gradient_accumulators_of(self.model):
            accumulator.reset()

    def close(self) -> None:
        """Deletes the saved values; `restore` cannot be called after."""
        self.copy.close()


# The largest piece of a variable written or read at once: the host (and,
# on a GPU, the device) memory a copy needs beyond the model.
_PIECE_BYTES = 16 * 2**20


class _DiskCopy:
    """Variables' values in files, to put back in pieces.

    Each piece is a row range of one variable, written by TensorFlow's
    checkpoint writer (`SaveV2`) straight from the variable's memory on a
    CPU: a slice of whole rows is a view there, and the writer copies
    nothing to host memory. On a GPU each piece is copied to the host
    before it is written, one at a time.

    Args:
        entries: list of `(source, targets)`: the `tf.Variable` read, and
            the `tf.Variable`s its value is put back into.
    """

    def __init__(self, entries):
        self.directory = tempfile.mkdtemp(prefix="tfmemsafe-state-")
        # Deleted with this object at the latest, also after an exception.
        self._delete = weakref.finalize(
            self, shutil.rmtree, self.directory, ignore_errors=True
        )
        self.pieces = []
        for source, targets in entries:
            value = source.read_value()
            for begin, end in _pieces(value):
                path = os.path.join(self.directory, str(len(self.pieces)))
                piece = value if begin is None else value[begin:end]
                tf.raw_ops.SaveV2(
                    prefix=path,
                    tensor_names=["value"],
                    shape_and_slices=[""],
                    tensors=[piece],
                )
                self.pieces.append((path, source.dtype, begin, end, targets))
            del value

    def restore(self) -> None:
        for path, dtype, begin, end, targets in self.pieces:
            (piece,) = tf.raw_ops.RestoreV2(
                prefix=path,
                tensor_names=["value"],
                shape_and_slices=[""],
                dtypes=[dtype],
            )
            for target in targets:
                if begin is None:
                    target.assign(piece)
                else:
                    target[begin:end].assign(piece)

    def close(self) -> None:
        self._delete()


def _pieces(value) -> list:
    """`(begin, end)` row ranges of `value` of at most `_PIECE_BYTES`.

    `(None, None)` for the whole value: a scalar, or one that small. A
    single row larger than that is one piece.
    """
    size = value.dtype.size * int(np.prod(value.shape))
    if value.shape.rank == 0 or size <= _PIECE_BYTES:
        return [(None, None)]
    rows = value.shape[0]
    per_piece = max(1, _PIECE_BYTES * rows // size)
    return [
        (begin, min(rows, begin + per_piece))
        for begin in range(0, rows, per_piece)
    ]


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
