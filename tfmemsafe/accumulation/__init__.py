"""Exact gradient accumulation: the update of a big batch, in small steps.

Owns `GradientAccumulator` (the window of summed gradients, loss-scale
aware, under any `tf.distribute` strategy), `AccumulatingModel` (a
`keras.Model` whose `train_step` applies one update per
`accumulation_steps` micro-batches) and `with_gradient_accumulation`,
and the two fixes that let Keras 3 train such a model under
`MultiWorkerMirroredStrategy`.
"""

from tfmemsafe.accumulation._accumulator import GradientAccumulator
from tfmemsafe.accumulation._model import AccumulatingModel
from tfmemsafe.accumulation._model import accumulation_steps_of
from tfmemsafe.accumulation._model import window_closes_by_size
from tfmemsafe.accumulation._wrapping import with_gradient_accumulation

__all__ = [
    "AccumulatingModel",
    "GradientAccumulator",
    "accumulation_steps_of",
    "window_closes_by_size",
    "with_gradient_accumulation",
]
