"""`GradientAccumulator`: sums micro-batch gradients, applies them per window.

It sums the gradients of N micro-batches and applies their
sample-weighted mean once per window, so one optimizer step equals the
step of one large batch made of the window's samples. It works in any
custom `train_step`, under `tf.distribute`, and with `LossScaleOptimizer`;
`tfmemsafe.AccumulatingModel` uses one in its `train_step`.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe.accumulation import _window as window_lib


class GradientAccumulator:
    """Sums micro-batch gradients and applies their mean once per window.

    Call `accumulate` once per micro-batch with the gradients you would
    pass to `optimizer.apply`, then `apply_if_ready`: after
    `accumulation_steps` micro-batches it applies one update and starts a
    new window. With `update_size` instead, a window closes at the first
    micro-batch that brings its size (the `size` each `accumulate` adds:
    its samples, its tokens) to `update_size` or more, for micro-batches
    of varying size (length buckets, say). Each micro-batch counts in
    proportion to `sample_count`, so the update equals that of one batch
    made of the window's samples, even when the last micro-batch is
    smaller. `flush` applies a partial window (at the end of an epoch,
    say); `AccumulatingModel` calls it for you.

    The accumulators are variables next to each model variable, local to
    each replica under `tf.distribute`: gradients are reduced across
    replicas once per window, not once per micro-batch. With a
    `keras.optimizers.LossScaleOptimizer` the scaled gradients are summed,
    checked for overflow once per window across all replicas, then
    unscaled and applied; a window that overflowed is dropped as a whole,
    the loss scale halves, and `skipped_windows` counts it.

    `accumulate`, `apply_if_ready` and `flush` run in a replica context:
    inside `train_step` or `strategy.run`, or eagerly without a strategy.

    Args:
        accumulation_steps: int. The micro-batches per window (N).
        name: str. A prefix for the accumulator variables' names.
        update_size: int or `None`. Close each window by size instead:
            once its micro-batches' `size` adds up to this or more (under
            `tf.distribute`, summed over the replicas).
            `accumulation_steps` must then be 1. Defaults to `None`.

    Example:

    A GAN with one accumulator per network (the whole recipe is in
    docs/gradient-accumulation.md). Deriving from `AccumulatingModel`
    (rather than `keras.Model`) makes `fit` flush both at the end of each
    epoch and lets `model.accumulation_steps` set both.

    ```python
    class GAN(tfmemsafe.AccumulatingModel):
        def __init__(self, generator, discriminator, accumulation_steps):
            super().__init__(accumulation_steps=accumulation_steps)
            self.generator, self.discriminator = generator, discriminator
            self.d_accumulator = tfmemsafe.GradientAccumulator(
                accumulation_steps, name="discriminator")
            self.g_accumulator = tfmemsafe.GradientAccumulator(
                accumulation_steps, name="generator")

        def train_step(self, real_images):  # Optimizers set in `compile`.
            with tf.GradientTape() as tape:
                d_loss = self.discriminator_loss(real_images)
                # Scaled under mixed precision, unchanged otherwise.
                scaled_loss = self.d_optimizer.scale_loss(d_loss)
            weights = self.discriminator.trainable_weights
            self.d_accumulator.accumulate(
                tape.gradient(scaled_loss, weights), weights,
                tf.shape(real_images)[0])
            self.d_accumulator.apply_if_ready(self.d_optimizer)
            # The same for the generator, with self.g_accumulator.
            return {"d_loss": d_loss}
    ```
    """

    def __init__(
        self,
        accumulation_steps: int,
        name: str = "accumulator",
        *,
        update_size: int | None = None,
    ):
        self._accumulation_steps = _checks.integer(
            "accumulation_steps", accumulation_steps
        )
        if update_size is not None:
            update_size = _checks.integer("update_size", update_size)
            _check_one_way(self._accumulation_steps, update_size)
        self.update_size = update_size
        self.name = name
        self.built = False
        self._window = None  # The `Window` for the built variables.
        self._skipped_windows = None  # A variable once built.
        self._optimizer = None

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches per window.

        A new value is read when the step is traced next; a Keras model
        traces again after `make_train_function(force=True)` (setting
        `AccumulatingModel.accumulation_steps` does that for you).
        """
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        value = _checks.integer("accumulation_steps", value)
        _check_one_way(value, self.update_size)
        self._accumulation_steps = value

    @property
    def pending_micro_batches(self) -> tf.Tensor:
        """The micro-batches accumulated in the current window."""
        if not self.built:
            return tf.constant(0, tf.int64)
        return tf.convert_to_tensor(self._window.micro_batches)

    @property
    def skipped_windows(self) -> tf.Tensor:
        """Windows dropped because their scaled gradients overflowed."""
        if not self.built:
            return tf.constant(0, tf.int64)
        return tf.convert_to_tensor(self._skipped_windows)

    def state_variables(self) -> list:
        """The variables a training step changes, to save and put back.

        The current window's gradient sums, sample total, size and
        micro-batch count, and the `skipped_windows` counter; none before
        `build`.
        """
        if not self.built:
            return []
        window = self._window
        return [
            *window.accumulators,
            window.sample_total,
            window.size,
            window.micro_batches,
            self._skipped_windows,
        ]

    def build(self, trainable_variables) -> None:
        """Creates one zeroed accumulator per variable, and the counters.

        `accumulate` calls it when given `trainable_variables`. Building
        for other variables (after unfreezing layers, say) replaces the
        accumulators; building for the same ones does nothing.

        Args:
            trainable_variables: The variables whose gradients will be
                accumulated, in the order the gradients will come.
        """
        variables = list(trainable_variables)
        if self.built and _same_variables(variables, self._window.variables):
            return
        _create_in_strategy_scope(
            functools.partial(self._create_variables, variables)
        )
        self.built = True

    def _create_variables(self, variables):
        with tf.name_scope(self.name):
            self._window = window_lib.Window(variables)
            if not self.built:  # Counts for the accumulator's lifetime.
                self._skipped_windows = tf.Variable(
                    tf.constant(0, tf.int64),
                    trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    name="skipped_windows",
                )

    def accumulate(
        self,
        gradients,
        trainable_variables=None,
        sample_count=None,
        size=None,
    ) -> None:
        """Adds one micro-batch's gradients to the window.

        Args:
            gradients: One gradient (a tensor, `tf.IndexedSlices` or
                `None`) per variable, as for `optimizer.apply`: computed
                from the loss Keras reports (under a strategy, divided by
                the number of replicas; under mixed precision, scaled by
                `optimizer.scale_loss`).
            trainable_variables: The variables, in the same order. Needed
                on the first call if `build` was not called.
            sample_count: Scalar. The micro-batch's weight in the window:
                its number of samples (for losses that average over the
                batch, the Keras default) or its sample-weight sum (for
                `reduction="mean_with_sample_weight"`). Defaults to 1, so
                every micro-batch counts the same.
            size: Scalar. What the micro-batch adds to the window's size,
                which `update_size` is compared with (its samples, or its
                tokens). Defaults to `sample_count`.
        """
        if trainable_variables is not None:
            self.build(trainable_variables)
        elif not self.built:
            raise ValueError(
                f"GradientAccumulator {self.name!r} is not built yet: "
                "pass `trainable_variables` to `accumulate`, or call "
                "`build(trainable_variables)` first."
            )
        gradients = list(gradients)
        if len(gradients) != len(self._window.accumulators):
            raise ValueError(
                f"Expected one gradient per variable "
                f"({len(self._window.accumulators)}). Received "
                f"{len(gradients)} gradients."
            )
        weight = 1.0 if sample_count is None else sample_count
        size = weight if size is None else size
        self._window.add(gradients, tf.cast(weight, tf.float32), size)

    def apply_if_ready(self, optimizer) -> tf.Tensor:
        """Applies the window's mean gradient if the window is full.

        Args:
            optimizer: The `keras.optimizers.Optimizer` to apply it with.

        Returns:
            A boolean scalar: whether an update was applied (`False` when
            the window is not full yet, or was skipped for overflow).
        """
        self._check_built("apply_if_ready")
        if self.update_size is not None:
            # Decided from the size of the whole window, every replica's.
            return self._apply_window(
                tf.convert_to_tensor(self._window.size),
                optimizer,
                by_size=True,
            )
        ready = tf.greater_equal(
            tf.convert_to_tensor(self._window.micro_batches),
            tf.constant(self.accumulation_steps, tf.int64),
        )
        return self._apply_window(ready, optimizer)

    def flush(self, optimizer=None) -> tf.Tensor:
        """Applies a partial window now, if any micro-batch is pending.

        Args:
            optimizer: The optimizer. Defaults to the one last given to
                `apply_if_ready`.

        Returns:
            A boolean scalar: whether an update was applied.
        """
        if not self.built or not any(self._window.has_gradient):
            return tf.constant(False)
        ready = tf.greater(
            tf.convert_to_tensor(self._window.micro_batches),
            tf.constant(0, tf.int64),
        )
        return self._apply_window(ready, optimizer)

    def reset(self) -> None:
        """Discards the current window."""
        if self.built:
            self._window.reset()

    def _check_built(self, method):
        if not self.built or not any(self._window.has_gradient):
            raise ValueError(
                f"GradientAccumulator {self.name!r}: call `accumulate` "
                f"before `{method}`."
            )

    def _apply_window(self, ready, optimizer, by_size=False):
        """Applies the window when `ready` (or, `by_size`, when the
        replicas' sizes in `ready` add up to `update_size`), from a replica
        context."""
        if optimizer is None:
            optimizer = self._optimizer
        if optimizer is None:
            raise ValueError(
                f"GradientAccumulator {self.name!r} has no optimizer yet: "
                "pass `optimizer` to `flush`."
            )
        self._optimizer = optimizer
        if not optimizer.built:
            _create_in_strategy_scope(
                functools.partial(optimizer.build, self._window.variables)
            )
        context = tf.distribute.get_replica_context()
        if context is None:
            raise RuntimeError(
                "GradientAccumulator must be used in a replica context: "
                "inside `train_step` or `strategy.run`, not in "
                "`strategy.scope()` directly."
            )
        # `optimizer.apply` calls `merge_call`, which may not run inside a
        # `tf.cond` in a replica context; in a cross-replica context it
        # may (as `LossScaleOptimizer._tf_apply` does).
        return context.merge_call(
            functools.partial(
                window_lib.apply_when_ready,
                window=self._window,
                optimizer=optimizer,
                skipped_windows=self._skipped_windows,
                update_size=self.update_size if by_size else None,
            ),
            args=(ready,),
        )


def _create_in_strategy_scope(create) -> None:
    """Runs `create`, which makes variables, eagerly in the strategy's scope.

    It may be called while a step is traced in a replica context: under
    MirroredStrategy, variables created there by a replica thread made a
    later `tf.cond` branch fail ("You must feed a value for placeholder").
    """

    def create_eagerly(*_):
        strategy = tf.distribute.get_strategy()
        with tf.init_scope(), strategy.scope():
            create()

    context = tf.distribute.get_replica_context()
    if context is None:
        create_eagerly()
    else:
        context.merge_call(create_eagerly)


def _check_one_way(accumulation_steps: int, update_size) -> None:
    """A window closes after a number of micro-batches or by size."""
    if update_size is not None and accumulation_steps != 1:
        raise ValueError(
            "A window closes either after `accumulation_steps` "
            "micro-batches or at `update_size`, not both: "
            "`accumulation_steps` must be 1 with `update_size`. Received: "
            f"accumulation_steps={accumulation_steps}, "
            f"update_size={update_size}"
        )


def _same_variables(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
