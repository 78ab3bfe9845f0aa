"""A callback that holds device memory, as something else would."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmemsafe import _checks

_PIECE_BYTES = 2**20


class HeldMemory(keras.callbacks.Callback):
    """Fills the allocator at one training step; lets go at the next.

    Like a tensor that something else in the process keeps from one step
    to the next (a callback's copy of a batch's outputs, a cache, a second
    model): the step runs out of memory with the allocator full, and all
    that happens between the error and the retry has next to no memory.
    It takes memory in 1 MiB pieces until an allocation fails, so it fits
    between the blocks the allocator has already carved. Use it in a child
    process under a cap (`run_with_memory_cap`): filling an uncapped
    allocator would take the machine's memory.

    Args:
        epoch: int. The epoch (from 0) of the step that finds it full.
        step: int. The step (batch index) within that epoch.
        forever: bool. Never let go: the run has to give up. Defaults to
            `False`.
        leave_mb: int. Megabytes (the last pieces taken, side by side) let
            go at once: the room the batch that ran out has to train in as
            micro-batches, in its step, while the rest is held. With 0
            there is next to none, and the run then usually ends in
            `tfmemsafe.OutOfMemoryError`. Defaults to 0.

    Raises:
        ValueError: If `epoch`, `step` or `leave_mb` is not an integer
            >= 0.

    Example:
    >>> def run():
    ...     history = tfmemsafe.fit(
    ...         model, (x, y), batch_size=256, epochs=2,
    ...         callbacks=[
    ...             tfmemsafe.testing.HeldMemory(epoch=1, step=1, leave_mb=64)
    ...         ],
    ...     )
    ...     return len(history.oom_events)
    >>> tfmemsafe.testing.run_with_memory_cap(run, cap_mb=300)
    1
    """

    def __init__(self, epoch: int, step: int, *, forever=False, leave_mb=0):
        super().__init__()
        self.at = (
            _checks.integer("epoch", epoch, 0),
            _checks.integer("step", step, 0),
        )
        self.forever = forever
        self.leave_mb = _checks.integer("leave_mb", leave_mb, 0)
        self.pieces = []
        self.epoch = None
        self.taken = False

    def on_train_begin(self, logs=None):
        self.pieces, self.epoch, self.taken = [], None, False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.pieces and not self.forever:
            self.pieces = []
        elif not self.taken and (self.epoch, batch) == self.at:
            self.taken = True
            try:
                while True:
                    self.pieces.append(tf.zeros((_PIECE_BYTES // 4,)))
            except tf.errors.ResourceExhaustedError:
                pass  # Full.
            del self.pieces[max(len(self.pieces) - self.leave_mb, 0) :]

    def release(self) -> None:
        """Lets go of everything held."""
        self.pieces = []
