"""Halving a batch after an out-of-memory error, and the one retry loop.

`retry_on_oom` is the path every out-of-memory error takes, in `fit`,
`evaluate`, `predict` and the trials of `find_max_batch_size`: the attempt
fails, `memory.is_oom_error` tells a failed allocation from anything else,
the failed phase's `Halving` halves its batch (or gives up with
`OutOfMemoryError`), the model lets go of what the attempt held, and the
caller recovers.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import TypeVar

import keras

from tfmemsafe import _messages
from tfmemsafe import memory
from tfmemsafe.errors import OutOfMemoryError

_Result = TypeVar("_Result")
_Failure = TypeVar("_Failure")


def retry_on_oom(
    model: keras.Model,
    attempt: Callable[[], _Result],
    on_oom: Callable[[Exception], _Failure],
    recover: Callable[[_Failure], _Result | None],
) -> _Result:
    """Runs `attempt()` until it returns, recovering from each OOM.

    Any error that `memory.is_oom_error` does not recognise, and
    `KeyboardInterrupt`, propagates at once, unchanged.

    Args:
        model: keras.Model. The model whose compiled functions are dropped
            after each failure (they are traced again at the new shapes).
        attempt: Callable. One try of the job; its result is returned.
        on_oom: Callable. Called with the out-of-memory error, inside the
            `except` block: halves the batch of the phase that failed
            (`Halving.halve`), or raises to give up (chained from the
            error). What it returns goes to `recover`.
        recover: Callable. Called out of the `except` block, once the
            failed attempt's frames and the tensors they held can be
            freed, and after `release(model)`: makes ready for the next
            attempt and logs. Returns `None` to try again, or a result to
            return instead.

    Returns:
        The result of the first attempt that finished, or of `recover`.
    """
    while True:
        try:
            return attempt()
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            failure = on_oom(err)
        release(model)
        result = recover(failure)
        if result is not None:
            return result


def release(model: keras.Model) -> None:
    """Drops what a failed attempt may hold, so its memory can be reused."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None
    # Keras' cached validation iterator; Keras has no public way to drop it.
    model._eval_epoch_iterator = None
    gc.collect()


def batch_floor(model: keras.Model, min_batch_size: int) -> int:
    """The smallest global batch: at least one sample per replica."""
    replicas = model.distribute_strategy.num_replicas_in_sync
    return max(min_batch_size, replicas)


class RetryBudget:
    """How many out-of-memory errors a call may still recover from.

    One budget is shared by the phases of a call: `fit`'s `max_retries`
    counts the halvings of training and validation together.

    Attributes:
        max_retries: int or `None`. The limit; `None` for none.
        used: int. The halvings so far.
    """

    def __init__(self, max_retries: int | None):
        self.max_retries = max_retries
        self.used = 0

    @property
    def used_up(self) -> bool:
        return self.max_retries is not None and self.used >= self.max_retries


class Halving:
    """The batch sizes of one phase, and when to stop halving them.

    Attributes:
        phase: str. `"training"`, `"validation"`, `"evaluation"` or
            `"prediction"`, for messages.
        requested: int. The batch size asked for, which `steps` count in.
        tried: list of int. The batch sizes used, the current one last
            (a pre-flight check may have replaced the one asked for).
        floor: int. The smallest batch size allowed.
        min_batch_size: int. The user's `min_batch_size`, for messages.
        budget: RetryBudget. Spent by each halving.
    """

    def __init__(
        self,
        phase: str,
        batch_size: int,
        *,
        model: keras.Model,
        min_batch_size: int,
        budget: RetryBudget,
    ):
        self.phase = phase
        self.requested = batch_size
        self.tried = [batch_size]
        self.floor = batch_floor(model, min_batch_size)
        self.min_batch_size = min_batch_size
        self.budget = budget

    @property
    def batch_size(self) -> int:
        return self.tried[-1]

    def scaled_steps(self, steps: int | None) -> int | None:
        """Steps that cover the same samples at the current batch size."""
        if steps is None:
            return None
        return math.ceil(steps * self.requested / self.tried[-1])

    def follow(self, other: Halving) -> None:
        """Takes `other`'s batch size, without spending the budget."""
        self.tried.append(other.batch_size)

    def shrink(self, halvings: int) -> int:
        """Halves `halvings` more times within the last retry.

        The jump to a size predicted to fit: it spends no budget and
        stops at the floor.

        Returns:
            The halvings done.
        """
        done = 0
        while done < halvings and self.batch_size // 2 >= self.floor:
            self.tried[-1] //= 2
            done += 1
        return done

    def halve(self, err: BaseException) -> int:
        """Halves the batch size, or raises OutOfMemoryError from `err`.

        Returns:
            The batch size before halving.
        """
        size = self.batch_size
        if self.budget.used_up:
            reason = "`max_retries` is used up"
        elif size // 2 < self.floor:
            reason = (
                f"half of it would be below `min_batch_size`="
                f"{self.min_batch_size}"
                if self.floor == self.min_batch_size
                else f"half of it would leave a replica with no sample "
                f"(the global batch must be >= {self.floor})"
            )
        else:
            self.tried.append(size // 2)
            self.budget.used += 1
            return size
        raise OutOfMemoryError(
            f"Could not fit a {self.phase} batch of {size} after trying "
            f"{_messages.format_sizes(self.tried)}, and {reason}. "
            f"{_messages.OOM_ADVICE}",
            self.tried,
        ) from err
