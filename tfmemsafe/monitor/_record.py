"""What a `MemoryMonitor` records: its readings, and where a run is."""

from __future__ import annotations

import dataclasses

_PHASES = ("train", "evaluate", "predict")


@dataclasses.dataclass(frozen=True, slots=True)
class MemorySample:
    """One reading of one device's memory, taken after a batch.

    Attributes:
        epoch: The epoch (from 0), or `None` in `evaluate()` or `predict()`
            called outside `fit()`.
        batch: The batch index Keras gave the hook, within the epoch (or the
            evaluation or prediction run).
        step: How many batches of this phase came before this one since
            `fit()` started: the x axis of `plot()` and of TensorBoard.
        phase: `"train"`, `"evaluate"` (validation inside `fit()`, or
            `model.evaluate()`) or `"predict"`.
        device: The device name, e.g. `"GPU:0"`.
        current_mb: Megabytes in use after the batch.
        peak_mb: The most megabytes in use since the epoch (or run) began.
        limit_mb: The device's limit in megabytes, or `None` if unknown.
        source: `"allocator"` (TensorFlow's allocator statistics) or
            `"process_rss"` (the process's resident memory, used for a CPU
            without allocator statistics; its peak is the highest reading).
    """

    epoch: int | None
    batch: int
    step: int
    phase: str
    device: str
    current_mb: float
    peak_mb: float
    limit_mb: float | None
    source: str


@dataclasses.dataclass
class Record:
    """What a `MemoryMonitor` records in one run; new in `on_train_begin`."""

    # Every reading, in order.
    samples: list[MemorySample] = dataclasses.field(default_factory=list)
    # The peak in MB per device, per epoch of fit() ...
    epoch_peaks: dict[int, dict[str, float]] = dataclasses.field(
        default_factory=dict
    )
    # ... and per evaluate() or predict() run outside it.
    run_peaks: dict[str, dict[str, float]] = dataclasses.field(
        default_factory=dict
    )
    # Batches of each phase since the run began: the samples' `step`.
    steps: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_PHASES, 0)
    )
    # Batches of each phase since the epoch (or run) began.
    calls: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_PHASES, 0)
    )
    epoch: int | None = None
    in_fit: bool = False
    # Whether fit(), evaluate() or predict() has run with the monitor.
    started: bool = False
    # Whether this epoch (or run) has warned already.
    warned: bool = False

    def where(self, phase: str, batch: int | None) -> str:
        """Says where the run is, e.g. "in epoch 2 (batch 5)"."""
        if not self.in_fit:
            where = f"in {phase}()"
        elif phase == "train":
            where = f"in epoch {self.epoch}"
        else:
            where = f"in the validation of epoch {self.epoch}"
        if batch is not None:
            where += f" (batch {batch})"
        return where

    def first_near_limit(
        self, peak: int, limit: int | None, warn_at: float | None
    ) -> bool:
        """Whether `peak` passes `warn_at` of `limit` first this epoch (or run).

        It counts as the epoch's (or run's) warning, whether or not the
        monitor logs it.
        """
        if (
            self.warned
            or warn_at is None
            or not limit
            or peak < warn_at * limit
        ):
            return False
        self.warned = True
        return True
