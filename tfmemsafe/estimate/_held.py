"""What a device holds besides the step's own tensors: the model's state,
the gradient sums of a split, the data's tensors, and what else is in
use now."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import memory
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe._model_state import optimizers_of


def state_bytes(model) -> int:
    """Bytes of the model's variables, its metrics' and its optimizers'.

    What stays in memory between steps, on each replica device: counted,
    so the same in every process.
    """
    variables = [*model.variables, *model.metrics_variables]
    for optimizer in optimizers_of(model):
        variables += optimizer.variables
    for accumulator in gradient_accumulators_of(model):
        variables += accumulator.state_variables()
    return _bytes_of(variables)


def gradient_bytes(model) -> int:
    """Bytes of one gradient of every trainable variable of the model:
    what a split's gradient sums take."""
    return _bytes_of(model.trainable_variables)


def _bytes_of(variables) -> int:
    seen, total = set(), 0
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        dtype = tf.as_dtype(keras.backend.standardize_dtype(variable.dtype))
        total += int(np.prod(variable.shape, dtype=np.int64)) * dtype.size
    return total


def data_on(device, source) -> int:
    """The bytes of `source`'s tensors that `device`'s memory holds all
    through a run: arrays' (`Arrays.resident_bytes`), in host memory, so
    on a CPU; none on an accelerator, nor for a pipeline's batches."""
    return source.resident_bytes() if _is_host(device) else 0


def data_held_on(device, source) -> int:
    """Of `data_on`, what `device`'s memory holds now: nothing before the
    arrays are converted, nor between Keras' own conversions."""
    return source.resident_bytes_now() if _is_host(device) else 0


def _is_host(device) -> bool:
    return memory.device_name(device).startswith("CPU:")


def current_bytes(device) -> int:
    return memory.memory_info(device, include_limit=False).current_bytes or 0


def held_bytes(device, state_bytes: int) -> int:
    """What is in use on `device` besides the model's state, now."""
    return max(current_bytes(device) - state_bytes, 0)
