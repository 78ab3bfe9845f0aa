"""What lets a run go on after an out-of-memory error.

For `fit`: `EpochStart` (the `Snapshot` each epoch starts with),
`Position` (where training is, to resume at the failed step),
`ResumableCallbackList` (several `model.fit` calls seen by the callbacks
as one run) and `forget_epoch`.
"""

from __future__ import annotations

import dataclasses

import keras

from tfmemsafe._model_state import Reserve
from tfmemsafe._model_state import Snapshot
from tfmemsafe.estimate import devices_of


class EpochStart(keras.callbacks.Callback):
    """Keeps the state the current epoch started with, to go back to it.

    The copy is on disk (`Snapshot`), replaced at each epoch's start.
    Beside it, a `Reserve` of device memory is let go just before the
    copy is put back, so that it can be read back while something else
    holds all the rest.
    """

    def __init__(self):
        super().__init__()
        self.snapshot = None
        self.epoch = None
        self.reserve = None

    def on_epoch_begin(self, epoch, logs=None):
        # A retry starts at the epoch it has just restored: no new copy.
        if epoch != self.epoch:
            # The last epoch's copy goes first, so that the disk never
            # holds two: until a step of this epoch runs, the model is its
            # start, and needs no copy to be put back.
            if self.snapshot is not None:
                self.snapshot.close()
                self.snapshot = None
            self.snapshot = Snapshot(self.model)
            self.epoch = epoch
        if self.reserve is None:
            self.reserve = Reserve(devices_of(self.model))
        self.reserve.take()

    def restore(self) -> None:
        """Puts back the state of the start of the epoch, if one began."""
        if self.snapshot is None:
            return
        if self.reserve is not None:
            self.reserve.release()
        self.snapshot.restore()
        if self.reserve is not None:
            self.reserve.take()

    def close(self) -> None:
        """Deletes the copy and lets the reserve go: the run is over."""
        if self.snapshot is not None:
            self.snapshot.close()
            self.snapshot = None
        if self.reserve is not None:
            self.reserve.release()


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where the next attempt of a `fit` starts.

    Attributes:
        epoch: int. The epoch, counted from 0.
        skip: int. The training samples of `epoch` already done.
        validation_skip: int or `None`. `None` to train `epoch`; else only
            its validation remains, from this sample on.
        resumed_at_step: int or `None`. The step (of the epoch, or of its
            validation) it goes on at, for `OOMEvent`; `None` when the
            epoch starts again from its first step.
        refusal: str. Why training could not go on at the failed step.
        begun: bool. Whether the callbacks saw `epoch` begin: it goes on
            in that epoch, which they see begin only once.
        split: int. When not 0, the step at `resumed_at_step` is trained
            first as this many micro-batches and one update (`SplitBatch`),
            and `skip` counts batches (of data batched by length buckets).
    """

    epoch: int
    skip: int = 0
    validation_skip: int | None = None
    resumed_at_step: int | None = None
    refusal: str = ""
    begun: bool = False
    split: int = 0

    def describe(self) -> str:
        """Where it goes on, in words: `"step 3 of epoch 2"`."""
        epoch = self.epoch + 1
        if self.validation_skip is not None:
            if self.resumed_at_step:
                return (
                    f"validation step {self.resumed_at_step} of epoch {epoch}"
                )
            return f"the start of the validation of epoch {epoch}"
        if self.resumed_at_step is None:
            return f"the start of epoch {epoch} ({self.refusal})"
        return f"step {self.resumed_at_step} of epoch {epoch}"


class Position(keras.callbacks.Callback):
    """Knows where training is, and keeps what resuming there needs.

    It counts the steps and samples done in the epoch (and in its
    validation) across `model.fit` calls; before each step it has the
    `StepGuard` copy the small state the step can change; after a failure
    it holds the metric values to carry into the resumed call.

    Attributes:
        epoch: int. The current epoch, counted from 0.
        step: int. The batch within the epoch or within its validation.
        phase: str. `"training"` or `"validation"`.
        epoch_end_keys: tuple of str. The keys of the logs of the current
            epoch's `on_epoch_end`, once it has run.
        ending: bool. Whether the epoch's `on_epoch_end` has begun.
        steps_done, samples_done: int. Training steps and samples done in
            the epoch.
        validation_steps_done, validation_samples_done: int. The same for
            its validation.
        train_logs: dict. The epoch's training logs, once validation began.
        last_logs: dict or `None`. The latest step's or epoch's logs.
    """

    def __init__(self, initial_epoch: int, guard):
        super().__init__()
        self.guard = guard
        self.epoch = initial_epoch
        self.step = 0
        self.phase = "training"
        self.epoch_end_keys = ()
        self.ending = False
        self.steps_done = self.samples_done = 0
        self.validation_steps_done = self.validation_samples_done = 0
        self.train_logs = {}
        self.last_logs = None
        self._start = (0, 0, None)  # Steps, samples, batch size.
        self._validation_start = (0, 0, None)
        self._resuming = self._resuming_validation = False
        self._carried = None

    def start_epoch(self, skip: int, batch_size: int) -> None:
        """Before each `model.fit` call: it trains from sample `skip`."""
        self._resuming = bool(skip)
        if not skip:
            self.steps_done = self.samples_done = 0
        self._start = (self.steps_done, self.samples_done, batch_size)

    def start_validation(self, skip: int, batch_size: int | None) -> None:
        """Before a validation: it goes from sample `skip`."""
        self._resuming_validation = bool(skip)
        if not skip:
            self.validation_steps_done = self.validation_samples_done = 0
        self._validation_start = (
            self.validation_steps_done,
            self.validation_samples_done,
            batch_size,
        )

    def carry_metrics(self) -> None:
        """Keeps the metric values, to put back in the resumed call."""
        self._carried = self.guard.metric_values()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.step, self.phase = epoch, self.steps_done, "training"
        self.ending = False
        if self._resuming:
            # Keras has just reset the metrics: those of the steps done.
            self.guard.set_metric_values(self._carried)
        else:
            self.epoch_end_keys = ()

    def on_train_batch_begin(self, batch, logs=None):
        self.step = batch
        self.guard.save_small_state()

    def on_train_batch_end(self, batch, logs=None):
        steps, samples, size = self._start
        self.steps_done = batch + 1
        self.samples_done = samples + (batch + 1 - steps) * size
        self.last_logs = logs

    def on_test_begin(self, logs=None):
        self.phase, self.step = "validation", 0
        if self._resuming_validation:
            return
        # Keras' epoch logs are the last step's running metrics.
        self.train_logs = {
            name: float(value) for name, value in (self.last_logs or {}).items()
        }
        self.start_validation(0, self._validation_start[2])

    def on_test_batch_begin(self, batch, logs=None):
        self.step = batch
        if self._resuming_validation:
            # `evaluate` reset the metrics after `on_test_begin`.
            self.guard.set_metric_values(self._carried)
            self._resuming_validation = False
        self.guard.save_small_state()

    def on_test_batch_end(self, batch, logs=None):
        steps, samples, size = self._validation_start
        self.validation_steps_done = batch + 1
        self.validation_samples_done = samples + (batch + 1 - steps) * (
            size or 0
        )

    def on_test_end(self, logs=None):
        self.phase = "training"

    def on_epoch_end(self, epoch, logs=None):
        self.ending = True
        self.epoch_end_keys = tuple(logs or ())
        self.last_logs = logs

    def resume_point(self, *, update_began, steps_fixed, reproducible):
        """Where to go on after a failure in the current phase and step.

        Args:
            update_began: bool. Whether the failed step had begun an
                update (read before anything else trained).
            steps_fixed: bool. Whether the phase's steps are set by the
                user (`steps_per_epoch` or `validation_steps`).
            reproducible: bool or str. Whether the phase's data gives the
                same order again at the new batch size (`True`), or why
                it does not.

        Returns:
            A `ResumePoint`.
        """
        if self.phase == "validation":
            # Training of the epoch is done: it is never replayed. The
            # validation goes on at its failed step, or starts again.
            if reproducible is True and not steps_fixed:
                return ResumePoint(
                    self.epoch,
                    validation_skip=self.validation_samples_done,
                    resumed_at_step=self.validation_steps_done,
                )
            return ResumePoint(self.epoch, validation_skip=0, resumed_at_step=0)
        refusal = ""
        if self.ending:
            refusal = "it came after the epoch's last step"
        elif update_began:
            refusal = "an update had begun when memory ran out"
        elif steps_fixed:
            refusal = "`steps_per_epoch` is set"
        elif reproducible is not True:
            refusal = reproducible or (
                "the data does not give the same order again: shuffled "
                "without a fixed seed, or not deterministic"
            )
        if refusal:
            return ResumePoint(
                self.epoch, resumed_at_step=None, refusal=refusal
            )
        return ResumePoint(
            self.epoch,
            skip=self.samples_done,
            resumed_at_step=self.steps_done,
            begun=True,
        )

    def abandon_attempt(self) -> None:
        """A failed validation never reached `on_test_end`: training next."""
        self.phase = "training"


class ResumableCallbackList(keras.callbacks.CallbackList):
    """A `CallbackList` that makes several `model.fit` calls one run.

    Each callback gets `on_train_begin` once, at the start, and
    `on_train_end` once, at the end (`end_run`), so what callbacks reset
    there (`EarlyStopping`'s patience, `CSVLogger`'s file, `History.epoch`,
    `TensorBoard`'s step) carries on across epochs and retries. An epoch,
    or a validation, resumed at step k is one to them: no second
    `on_epoch_begin` (or `on_test_begin`), and batch indices that go on
    from k. A callback that a model's own `fit` adds on each call
    (`AccumulatingModel` does) gets its own `on_train_begin` and
    `on_train_end`, and is dropped after its call.
    """

    def __init__(self, callbacks, **kwargs):
        super().__init__(callbacks, **kwargs)
        self._own = list(self.callbacks)
        self._position = next(c for c in self._own if isinstance(c, Position))
        self._started = set()
        self._resumed_epoch = None
        self._offset = self._validation_offset = 0

    def set_params(self, params):
        super().set_params(params)
        # A resumed epoch's progress bar was made with the old step count.
        for callback in self.callbacks:
            bar = getattr(callback, "progbar", None)
            if isinstance(callback, keras.callbacks.ProgbarLogger) and bar:
                bar.target = callback.target

    def _added(self) -> list:
        own = {id(c) for c in self._own}
        return [c for c in self.callbacks if id(c) not in own]

    def on_train_begin(self, logs=None):
        if not self._started:
            super().on_train_begin(logs)
        else:
            for callback in self.callbacks:
                if id(callback) not in self._started:
                    callback.on_train_begin(logs)
        self._started.update(id(c) for c in self.callbacks)

    def on_train_end(self, logs=None):
        # The end of one `model.fit` call, not of the run.
        for callback in self._added():
            callback.on_train_end(logs)

    def end_run(self, logs=None) -> None:
        """`on_train_end` for every callback: the run is over."""
        super().on_train_end(logs)

    def resume_at(self, epoch: int | None, offset: int = 0) -> None:
        """Makes the next call's `epoch` go on from batch `offset`."""
        self._resumed_epoch = epoch
        self._offset = offset if epoch is not None else 0

    def resume_validation_at(self, offset: int) -> None:
        """Makes the next `evaluate` call go on from batch `offset`."""
        self._validation_offset = offset

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._resumed_epoch:
            # The callbacks saw this epoch begin; only its position resumes.
            self._position.on_epoch_begin(epoch, logs)
            return
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch + self._offset, logs)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch + self._offset, logs)

    def on_test_begin(self, logs=None):
        if self._validation_offset:
            self._on_begin()  # Keras' count of open begin/end blocks.
            self._position.on_test_begin(logs)  # The others saw it begin.
            return
        super().on_test_begin(logs)

    def on_test_batch_begin(self, batch, logs=None):
        super().on_test_batch_begin(batch + self._validation_offset, logs)

    def on_test_batch_end(self, batch, logs=None):
        super().on_test_batch_end(batch + self._validation_offset, logs)

    def end_call(self) -> None:
        """Drops what one `model.fit` or `evaluate` call added."""
        # Keras may run `on_train_batch_end` in a thread pool: let the
        # call's hooks finish before anything is restored. Keras'
        # `CallbackList` has no public way to wait for them.
        flush = getattr(self, "_flush_futures", None)
        if flush is not None:
            flush()
        own = {id(c) for c in self._own}
        self.callbacks = [c for c in self.callbacks if id(c) in own]
        # The dropped callbacks' ids may be reused by new objects.
        self._started &= own
        self._resumed_epoch = None
        self._offset = self._validation_offset = 0

    def abandon_attempt(self) -> None:
        """Forgets what the failed attempt left behind."""
        self.end_call()
        # A failed validation opened a test block that never closed; only
        # the training block is open.
        if hasattr(self, "_in_begin_end_block_count"):
            self._in_begin_end_block_count = 1


def forget_epoch(history: keras.callbacks.History, epoch: int, keys) -> None:
    """Drops `epoch` from `history` if it recorded it before failing."""
    if getattr(history, "epoch", None) and history.epoch[-1] >= epoch:
        history.epoch.pop()
        for key in keys:
            if history.history.get(key):
                history.history[key].pop()
