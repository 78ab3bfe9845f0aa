"""When a training batch that shrank after an out-of-memory error grows back.

A batch that ran out because something else held memory for a while (a
cache, another model, fragmentation that cleared) need not stay small for
the rest of training. `GrowBack` watches the steps after a shrink: once
`grow_back_after` of them have trained cleanly, it asks the `SizePolicy`
which larger sizes this call had, and the `SizePlanner` whether one of
them fits again now (what ran out is a measurement that only freed memory
overrules, see `SizePlanner.fits_again`). At a step where one does, it
stops the `model.fit` call with `GrowNow`, and the runner applies the
policy's `grow` and goes on at the next step. A size that runs out a
second time in the same epoch is not tried again in that epoch.
"""

from __future__ import annotations

import collections
import dataclasses

import keras
from absl import logging

from tfmemsafe import distribute
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe.history import GrowBackEvent
from tfmemsafe.recovery._policy import TRAINING
from tfmemsafe.recovery._policy import SizeDecision
from tfmemsafe.recovery._policy import accumulation_steps_of
from tfmemsafe.recovery._policy import halving_factor


@dataclasses.dataclass(frozen=True)
class Growth:
    """A size to grow back to, and the prediction that lets it."""

    batch_size: int
    predicted: str


class GrowNow(Exception):  # noqa: N818 (a signal, not an error)
    """Stops a `model.fit` call after a step, to grow the batch back."""

    def __init__(self, growth: Growth):
        super().__init__(f"grow back to {growth.batch_size}")
        self.growth = growth


class GrowBack(keras.callbacks.Callback):
    """Counts the clean steps after a shrink; says when to grow back.

    Args:
        after: int or `None`. The clean training steps after a shrink
            before it may grow back; `None` never.
        policy: The call's `SizePolicy` (asked for the sizes it had).
        planner: The call's `SizePlanner` (asked whether they fit now).
        source: The training `Source`.
        mid_epoch: bool. Whether an epoch can go on at any step at another
            batch size (else it grows only between epochs).

    Attributes:
        clean_steps: int. Training steps done since the last shrink.
    """

    def __init__(self, after, *, policy, planner, source, mid_epoch: bool):
        super().__init__()
        self.after = after
        self.policy = policy
        self.planner = planner
        self.source = source
        self.mid_epoch = mid_epoch
        self.clean_steps = 0
        self._epoch = None
        self._failures = collections.Counter()  # Size -> errors this epoch.

    @classmethod
    def for_run(cls, model, settings, policy, planner) -> GrowBack:
        """The `GrowBack` of a `tfmemsafe.fit` call's `FitSettings`.

        It never grows under a multi-worker strategy (workers could decide
        differently); it grows mid-epoch where the epoch can go on at any
        step at another size (as after an error, `Position`), else (length
        buckets, whose batches hold other examples at another size)
        between epochs.
        """
        source = settings.train_source
        after = settings.grow_back_after
        if distribute.is_multi_worker(model.distribute_strategy):
            after = None
        mid_epoch = (
            settings.steps_per_epoch is None
            and source.position_is_reproducible(settings.batch_size) is True
        )
        return cls(
            after,
            policy=policy,
            planner=planner,
            source=source,
            mid_epoch=mid_epoch,
        )

    def grown(self, history, decision: SizeDecision, epoch, step) -> None:
        """Counts anew from a growth; records and logs it."""
        self.clean_steps = 0
        history.grow_back_events.append(
            GrowBackEvent(
                epoch=epoch,
                step=step,
                batch_size_before=decision.batch_size_before,
                batch_size_after=decision.batch_size_after,
                accumulation_steps=decision.accumulation_steps_after,
                predicted=decision.predicted,
            )
        )
        logging.warning(
            "tfmemsafe.fit: memory was freed: %s. Going on at step %d of "
            "epoch %d.",
            decision.describe(),
            step,
            epoch + 1,
        )

    def shrunk(self, epoch: int, batch_size: int) -> None:
        """Notes that `batch_size` ran out of memory in `epoch`."""
        self._new_epoch(epoch)
        self._failures[batch_size] += 1
        self.clean_steps = 0

    def waiting(self) -> bool:
        """Whether enough clean steps have passed for it to grow back."""
        return self.after is not None and self.clean_steps >= self.after

    def growth(self, epoch: int) -> Growth | None:
        """The size to grow back to now, if any, in `epoch`."""
        self._new_epoch(epoch)
        if not self.waiting():
            return None
        current = self.policy.batch_size(TRAINING)
        for size in self.policy.growth_sizes():
            if self._failures[size] >= 2 or not self._window_splits(
                halving_factor(size, current)
            ):
                continue
            predicted = self.planner.fits_again(TRAINING, self.source, size)
            if predicted:
                return Growth(size, predicted)
        return None

    def on_train_batch_end(self, batch, logs=None):
        self.clean_steps += 1
        if not self.mid_epoch or self.after is None:
            return
        total = self.params.get("steps")
        if total is None or batch + 1 >= total:
            return  # The epoch's end: it grows, if at all, before the next.
        growth = self.growth(self._epoch)
        if growth is not None:
            raise GrowNow(growth)

    def on_epoch_begin(self, epoch, logs=None):
        self._new_epoch(epoch)

    def _new_epoch(self, epoch) -> None:
        if epoch != self._epoch:
            self._epoch = epoch
            self._failures.clear()

    def _window_splits(self, factor: int) -> bool:
        """Whether the micro-batches of the open accumulation window make
        whole ones of `factor` times their size (if the steps divide)."""
        if (
            not self.policy.keep_effective_batch_size
            or accumulation_steps_of(self.model) is None
        ):
            return True
        return all(
            int(accumulator.pending_micro_batches) % factor == 0
            for accumulator in gradient_accumulators_of(self.model)
        )
