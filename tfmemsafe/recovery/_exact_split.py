"""What a batch that runs out can be split into exactly: `split_refusal`.

Micro-batches weighted by their rows add up to the whole batch's update
when every loss divides by the batch's rows and nothing else in the step
depends on the batch as a whole. This module says, for a model, why not
when it cannot.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmemsafe import _compat
from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.recovery._held_batches import local_shares

# Why a model's own `train_step` is not split from the first step (after
# an out-of-memory error it is: as calls of that step on the micro-batches).
OWN_STEP = (
    "the model has its own `train_step`, so each micro-batch would make an "
    "update of its own"
)
# Reductions that divide a loss by the rows of its batch (times any fixed
# axes), so that micro-batches weighted by their rows add up to it.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def keras_step(model) -> bool:
    """Whether `model` trains with Keras' own `train_step` (or an
    `AccumulatingModel`'s): one update a batch, which micro-batches can
    make together. A model with its own step updates as it chooses."""
    return type(model).train_step in (
        keras.Model.train_step,
        AccumulatingModel.train_step,
    )


def split_refusal(
    model,
    batch,
    name: str = "train",
    split_batch_norm: bool = False,
    from_the_start: bool = False,
) -> str | None:
    """Why a batch of `model` cannot be split into micro-batches exactly,
    or `None` when it can.

    A batch of a model with its own `train_step` that ran out is split as
    calls of that step on the pieces (see docs/oom-recovery.md), except
    under a multi-worker strategy; from the first step
    (`from_the_start`), it is not split (`OWN_STEP`). Only Keras' own
    steps are checked further: each loss must
    divide by the batch's rows (reduction
    `"sum_over_batch_size"`, the default, or `"mean"`; or
    `"mean_with_sample_weight"` on a batch without sample weights), the
    outputs must carry no mask (a masked loss divides by the unmasked
    steps), no `BatchNormalization` may train (unless `split_batch_norm`),
    the model must not override `compute_loss`, and its update
    must be traced (not `run_eagerly`) under no strategy, a
    `MirroredStrategy` or a `MultiWorkerMirroredStrategy` without
    synchronized `BatchNormalization`.
    """
    if name == "predict":
        return None
    if name == "train" and not keras_step(model):
        if distribute.is_multi_worker(model.distribute_strategy):
            return (
                "the model has its own `train_step`, whose update cannot "
                "wait for every worker of a multi-worker job to agree"
            )
        return OWN_STEP if from_the_start else None
    if name == "train" and (
        model.run_eagerly or tf.config.functions_run_eagerly()
    ):
        return (
            "the model runs eagerly (`run_eagerly=True`), so its update "
            "cannot wait for every micro-batch"
        )
    if name == "train" and not _strategy_can_split(model):
        return (
            f"the strategy {type(model.distribute_strategy).__name__} "
            "cannot hold back its update"
        )
    if name == "train" and not split_batch_norm:
        for layer in _compat.nested_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization) and (
                layer.trainable
            ):
                return (
                    f"its layer {layer.name!r} normalizes each batch by the "
                    "batch's own statistics, so micro-batches would be "
                    "normalized otherwise (pass `split_batch_norm=True` to "
                    "split all the same)"
                )
    if name == "train" and not _compat.activity_regularization_is_a_mean():
        for layer in _compat.nested_layers(model):
            if getattr(layer, "activity_regularizer", None) is not None:
                return (
                    f"its layer {layer.name!r} has an activity regularizer, "
                    "which this Keras sums over the batch's rows"
                )
    if model.loss is None:
        return (
            "its loss comes from `add_loss` alone, whose reduction is unknown"
        )
    if type(model).compute_loss is not keras.Model.compute_loss:
        return "the model overrides `compute_loss`, whose reduction is unknown"
    _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    for loss in tf.nest.flatten(model.loss):
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        if reduction == "mean_with_sample_weight" and sample_weight is None:
            continue
        if reduction not in _MEAN_REDUCTIONS:
            return (
                f"the loss {getattr(loss, 'name', loss)!r} has "
                f"reduction={reduction!r}, which does not average over the "
                "batch's rows"
            )
    x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
    x = tf.nest.map_structure(
        lambda t: t[:1], local_shares(x, model.distribute_strategy)[0]
    )
    outputs = model(x, training=False)
    if any(_compat.has_keras_mask(o) for o in tf.nest.flatten(outputs)):
        return "the model's outputs carry a mask"
    return None


def after_an_oom(refusal: str) -> str:
    """What happens to a batch that runs out, of a model whose batches
    are not split from the start for `refusal`."""
    if refusal == OWN_STEP:
        return (
            "one that runs out of memory runs again as calls of that step "
            "on micro-batches"
        )
    return "one that runs out of memory raises tfmemsafe.OutOfMemoryError"


class SplitRefusals:
    """`split_refusal` of each phase of one run, read once.

    Args:
        model: The `keras.Model`.
        split_batch_norm: bool. As `SplitBatchOnOOM`'s.
    """

    def __init__(self, model, split_batch_norm: bool):
        self.model = model
        self.split_batch_norm = split_batch_norm
        self._read = {}  # phase -> why its batches are not split, or None.
        # Read now, while memory is free: its probe converts host arrays.
        _compat.activity_regularization_is_a_mean()

    def of(self, name: str, batch):
        """Why `name` batches cannot be split exactly, or `None`; or the
        out-of-memory error of the one example `split_refusal` runs
        forward (then read again next time)."""
        if name not in self._read:
            try:
                self._read[name] = split_refusal(
                    self.model, batch, name, self.split_batch_norm
                )
            except Exception as err:  # noqa: BLE001 (re-raised unless OOM)
                if not memory.is_oom_error(err):
                    raise
                return err
        return self._read[name]


def _strategy_can_split(model) -> bool:
    """Whether the model's strategy is none, a `MirroredStrategy`, or a
    `MultiWorkerMirroredStrategy` with no collective in its forward pass
    (a synchronized `BatchNormalization`), which could not wait for the
    workers to agree."""
    strategy = model.distribute_strategy
    # The strategy outside every scope: a new graph has none entered.
    with tf.Graph().as_default():
        if type(strategy) is type(tf.distribute.get_strategy()):
            return True
    if isinstance(strategy, tf.distribute.MirroredStrategy):
        return True
    if not distribute.is_multi_worker(strategy):
        return False
    return not any(
        getattr(layer, "synchronized", False) is True
        for layer in _compat.nested_layers(model)
    )
