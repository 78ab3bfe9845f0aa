"""One replica's running sums for a window, and the window's cross-replica step.

`GradientAccumulator` keeps one `Window` per set of variables: the
gradient sums, sample total and micro-batch count of each replica, and
`apply_when_ready`, which decides in a cross-replica context whether the
window is full, and `apply_across_replicas`, which reduces the sums once
per window, checks a loss-scaled window for overflow, and applies or
skips it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

_SUM = tf.distribute.ReduceOp.SUM


class Window:
    """One replica's running sums for the current window.

    One zeroed accumulator per variable (float32 for half-precision ones),
    the window's sample total (what the mean divides by), its size (what
    an update budget counts: samples or tokens) and its micro-batch count,
    all local to each replica and reduced only when the window is applied
    or its size is asked; and which variables have received a gradient,
    learned while tracing.

    Args:
        variables: The variables whose gradients are accumulated, in the
            order the gradients come. Create it in the strategy's scope.
    """

    def __init__(self, variables):
        strategy = tf.distribute.get_strategy()
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
        )
        self.variables = variables
        self.has_gradient = [False] * len(variables)
        self.accumulators = []
        for variable in variables:
            with strategy.extended.colocate_vars_with(_tf_variable(variable)):
                self.accumulators.append(
                    tf.Variable(
                        tf.zeros(variable.shape, _accumulator_dtype(variable)),
                        aggregation=tf.VariableAggregation.SUM,
                        name="gradient",
                        **local,
                    )
                )
        self.sample_total = tf.Variable(
            0.0,
            aggregation=tf.VariableAggregation.SUM,
            name="sample_total",
            **local,
        )
        self.size = tf.Variable(
            0.0,
            aggregation=tf.VariableAggregation.SUM,
            name="size",
            **local,
        )
        self.micro_batches = tf.Variable(
            tf.constant(0, tf.int64),
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            name="micro_batches",
            **local,
        )

    def add(self, gradients, weight, size) -> None:
        """Adds one micro-batch's gradients, weighted by `weight`, and its
        `size` to the window's."""
        added = []
        for index, (accumulator, gradient) in enumerate(
            zip(self.accumulators, gradients, strict=True)
        ):
            if gradient is None:
                continue
            self.has_gradient[index] = True
            if isinstance(gradient, tf.IndexedSlices) and isinstance(
                accumulator, tf.distribute.DistributedValues
            ):
                # A replica's own sum (`ON_READ`) has no `scatter_add`:
                # its rows are added as a dense tensor, the same sum.
                gradient = tf.convert_to_tensor(gradient)
            if isinstance(gradient, tf.IndexedSlices):
                values = tf.cast(gradient.values, accumulator.dtype)
                added.append(
                    accumulator.scatter_add(
                        tf.IndexedSlices(
                            values * tf.cast(weight, values.dtype),
                            gradient.indices,
                            gradient.dense_shape,
                        )
                    )
                )
            else:
                gradient = tf.cast(gradient, accumulator.dtype)
                added.append(
                    accumulator.assign_add(
                        gradient * tf.cast(weight, accumulator.dtype)
                    )
                )
        added.append(self.sample_total.assign_add(weight))
        added.append(self.size.assign_add(tf.cast(size, tf.float32)))
        # After the sums, which depend on the batch's values: Keras calls
        # its step once more at the end of data of unknown length, where
        # reading the batch fails, and a counter that depended on nothing
        # could tick there before it, so that the epoch's end would apply
        # an empty window.
        with tf.control_dependencies(added):
            self.micro_batches.assign_add(1)

    def reset(self) -> None:
        for variable in [
            *self.accumulators,
            self.sample_total,
            self.size,
            self.micro_batches,
        ]:
            variable.assign(tf.zeros_like(variable))

    def local_stats(self, check_finite):
        overflowed = tf.constant(0.0)
        if check_finite:
            finite = [
                tf.reduce_all(tf.math.is_finite(accumulator))
                for accumulator, used in zip(
                    self.accumulators, self.has_gradient, strict=True
                )
                if used
            ]
            overflowed = 1.0 - tf.cast(tf.reduce_all(finite), tf.float32)
        return tf.stack([tf.convert_to_tensor(self.sample_total), overflowed])

    def apply(self, optimizer, sample_total):
        # Keras divides each replica's loss by the number of replicas and
        # `optimizer.apply` sums over replicas; multiplying by it here
        # makes that sum the sample-weighted mean over all replicas.
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        scale = tf.math.divide_no_nan(float(replicas), sample_total)
        gradients = [
            tf.cast(
                accumulator * tf.cast(scale, accumulator.dtype), variable.dtype
            )
            if used
            else None
            for accumulator, variable, used in zip(
                self.accumulators,
                self.variables,
                self.has_gradient,
                strict=True,
            )
        ]
        optimizer.apply(gradients, self.variables)


def apply_when_ready(
    strategy, ready, window, optimizer, skipped_windows, update_size=None
):
    """`apply_across_replicas` if `ready`, in a cross-replica context.

    Every replica counts the same micro-batches, so `ready` is taken from
    the first; given the `update_size` a window closes at, `ready` is
    each replica's size instead, summed here.

    Returns:
        A boolean scalar: whether the window was applied.
    """
    if update_size is not None:
        size = strategy.reduce(_SUM, ready, axis=None)
        ready = tf.greater_equal(size, float(update_size))
    else:
        ready = strategy.experimental_local_results(ready)[0]
    return tf.cond(
        ready,
        lambda: apply_across_replicas(
            strategy, window, optimizer, skipped_windows
        ),
        lambda: tf.constant(False),
    )


def apply_across_replicas(strategy, window, optimizer, skipped_windows):
    """Reduces, checks, applies (or skips) and resets one full window.

    Runs in a cross-replica context. The sample total (and, for a
    loss-scaled optimizer, the overflow flags) are summed over replicas
    here; the gradients themselves are summed by `optimizer.apply`, once.
    A window that overflowed is skipped as `LossScaleOptimizer` skips a
    non-finite step, and counted in `skipped_windows`.

    Returns:
        A boolean scalar: whether the window was applied.
    """
    check_finite = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    stats = strategy.extended.call_for_each_replica(
        window.local_stats, args=(check_finite,)
    )
    sample_total, overflowed = tf.unstack(
        strategy.reduce(_SUM, stats, axis=None)
    )

    def apply():
        strategy.extended.call_for_each_replica(
            window.apply, args=(optimizer, sample_total)
        )
        return tf.constant(True)

    def skip():
        # What `LossScaleOptimizer` does with a non-finite step.
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
        optimizer.step_counter.assign(0)
        skipped_windows.assign_add(1)
        return tf.constant(False)

    if check_finite:
        applied = tf.cond(overflowed > 0, skip, apply)
    else:
        applied = apply()
    strategy.extended.call_for_each_replica(window.reset)
    return applied


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _accumulator_dtype(variable) -> tf.DType:
    dtype = tf.as_dtype(variable.dtype)
    # Sums of many half-precision gradients lose precision: use float32.
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
