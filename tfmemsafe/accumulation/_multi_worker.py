"""Training under `MultiWorkerMirroredStrategy`, where Keras 3 alone fails.

Keras 3.15's TensorFlow trainer fails before the first step when a plain
`keras.Model` is fit under `tf.distribute.MultiWorkerMirroredStrategy`
(keras-team/keras#20585, tensorflow/tensorflow#72388), at two points:

1. `_maybe_symbolic_build` takes a sample batch with
   `strategy.reduce("MEAN", per_replica_batch, axis=None)` outside any
   function, which the collective strategy cannot convert to a tensor.
2. `reduce_per_replica` reduces every log with
   `strategy.reduce("MEAN", value, axis=0)` when it runs on several
   workers, which fails for scalar logs ("Invalid reduction dimension 0
   for input with 0 dimensions").

`MultiWorkerSupport` fixes both on our own model class, without touching
Keras: it builds from one replica's part of the batch, and gives each
scalar log a leading axis of length 1 so that Keras' reduction averages
it over the workers and returns a scalar again. Every other step (the
gradient all-reduce, metrics, `evaluate`, `predict`) is Keras' own.
"""

from __future__ import annotations

import tensorflow as tf

from tfmemsafe.distribute import is_multi_worker


class MultiWorkerSupport:
    """Lets a `keras.Model` subclass train under MultiWorkerMirroredStrategy.

    A mixin placed before `keras.Model` in the bases. On one machine
    nothing changes.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if (
            iterator is None
            or strategy is None
            or not is_multi_worker(strategy)
        ):
            return super()._maybe_symbolic_build(
                iterator=iterator, data_batch=data_batch
            )
        # Keras averages the replicas' batches to get a sample batch; the
        # collective strategy cannot do that eagerly. One replica's part
        # has the same structure, which is all building needs.
        for _, _, epoch_iterator in iterator:
            batch = next(epoch_iterator)
            data_batch = tf.nest.map_structure(
                lambda value: (
                    strategy.experimental_local_results(value)[0]
                    if isinstance(value, tf.distribute.DistributedValues)
                    else value
                ),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    def _make_function(self, step_function):
        if not is_multi_worker(self.distribute_strategy):
            return super()._make_function(step_function)

        def step_with_vector_logs(data):
            return tf.nest.map_structure(
                _as_vector_if_scalar, step_function(data)
            )

        return super()._make_function(step_with_vector_logs)


def _as_vector_if_scalar(value):
    value = tf.convert_to_tensor(value)
    return tf.reshape(value, [1]) if value.shape.rank == 0 else value
