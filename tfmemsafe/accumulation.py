"""Gradient accumulation: the update of a batch of N×b, the memory of b.

`GradientAccumulator` sums the gradients of N micro-batches and applies
their sample-weighted mean once per window, so one optimizer step equals
the step of one large batch made of the window's samples. It works in any
custom `train_step`, under `tf.distribute`, and with `LossScaleOptimizer`.
`AccumulatingModel` is a `keras.Model` that trains that way in `fit`, and
`with_gradient_accumulation` turns an existing model into one.
"""

from __future__ import annotations

import functools
import inspect

import keras
import tensorflow as tf
from absl import logging

# Keras has no public name for these: the class of functional models, the
# registry that maps a class to its serialized name, and the marker that
# keeps automatic `get_config` working for subclasses that override it.
from keras.src.models.functional import Functional
from keras.src.saving import object_registration
from keras.src.utils import python_utils

from tfmemsafe import _checks
from tfmemsafe.distribute import _MultiWorkerSupport

_SUM = tf.distribute.ReduceOp.SUM


class GradientAccumulator:
    """Sums micro-batch gradients and applies their mean once per window.

    Call `accumulate` once per micro-batch with the gradients you would
    pass to `optimizer.apply`, then `apply_if_ready`: after
    `accumulation_steps` micro-batches it applies one update and starts a
    new window. Each micro-batch counts in proportion to `sample_count`,
    so the update equals that of one batch made of the window's samples,
    even when the last micro-batch is smaller. `flush` applies a partial
    window (at the end of an epoch, say); `AccumulatingModel` calls it for
    you.

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

    Example:

    A GAN with one accumulator per network. Deriving from
    `AccumulatingModel` (rather than `keras.Model`) makes `fit` flush both
    at the end of each epoch and lets `model.accumulation_steps` set both.

    ```python
    class GAN(tfmemsafe.AccumulatingModel):
        def __init__(self, generator, discriminator, accumulation_steps):
            super().__init__(accumulation_steps=accumulation_steps)
            self.generator = generator
            self.discriminator = discriminator
            self.d_accumulator = tfmemsafe.GradientAccumulator(
                accumulation_steps, name="discriminator")
            self.g_accumulator = tfmemsafe.GradientAccumulator(
                accumulation_steps, name="generator")

        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer

        def train_step(self, real_images):
            batch_size = tf.shape(real_images)[0]
            with tf.GradientTape() as tape:
                d_loss = self.discriminator_loss(real_images)
                # Scaled under mixed precision, unchanged otherwise.
                scaled_loss = self.d_optimizer.scale_loss(d_loss)
            weights = self.discriminator.trainable_weights
            self.d_accumulator.accumulate(
                tape.gradient(scaled_loss, weights), weights, batch_size)
            self.d_accumulator.apply_if_ready(self.d_optimizer)
            # The same for the generator, with self.g_accumulator.
            return {"d_loss": d_loss}
    ```
    """

    def __init__(self, accumulation_steps: int, name: str = "accumulator"):
        self._accumulation_steps = _checks.integer(
            "accumulation_steps", accumulation_steps
        )
        self.name = name
        self.built = False
        self._trainable_variables = []
        self._accumulators = []
        # Which variables received a gradient, learned while tracing.
        self._has_gradient = []
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
        self._accumulation_steps = _checks.integer("accumulation_steps", value)

    @property
    def pending_micro_batches(self) -> tf.Tensor:
        """The micro-batches accumulated in the current window."""
        if not self.built:
            return tf.constant(0, tf.int64)
        return tf.convert_to_tensor(self._micro_batches)

    @property
    def skipped_windows(self) -> tf.Tensor:
        """Windows dropped because their scaled gradients overflowed."""
        if not self.built:
            return tf.constant(0, tf.int64)
        return tf.convert_to_tensor(self._skipped_windows)

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
        if self.built and _same_variables(variables, self._trainable_variables):
            return
        _create_in_strategy_scope(
            functools.partial(self._create_variables, variables)
        )
        self._trainable_variables = variables
        self._has_gradient = [False] * len(variables)
        self.built = True

    def _create_variables(self, variables):
        strategy = tf.distribute.get_strategy()
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
        )
        with tf.name_scope(self.name):
            self._accumulators = []
            for variable in variables:
                with strategy.extended.colocate_vars_with(
                    _tf_variable(variable)
                ):
                    self._accumulators.append(
                        tf.Variable(
                            tf.zeros(
                                variable.shape, _accumulator_dtype(variable)
                            ),
                            aggregation=tf.VariableAggregation.SUM,
                            name="gradient",
                            **local,
                        )
                    )
            self._sample_total = tf.Variable(
                0.0,
                aggregation=tf.VariableAggregation.SUM,
                name="sample_total",
                **local,
            )
            self._micro_batches = tf.Variable(
                tf.constant(0, tf.int64),
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="micro_batches",
                **local,
            )
            if not self.built:  # Counts for the accumulator's lifetime.
                self._skipped_windows = tf.Variable(
                    tf.constant(0, tf.int64),
                    trainable=False,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                    name="skipped_windows",
                )

    def accumulate(
        self, gradients, trainable_variables=None, sample_count=None
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
        if len(gradients) != len(self._accumulators):
            raise ValueError(
                f"Expected one gradient per variable "
                f"({len(self._accumulators)}). Received "
                f"{len(gradients)} gradients."
            )
        weight = 1.0 if sample_count is None else sample_count
        weight = tf.cast(weight, tf.float32)
        for index, (accumulator, gradient) in enumerate(
            zip(self._accumulators, gradients, strict=True)
        ):
            if gradient is None:
                continue
            self._has_gradient[index] = True
            if isinstance(gradient, tf.IndexedSlices):
                values = tf.cast(gradient.values, accumulator.dtype)
                accumulator.scatter_add(
                    tf.IndexedSlices(
                        values * tf.cast(weight, values.dtype),
                        gradient.indices,
                        gradient.dense_shape,
                    )
                )
            else:
                gradient = tf.cast(gradient, accumulator.dtype)
                accumulator.assign_add(
                    gradient * tf.cast(weight, accumulator.dtype)
                )
        self._sample_total.assign_add(weight)
        self._micro_batches.assign_add(1)

    def apply_if_ready(self, optimizer) -> tf.Tensor:
        """Applies the window's mean gradient if the window is full.

        Args:
            optimizer: The `keras.optimizers.Optimizer` to apply it with.

        Returns:
            A boolean scalar: whether an update was applied (`False` when
            the window is not full yet, or was skipped for overflow).
        """
        self._check_built("apply_if_ready")
        ready = tf.greater_equal(
            tf.convert_to_tensor(self._micro_batches),
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
        if not self.built or not any(self._has_gradient):
            return tf.constant(False)
        ready = tf.greater(
            tf.convert_to_tensor(self._micro_batches),
            tf.constant(0, tf.int64),
        )
        return self._apply_window(ready, optimizer)

    def reset(self) -> None:
        """Discards the current window."""
        if self.built:
            for variable in self._window_variables():
                variable.assign(tf.zeros_like(variable))

    def _check_built(self, method):
        if not self.built or not any(self._has_gradient):
            raise ValueError(
                f"GradientAccumulator {self.name!r}: call `accumulate` "
                f"before `{method}`."
            )

    def _window_variables(self):
        return [*self._accumulators, self._sample_total, self._micro_batches]

    def _apply_window(self, ready, optimizer):
        """Applies the window when `ready`, from a replica context."""
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
                functools.partial(optimizer.build, self._trainable_variables)
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
            functools.partial(self._cross_replica_window, optimizer=optimizer),
            args=(ready,),
        )

    def _cross_replica_window(self, strategy, ready, optimizer):
        """All cross-replica work of a window: reduce, check, apply, reset.

        Every replica counts the same micro-batches, so `ready` is taken
        from the first. The sample total (and, for a loss-scaled
        optimizer, the overflow flags) are summed over replicas here; the
        gradients themselves are summed by `optimizer.apply`, once.
        """
        ready = strategy.experimental_local_results(ready)[0]
        check_finite = isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        )

        def run_window():
            stats = strategy.extended.call_for_each_replica(
                self._local_window_stats, args=(check_finite,)
            )
            sample_total, overflowed = tf.unstack(
                strategy.reduce(_SUM, stats, axis=None)
            )

            def apply():
                strategy.extended.call_for_each_replica(
                    self._apply_local, args=(optimizer, sample_total)
                )
                return tf.constant(True)

            def skip():
                # What `LossScaleOptimizer` does with a non-finite step.
                optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
                optimizer.step_counter.assign(0)
                self._skipped_windows.assign_add(1)
                return tf.constant(False)

            if check_finite:
                applied = tf.cond(overflowed > 0, skip, apply)
            else:
                applied = apply()
            strategy.extended.call_for_each_replica(self.reset)
            return applied

        return tf.cond(ready, run_window, lambda: tf.constant(False))

    def _local_window_stats(self, check_finite):
        overflowed = tf.constant(0.0)
        if check_finite:
            finite = [
                tf.reduce_all(tf.math.is_finite(accumulator))
                for accumulator, used in zip(
                    self._accumulators, self._has_gradient, strict=True
                )
                if used
            ]
            overflowed = 1.0 - tf.cast(tf.reduce_all(finite), tf.float32)
        return tf.stack([tf.convert_to_tensor(self._sample_total), overflowed])

    def _apply_local(self, optimizer, sample_total):
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
                self._accumulators,
                self._trainable_variables,
                self._has_gradient,
                strict=True,
            )
        ]
        optimizer.apply(gradients, self._trainable_variables)


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


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _same_variables(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _accumulator_dtype(variable) -> tf.DType:
    dtype = tf.as_dtype(variable.dtype)
    # Sums of many half-precision gradients lose precision: use float32.
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


@keras.saving.register_keras_serializable(package="tfmemsafe")
class AccumulatingModel(_MultiWorkerSupport, keras.Model):
    """A `keras.Model` whose `fit` accumulates gradients over micro-batches.

    `fit(batch_size=b)` runs forward and backward passes on micro-batches
    of `b` samples and applies one optimizer update per
    `accumulation_steps` of them: the update of a batch of
    `accumulation_steps * b` samples, at the activation memory of `b`.
    Each micro-batch counts for its number of samples (its sample-weight
    sum under `reduction="mean_with_sample_weight"`), a partial window is
    applied at the end of every epoch (before validation), and
    `optimizer.iterations` counts updates, not micro-batches. Loss and
    metrics are reported per micro-batch, as in plain Keras.
    `accumulation_steps=1` trains exactly like a plain model.

    Build it like any Keras model: functionally
    (`AccumulatingModel(inputs, outputs, accumulation_steps=4)`), as the
    base class of a subclassed model, or from an existing model with
    `tfmemsafe.with_gradient_accumulation`.

    Under mixed precision (`mixed_float16`), a window whose scaled
    gradients overflow is skipped as a whole: the loss scale halves,
    `skipped_windows` counts it and `fit` logs it as `skipped_windows`.
    BatchNormalization still updates its moving statistics per
    micro-batch (see docs/gradient-accumulation.md).

    It trains under `tf.distribute.MirroredStrategy` and, unlike a plain
    Keras 3 model, under `MultiWorkerMirroredStrategy` (see
    docs/multi-worker.md); there the gradients are reduced across all
    workers once per window.

    Args:
        accumulation_steps: int. Micro-batches per optimizer update.
            Defaults to 1. Can be changed between `fit` calls.
        *args, **kwargs: As for `keras.Model`.

    Example:

    ```python
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(x))
    model = tfmemsafe.AccumulatingModel(inputs, outputs, accumulation_steps=8)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=16)  # updates of 128 samples
    ```
    """

    def __new__(cls, *args, **kwargs):
        if _builds_functionally(cls, args, kwargs):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, accumulation_steps: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self._accumulator = GradientAccumulator(
            accumulation_steps, name="gradient_accumulator"
        )
        self._flush_function = None

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer update; takes effect in the next fit.

        Setting it sets it on every `GradientAccumulator` the model holds.
        """
        return self._accumulator.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value):
        value = _checks.integer("accumulation_steps", value)
        for accumulator in self._accumulators():
            accumulator.accumulation_steps = value
        # The value is part of the traced step: trace it again.
        self.train_function = None
        self._flush_function = None

    @property
    def gradient_accumulator(self) -> GradientAccumulator:
        """The `GradientAccumulator` that the default `train_step` uses."""
        return self._accumulator

    @property
    def skipped_windows(self) -> int:
        """Windows skipped so far because their scaled gradients overflowed."""
        return sum(int(a.skipped_windows) for a in self._accumulators())

    def train_step(self, data):
        if self.accumulation_steps == 1 or not self.trainable_weights:
            return super().train_step(data)
        # Keras' own TensorFlow `train_step`, with `optimizer.apply`
        # replaced by accumulate-and-apply-when-full.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            if self._call_has_training_arg:
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)
            loss = self._compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            batch_size = tf.shape(_first_tensor(x))[0]
            self._loss_tracker.update_state(
                _unscale_loss_for_distribution(loss), sample_weight=batch_size
            )
            loss = self.optimizer.scale_loss(loss)
        variables = self.trainable_weights
        gradients = tape.gradient(loss, variables)
        self._accumulator.accumulate(
            gradients, variables, self._sample_count(batch_size, sample_weight)
        )
        self._accumulator.apply_if_ready(self.optimizer)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            logs["skipped_windows"] = self._accumulator.skipped_windows
        return logs

    def _sample_count(self, batch_size, sample_weight):
        """A micro-batch's weight: what the loss divides its sum by."""
        losses = getattr(self._compile_loss, "_flat_losses", None) or []
        reductions = {
            getattr(entry.loss, "reduction", None) for entry in losses
        }
        if "sum" in reductions:
            logging.warning(
                "A loss with reduction='sum' is not an average, so an "
                "accumulated window is not the same update as one large "
                "batch; use a reduction that averages (the default)."
            )
        if (
            reductions == {"mean_with_sample_weight"}
            and sample_weight is not None
            and not tf.nest.is_nested(sample_weight)
        ):
            return tf.reduce_sum(tf.cast(sample_weight, tf.float32))
        return batch_size

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._flush_function = None
        return super().make_train_function(force=force)

    def fit(self, *args, **kwargs):
        arguments = inspect.signature(super().fit).bind(*args, **kwargs)
        arguments.arguments["callbacks"] = _with_callback(
            arguments.arguments.get("callbacks"), _WindowCallback(), self
        )
        return super().fit(*arguments.args, **arguments.kwargs)

    def flush_gradients(self) -> bool:
        """Applies any partial window now.

        `fit` does this at the end of every epoch; call it after
        `train_on_batch` calls that did not fill a window.

        Returns:
            Whether an update was applied.
        """
        pending = [
            a
            for a in self._accumulators()
            if a.built and int(a.pending_micro_batches) > 0
        ]
        if not pending:
            return False
        accumulators = [a for a in self._accumulators() if a.built]
        if (
            self._flush_function is None
            or self._flush_function[0] != accumulators
        ):
            self._flush_function = (
                accumulators,
                self._make_flush_function(accumulators),
            )
        return bool(self._flush_function[1]())

    def _make_flush_function(self, accumulators):
        """A function that flushes `accumulators` under the model's strategy."""
        strategy = self.distribute_strategy

        def flush_on_replica():
            return tf.reduce_any(tf.stack([a.flush() for a in accumulators]))

        def flush():
            applied = strategy.run(flush_on_replica)
            return strategy.experimental_local_results(applied)[0]

        return flush if self.run_eagerly else tf.function(flush)

    def _accumulators(self):
        """Every `GradientAccumulator` this model holds as an attribute."""
        return [
            value
            for value in vars(self).values()
            if isinstance(value, GradientAccumulator)
        ]

    def _carry_partial_window(self, ratio: float) -> None:
        """Keeps the partial windows through the next `fit` call's start.

        `tfmemsafe.fit` calls it when it resumes an epoch mid-window with
        `accumulation_steps` multiplied by `ratio`: the micro-batches done
        count `ratio` times, as that many of the new, smaller ones.
        """
        for accumulator in self._accumulators():
            if accumulator.built:
                counter = accumulator._micro_batches
                counter.assign(
                    tf.cast(
                        tf.round(tf.cast(counter, tf.float64) * ratio),
                        tf.int64,
                    )
                )
        self._keep_partial_windows = True

    def _discard_partial_windows(self) -> None:
        if getattr(self, "_keep_partial_windows", False):
            self._keep_partial_windows = False
            return
        for accumulator in self._accumulators():
            pending = int(accumulator.pending_micro_batches)
            if pending:
                logging.warning(
                    "Discarding %d accumulated micro-batches of %r left by "
                    "an interrupted fit or by train_on_batch.",
                    pending,
                    accumulator.name,
                )
                accumulator.reset()

    @python_utils.default
    def get_config(self):
        config = super().get_config()
        init = inspect.signature(type(self).__init__).parameters
        if "accumulation_steps" in init or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in init.values()
        ):
            config["accumulation_steps"] = self.accumulation_steps
        return config


class _WindowCallback(keras.callbacks.Callback):
    """Starts each `fit` with empty windows and flushes them every epoch.

    It runs first, so validation, checkpoints and early stopping all see
    the weights with the epoch's last (partial) window applied.
    """

    def __init__(self):
        super().__init__()
        self._training = False

    def on_train_begin(self, logs=None):
        self._training = True
        self.model._discard_partial_windows()

    def on_test_begin(self, logs=None):
        if self._training:  # Validation at the end of an epoch.
            self.model.flush_gradients()

    def on_epoch_end(self, epoch, logs=None):
        self.model.flush_gradients()
        if logs is not None and "skipped_windows" in logs:
            logs["skipped_windows"] = self.model.skipped_windows

    def on_train_end(self, logs=None):
        self._training = False
        skipped = self.model.skipped_windows
        if skipped:
            logging.info(
                "%d accumulation windows were skipped because their "
                "scaled gradients overflowed (each halved the loss scale).",
                skipped,
            )


def _with_callback(callbacks, callback, model):
    """Puts `callback` first in `callbacks` (a list or a `CallbackList`)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callback.set_model(model)
        if callbacks.params:
            callback.set_params(callbacks.params)
        callbacks.callbacks.insert(0, callback)
        return callbacks
    return [callback, *tf.nest.flatten(callbacks or [])]


def _functional_arguments(args, kwargs) -> bool:
    """Whether a model is being built as `Model(inputs, outputs)`."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def _builds_functionally(cls, args, kwargs) -> bool:
    """Whether `cls(*args, **kwargs)` builds a functional model.

    Only a class that takes a functional model's arguments does: one with
    no `__init__` of its own, or one that passes `*args, **kwargs` on (the
    test Keras' `Model.from_config` makes). A subclass with arguments of
    its own is built by its `__init__`, as with `keras.Model`:
    `GAN(generator, discriminator)` is not `Model(inputs, outputs)`.
    """
    if issubclass(cls, Functional) or not _functional_arguments(args, kwargs):
        return False
    # `AccumulatingModel.__init__` itself takes `*args, **kwargs`.
    spec = inspect.getfullargspec(cls.__init__)
    return spec.varargs is not None and spec.varkw is not None


@functools.cache
def _functional_variant(cls):
    """`cls` with `Functional` mixed in, for `cls(inputs, outputs)`.

    Keras would instead rewrite `cls.__bases__` in place, which breaks
    every later subclass of `cls` that is not built functionally.
    """
    variant = type(
        cls.__name__,
        (cls, Functional),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )
    # Saved under the name of `cls`, so loading rebuilds it through `cls`.
    object_registration.GLOBAL_CUSTOM_NAMES[variant] = (
        keras.saving.get_registered_name(cls)
    )
    return variant


@keras.saving.register_keras_serializable(package="tfmemsafe")
class _WrappedModel(AccumulatingModel):
    """An `AccumulatingModel` that calls another model (sharing weights)."""

    def __init__(self, inner_model, accumulation_steps=1, **kwargs):
        super().__init__(accumulation_steps=accumulation_steps, **kwargs)
        self.inner_model = inner_model
        if inner_model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.inner_model(inputs, training=training)

    def get_config(self):
        return {
            "name": self.name,
            "inner_model": keras.saving.serialize_keras_object(
                self.inner_model
            ),
            "accumulation_steps": self.accumulation_steps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_model"] = keras.saving.deserialize_keras_object(
            config["inner_model"], custom_objects=custom_objects
        )
        return cls(**config)


def with_gradient_accumulation(
    model: keras.Model, accumulation_steps: int | None = None
) -> AccumulatingModel:
    """Returns `model` as an `AccumulatingModel` that shares its weights.

    A functional model becomes a functional `AccumulatingModel` over the
    same layers; a `Sequential` or subclassed model (built or not) is
    wrapped. Training either trains `model`'s own variables. If `model` is
    compiled, the result is compiled the same way with the same optimizer
    instance, so its state (and `iterations`) carries on.

    Args:
        model: A `keras.Model`. An `AccumulatingModel` is returned as is.
        accumulation_steps: int. Micro-batches per optimizer update.
            Defaults to the value an `AccumulatingModel` has, else to 1:
            it trains as before until the value is raised (as
            `tfmemsafe.fit` does when it halves the batch).

    Returns:
        An `AccumulatingModel`.

    Example:

    ```python
    model = keras.applications.MobileNetV2(weights=None)
    model.compile("adam", "sparse_categorical_crossentropy")
    model = tfmemsafe.with_gradient_accumulation(model, 8)
    model.fit(x, y, batch_size=16)  # updates of 128 samples
    ```
    """
    _checks.model(model)
    if isinstance(model, AccumulatingModel):
        if accumulation_steps is not None:
            model.accumulation_steps = accumulation_steps
        return model
    if accumulation_steps is None:
        accumulation_steps = 1
    accumulation_steps = _checks.integer(
        "accumulation_steps", accumulation_steps
    )
    if isinstance(model, Functional):
        result = AccumulatingModel(
            model.input,
            model.output,
            name=model.name,
            accumulation_steps=accumulation_steps,
        )
    else:
        result = _WrappedModel(
            model, accumulation_steps=accumulation_steps, name=model.name
        )
    compile_config = getattr(model, "_compile_config", None)
    if model.compiled and compile_config is not None:
        arguments = dict(compile_config.config)
        # The optimizer itself, already wrapped for loss scaling if needed.
        arguments.update(optimizer=model.optimizer, auto_scale_loss=False)
        result.compile(**arguments)
    return result


def _first_tensor(x):
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _unscale_loss_for_distribution(loss):
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * replicas if replicas > 1 else loss
