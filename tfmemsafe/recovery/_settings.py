"""What one `tfmemsafe.fit` call asks for, checked and fixed for the run."""

from __future__ import annotations

import dataclasses

from tfmemsafe._sources import Source


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """What one `tfmemsafe.fit` call asks for, checked; fixed for the run.

    Attributes:
        train_source: Source. The training data.
        validation_source: Source or `None`. The validation data.
        batch_size: int. The training batch size to start at.
        validation_batch_size: int or `None`. The user's
            `validation_batch_size`.
        epochs: int. The epoch to stop at.
        initial_epoch: int. The epoch to start at.
        steps_per_epoch: int or `None`. At the first batch size.
        validation_steps: int or `None`. At the first validation batch
            size.
        min_batch_size: int. The smallest batch size to try.
        max_retries: int or `None`. How many errors to recover from.
        keep_effective_batch_size: bool. Whether to double the model's
            `accumulation_steps` when the training batch halves.
        preflight: bool. Whether to estimate the training step's memory
            before the first step and start at a size predicted to fit.
        memory_estimate: bool. Whether memory may be estimated at all
            (the pre-flight check, and the jump after an error).
        grow_back_after: int or `None`. The clean training steps after a
            shrink before the batch may grow back; `None` never.
        verbose: `"auto"`, 0, 1 or 2.
        other_arguments: dict. The other `model.fit` arguments, passed to
            every attempt as they are.
    """

    train_source: Source
    validation_source: Source | None
    batch_size: int
    validation_batch_size: int | None
    epochs: int
    initial_epoch: int
    steps_per_epoch: int | None
    validation_steps: int | None
    min_batch_size: int
    max_retries: int | None
    keep_effective_batch_size: bool
    preflight: bool
    memory_estimate: bool
    grow_back_after: int | None
    verbose: int | str
    other_arguments: dict
