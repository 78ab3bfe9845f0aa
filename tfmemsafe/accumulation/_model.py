"""Gradient accumulation: the update of a batch of N×b, the memory of b.

`AccumulatingModel` is a `keras.Model` whose `fit` sums the gradients of
N micro-batches in a `GradientAccumulator` and applies their
sample-weighted mean once per window, so one optimizer step equals the
step of one large batch. `with_gradient_accumulation` (in `_wrapping.py`)
turns an existing model into one.
"""

from __future__ import annotations

import inspect

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _compat
from tfmemsafe.accumulation import _fit_callbacks
from tfmemsafe.accumulation import _functional
from tfmemsafe.accumulation._accumulator import GradientAccumulator
from tfmemsafe.accumulation._multi_worker import MultiWorkerSupport


@keras.saving.register_keras_serializable(package="tfmemsafe")
class AccumulatingModel(MultiWorkerSupport, keras.Model):
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

    For batches of varying size (`tfmemsafe.data.bucket_by_memory`'s
    length buckets), give the update's size instead: with
    `samples_per_update=n` a window closes at the first micro-batch that
    brings it to `n` samples or more; with `tokens_per_update=n`, to `n`
    padded tokens (a micro-batch of `b` samples of length `l`, the first
    input's axis 1, counts `b * l`, as fairseq's `--max-tokens` counts
    them). Either way the update is the sample-weighted mean of the
    window, and a batch that `tfmemsafe.SplitBatchOnOOM` trains as
    micro-batches counts once: the window still closes at the same size.

    Args:
        accumulation_steps: int. Micro-batches per optimizer update.
            Defaults to 1. Can be changed between `fit` calls.
        samples_per_update: int or `None`. Close each window at this many
            samples or more instead. Defaults to `None`.
        tokens_per_update: int or `None`. Close each window at this many
            padded tokens or more instead. Defaults to `None`.
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
        if _functional.builds_functionally(cls, args, kwargs):
            cls = _functional.functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args,
        accumulation_steps: int = 1,
        samples_per_update: int | None = None,
        tokens_per_update: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self._update_unit, update_size = _update_size(
            accumulation_steps, samples_per_update, tokens_per_update
        )
        self._accumulator = GradientAccumulator(
            accumulation_steps,
            name="gradient_accumulator",
            update_size=update_size,
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
        if self._update_unit is not None and value != 1:
            raise ValueError(
                f"{self.name}'s windows close at `{self._update_unit}_per_"
                f"update`, so `accumulation_steps` stays 1. Received: "
                f"accumulation_steps={value}"
            )
        for accumulator in self._accumulators():
            accumulator.accumulation_steps = value
        # The value is part of the traced step: trace it again.
        self.train_function = None
        self._flush_function = None

    @property
    def samples_per_update(self) -> int | None:
        """The samples that close a window, or `None`."""
        if self._update_unit != "samples":
            return None
        return self._accumulator.update_size

    @property
    def tokens_per_update(self) -> int | None:
        """The padded tokens that close a window, or `None`."""
        if self._update_unit != "tokens":
            return None
        return self._accumulator.update_size

    @property
    def gradient_accumulator(self) -> GradientAccumulator:
        """The `GradientAccumulator` that the default `train_step` uses."""
        return self._accumulator

    @property
    def skipped_windows(self) -> int:
        """Windows skipped so far because their scaled gradients overflowed."""
        return sum(int(a.skipped_windows) for a in self._accumulators())

    def train_step(self, data):
        if self.accumulation_steps == 1 and self._update_unit is None:
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
        # Read after the forward pass, which builds an unbuilt model.
        variables = self.trainable_weights
        if variables:
            gradients = tape.gradient(loss, variables)
            self._accumulator.accumulate(
                gradients,
                variables,
                _sample_count(self.loss, batch_size, sample_weight),
                size=_size(self._update_unit, x, batch_size),
            )
            self._accumulator.apply_if_ready(self.optimizer)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            logs["skipped_windows"] = self._accumulator.skipped_windows
        return logs

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._flush_function = None
        return super().make_train_function(force=force)

    def fit(self, *args, **kwargs):
        arguments = inspect.signature(super().fit).bind(*args, **kwargs)
        arguments.arguments["callbacks"] = _fit_callbacks.ordered_callbacks(
            arguments.arguments.get("callbacks"),
            _fit_callbacks.WindowCallback(),
            self,
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

        if self.run_eagerly:
            return flush
        # Called as a concrete function, which TensorFlow's retracing
        # warning does not count (a trace a model, in a loop of models).
        return tf.function(flush).get_concrete_function()

    def _accumulators(self):
        """Every `GradientAccumulator` this model holds as an attribute."""
        return [
            value
            for value in vars(self).values()
            if isinstance(value, GradientAccumulator)
        ]

    def _discard_partial_windows(self) -> None:
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

    @_compat.keras_default
    def get_config(self):
        config = super().get_config()
        init = inspect.signature(type(self).__init__).parameters
        passes_on = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in init.values()
        )
        if "accumulation_steps" in init or passes_on:
            config["accumulation_steps"] = self.accumulation_steps
        for name in ("samples_per_update", "tokens_per_update"):
            value = getattr(self, name)
            if value is not None and (name in init or passes_on):
                config[name] = value
        return config


def _update_size(accumulation_steps, samples_per_update, tokens_per_update):
    """What closes a window besides its micro-batches: `(unit, size)`."""
    if samples_per_update is not None and tokens_per_update is not None:
        raise ValueError(
            "Give `samples_per_update` or `tokens_per_update`, not both. "
            f"Received: samples_per_update={samples_per_update}, "
            f"tokens_per_update={tokens_per_update}"
        )
    budget = samples_per_update or tokens_per_update
    if budget is not None and accumulation_steps != 1:
        name = "samples" if samples_per_update is not None else "tokens"
        raise ValueError(
            f"A window closes after `accumulation_steps` micro-batches or "
            f"at `{name}_per_update`, not both: leave `accumulation_steps` "
            f"at 1. Received: accumulation_steps={accumulation_steps}, "
            f"{name}_per_update={budget}"
        )
    if samples_per_update is not None:
        return "samples", _checks.integer(
            "samples_per_update", samples_per_update
        )
    if tokens_per_update is not None:
        return "tokens", _checks.integer("tokens_per_update", tokens_per_update)
    return None, None


def _sample_count(loss, batch_size, sample_weight):
    """A micro-batch's weight: what `loss` (`compile`'s) divides its sum
    by."""
    # A name ("mse") averages, as Keras' own losses do.
    losses = tf.nest.flatten(loss) if loss is not None else []
    reductions = {
        getattr(one, "reduction", "sum_over_batch_size")
        for one in losses
        if one is not None
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


def _size(update_unit, x, batch_size):
    """What a micro-batch adds to its window's size: its samples, or its
    padded tokens (`update_unit` `"tokens"`)."""
    if update_unit != "tokens":
        return batch_size
    first = _first_tensor(x)
    if first.shape.rank is None or first.shape.rank < 2:
        raise ValueError(
            "`tokens_per_update` counts a micro-batch's samples times "
            "its length, the first input's axis 1, so that input needs "
            "one; use `samples_per_update` otherwise. Received: a "
            f"first input of shape {first.shape}"
        )
    return batch_size * tf.shape(first)[1]


def _first_tensor(x):
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _unscale_loss_for_distribution(loss):
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss * replicas if replicas > 1 else loss


def accumulation_steps_of(model) -> int | None:
    """The model's `accumulation_steps`, or `None` if it has none, or if
    its windows close at a number of samples or tokens (which a smaller
    batch keeps by itself)."""
    if window_closes_by_size(model):
        return None
    steps = getattr(model, "accumulation_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    return None


def window_closes_by_size(model) -> bool:
    """Whether the model's windows close at a number of samples or tokens
    (`AccumulatingModel(samples_per_update=...)`), whatever the batch."""
    accumulator = getattr(model, "gradient_accumulator", None)
    return getattr(accumulator, "update_size", None) is not None
