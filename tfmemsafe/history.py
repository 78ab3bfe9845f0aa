"""What `tfmemsafe.fit` returns: a `FitHistory` with an `OOMEvent` for each
out-of-memory error and a `GrowBackEvent` for each batch size grown back."""

from __future__ import annotations

import dataclasses
import functools

import keras


@dataclasses.dataclass(frozen=True)
class OOMEvent:
    """An out-of-memory error that `SplitBatchOnOOM` recovered from, or one
    `tfmemsafe.fit`'s pre-flight check predicted and avoided.

    `str(event)` is one line, e.g. `"epoch 1, training step 0: its batch
    split into 8 micro-batches for one update, batch size 1024 kept"` (the
    epoch counted from 1), or `"epoch 1, pre-flight check: its batch split
    into 8 micro-batches, batch size 1024 kept"`.

    Attributes:
        epoch: int. The epoch that failed, counted from 0 as Keras
            callbacks count.
        step: int. The batch within the epoch (or within its validation)
            that was running.
        phase: str. `"training"`, `"validation"`, `"evaluation"` or
            `"prediction"` for an error suffered; `"preflight"` for one
            predicted before the first step.
        batch_size_before: int. The rows of the batch that ran out.
        batch_size_after: int. The same: the batch is kept.
        accumulation_steps: int or `None`. The model's
            `accumulation_steps`; `None` for a model without gradient
            accumulation.
        error: str. The line of the error that says what ran out; for a
            pre-flight event, the prediction (`"peak 812.3 MiB predicted
            against 90% of 450.0 MiB on CPU:0"`).
        resumed_at_step: int or `None`. The step that went on: the one
            that ran out.
        split_into: int or `None`. The micro-batches the batch ran as
            next (accumulated into one update, for training).
        one_update: bool. Whether a training batch's micro-batches make
            one update: `False` for a model with its own `train_step`,
            each of whose micro-batches makes its own.
    """

    epoch: int
    step: int
    phase: str
    batch_size_before: int
    batch_size_after: int
    accumulation_steps: int | None
    error: str
    resumed_at_step: int | None = None
    split_into: int | None = None
    one_update: bool = True

    def __str__(self) -> str:
        accumulation = _accumulation_text(self.accumulation_steps)
        where = f"{self.phase} step {self.step}"
        if self.phase == "preflight":
            where = "pre-flight check"
        if self.split_into:
            update = ""
            if self.phase == "training" and self.one_update:
                update = " for one update"
            elif self.phase == "training":
                update = ", each its own update"
            return (
                f"epoch {self.epoch + 1}, {where}: its batch split into "
                f"{self.split_into} micro-batches{update}, batch "
                f"size {self.batch_size_after} kept{accumulation}"
            )
        return (
            f"epoch {self.epoch + 1}, {where}: batch "
            f"size {self.batch_size_before} -> {self.batch_size_after}"
            f"{accumulation}"
        )


@dataclasses.dataclass(frozen=True)
class GrowBackEvent:
    """Micro-batches that `SplitBatchOnOOM` grew back after memory that
    had made them shrink was freed.

    `str(event)` is one line, e.g. `"epoch 2, training step 6:
    micro-batches of 128 -> 256 rows, accumulation steps 1"` (the epoch
    counted from 1): the rows of a micro-batch before and after.

    Attributes:
        epoch: int. The epoch, counted from 0 as Keras callbacks count.
        step: int. The step that trained at the larger size.
        batch_size_before: int. The rows of a micro-batch before.
        batch_size_after: int. The rows from then on (the whole batch's
            when the batch trains whole again).
        accumulation_steps: int or `None`. The model's
            `accumulation_steps` from then on; `None` for a model without
            gradient accumulation.
        predicted: str. What let it grow (`"212.3 MiB in use before the
            step"`).
    """

    epoch: int
    step: int
    batch_size_before: int
    batch_size_after: int
    accumulation_steps: int | None
    predicted: str

    def __str__(self) -> str:
        accumulation = _accumulation_text(self.accumulation_steps)
        return (
            f"epoch {self.epoch + 1}, training step {self.step}: "
            f"micro-batches of {self.batch_size_before} -> "
            f"{self.batch_size_after} rows{accumulation}"
        )


def _accumulation_text(steps: int | None) -> str:
    """`", accumulation steps 4"`, or `""` for a model without them (or
    with one a window)."""
    return (
        "" if steps is None or steps == 1 else f", accumulation steps {steps}"
    )


class FitHistory(keras.callbacks.History):
    """The `keras.callbacks.History` that `tfmemsafe.fit` returns.

    Besides Keras' `epoch`, `history`, `params` and `model`, it says what
    recovery did.

    If `callbacks` holds a `keras.callbacks.History` of your own, `fit`
    records into that object and returns it, as `model.fit` does; it is
    made a `FitHistory` in place (its class becomes a subclass of both its
    own class and `FitHistory`), so it has these attributes too.

    Attributes:
        oom_events: list of `OOMEvent`. The out-of-memory errors recovered
            from, in order, after the pre-flight check's event if it split
            the batch (`phase == "preflight"`).
        grow_back_events: list of `GrowBackEvent`. The micro-batches grown
            back once the memory that made them shrink was freed
            (`grow_back_after` of `tfmemsafe.fit`), in order.
        batch_size: int or `None`. The training batch size, where the
            data says it (the first bucket's for length buckets); `None`
            until `fit` has ended, and for a `PyDataset` or generator.

    Example:
    >>> history = tfmemsafe.fit(model, x, y, batch_size=1024)
    >>> history.batch_size, [e.split_into for e in history.oom_events]
    (1024, [8])
    """

    def __init__(self):
        super().__init__()
        self.oom_events: list[OOMEvent] = []
        self.grow_back_events: list[GrowBackEvent] = []
        self.batch_size: int | None = None


def fit_history_of(callbacks: list) -> FitHistory:
    """The `History` in `callbacks`, made a `FitHistory`, or a new one."""
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.History):
            if not isinstance(callback, FitHistory):
                callback.__class__ = _with_fit_history(type(callback))
            callback.oom_events = []
            callback.grow_back_events = []
            callback.batch_size = None
            return callback
    return FitHistory()


@functools.cache
def _with_fit_history(cls: type) -> type:
    """`FitHistory`, or a subclass of both `cls` and `FitHistory`."""
    if cls is keras.callbacks.History:
        return FitHistory
    return type(cls.__name__, (cls, FitHistory), {"__module__": cls.__module__})
