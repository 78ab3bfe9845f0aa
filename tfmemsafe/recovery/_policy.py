"""The batch sizes of one call, and the one place they change.

A `SizePolicy` alone holds, for each phase of a `fit`, `evaluate`,
`predict` or batch-search call, the size asked for, the sizes tried and
the floor; the retry budget the phases share; the rule that validation
without a size of its own follows training; and the accumulation steps
that keep the effective batch. Each change comes back as a
`SizeDecision`, which the caller logs and records; the policy asks the
`SizePlanner` how far to go, and never logs.
"""

from __future__ import annotations

import dataclasses
import math

import keras

from tfmemsafe import _messages
from tfmemsafe.errors import OutOfMemoryError

TRAINING = "training"
VALIDATION = "validation"


@dataclasses.dataclass(frozen=True)
class SizeDecision:
    """One change of a phase's batch size, as the policy made it.

    Attributes:
        phase: str. `"training"`, `"validation"`, `"evaluation"` or
            `"prediction"`.
        batch_size_before: int. The size that ran out (or, before the
            first step, that was predicted not to fit).
        batch_size_after: int. The size to go on with.
        accumulation_steps_before: int or `None`. The model's
            `accumulation_steps` before; `None` for a model without them.
        accumulation_steps_after: int or `None`. After.
        predicted: str. What the planner predicted, when it chose the
            size (`"peak 812.3 MiB predicted against 90% of 450.0 MiB on
            CPU:0"`); `""` for a plain halving.
        effective_batch: str. What happens to the samples each update
            averages, when that changes; `""` when it is kept.
    """

    phase: str
    batch_size_before: int
    batch_size_after: int
    accumulation_steps_before: int | None
    accumulation_steps_after: int | None
    predicted: str = ""
    effective_batch: str = ""

    def describe(self) -> str:
        """`"batch size 4096 -> 512 with accumulation steps 8"`, and why."""
        text = f"batch size {self.batch_size_before} -> {self.batch_size_after}"
        steps = self.accumulation_steps_after
        if steps is not None and steps != self.accumulation_steps_before:
            text += f" with accumulation steps {steps}"
        if self.predicted:
            text += f" ({self.predicted})"
        if self.effective_batch:
            text += f". {self.effective_batch}"
        return text


class _PhaseSizes:
    """One phase's sizes: the one asked for, those tried, the floor."""

    def __init__(self, requested: int, floor: int):
        self.requested = requested
        self.tried = [requested]
        self.floor = floor

    @property
    def batch_size(self) -> int:
        return self.tried[-1]


class SizePolicy:
    """The batch sizes of every phase of one call, and how they change.

    Args:
        model: The `keras.Model`. Its `accumulation_steps`, if it has
            them, are written here and nowhere else.
        sizes: dict. Each phase's batch size to start at; `None` for
            validation means it follows training's size.
        min_batch_size: int. The user's `min_batch_size`.
        max_retries: int or `None`. Out-of-memory errors to recover from,
            across all phases; `None` for no limit.
        keep_effective_batch_size: bool. Whether halving the training
            batch doubles the model's `accumulation_steps`.
    """

    def __init__(
        self,
        model: keras.Model,
        sizes: dict,
        *,
        min_batch_size: int,
        max_retries: int | None,
        keep_effective_batch_size: bool = True,
    ):
        self.model = model
        self.min_batch_size = min_batch_size
        self.max_retries = max_retries
        self.retries = 0
        self.keep_effective_batch_size = keep_effective_batch_size
        self._steps_asked = accumulation_steps_of(model)
        # A model without `accumulation_steps` is told so once a call.
        self._said_no_accumulation = False
        replicas = model.distribute_strategy.num_replicas_in_sync
        self.floor = max(min_batch_size, replicas)
        self.follows_training = (
            VALIDATION in sizes and sizes[VALIDATION] is None
        )
        self._phases = {
            phase: _PhaseSizes(size or sizes[TRAINING], self.floor)
            for phase, size in sizes.items()
        }

    def batch_size(self, phase: str) -> int:
        return self._phases[phase].batch_size

    def requested(self, phase: str) -> int:
        return self._phases[phase].requested

    def tried(self, phase: str) -> tuple[int, ...]:
        return tuple(self._phases[phase].tried)

    def scaled_steps(self, phase: str, steps: int | None) -> int | None:
        """`steps` at the size asked for, made to cover the same samples."""
        if steps is None:
            return None
        sizes = self._phases[phase]
        return math.ceil(steps * sizes.requested / sizes.batch_size)

    def halve(self, phase: str, err: BaseException) -> SizeDecision:
        """Halves `phase`'s batch after `err`, spending one retry.

        Called inside the `except` block, so that giving up is chained.

        Raises:
            OutOfMemoryError: From `err`, if `max_retries` is used up or
                half would be below the floor.
        """
        sizes = self._phases[phase]
        size = sizes.batch_size
        if self._retries_used_up():
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
            self.retries += 1
            steps = self._accumulation_steps()
            self._shrink(phase, 1, new_size=True)
            return self._decision(phase, size, steps, final=False)
        raise OutOfMemoryError(
            f"Could not fit a {phase} batch of {size} after trying "
            f"{_messages.format_sizes(sizes.tried)}, and {reason}. "
            f"{_messages.OOM_ADVICE}",
            list(sizes.tried),
        ) from err

    def spend_retry(self) -> bool:
        """Spends one retry on a recovery that keeps the sizes (a split
        batch); `False` when `max_retries` is used up."""
        if self._retries_used_up():
            return False
        self.retries += 1
        return True

    def _retries_used_up(self) -> bool:
        return self.max_retries is not None and self.retries >= self.max_retries

    def jump(self, decision: SizeDecision, planner, source) -> SizeDecision:
        """`decision` (a halving) taken on to the largest halving `planner`
        (a `SizePlanner`) predicts to fit, within the same retry."""
        phase = decision.phase
        size = self.batch_size(phase)
        halvings, predicted = planner.halvings(
            phase,
            source,
            size,
            self.floor,
            largest_probe=size,
            just_failed=True,
        )
        self._shrink(phase, halvings, new_size=False)
        return self._decision(
            phase,
            decision.batch_size_before,
            decision.accumulation_steps_before,
            predicted,
        )

    def preflight(self, planner, source) -> SizeDecision | None:
        """The training size to start at, when the planner predicts that
        the size asked for does not fit; spends no retry."""
        size = self.batch_size(TRAINING)
        steps = self._accumulation_steps()
        halvings, predicted = planner.halvings(
            TRAINING, source, size, self.floor, largest_probe=size // 2
        )
        # The size asked for never ran: it is replaced, not kept as tried.
        if not self._shrink(TRAINING, halvings, new_size=False):
            return None
        return self._decision(TRAINING, size, steps, predicted)

    def growth_sizes(self) -> list[int]:
        """The training sizes it could grow back to, largest first.

        Sizes this call trained at or tried before that halve to the
        current one (an odd size's halves are rounded down: 3007 to 1503)
        by a power of two that divides the accumulation steps (so the
        effective batch is kept).
        """
        size = self.batch_size(TRAINING)
        steps = self._accumulation_steps()
        divide = bool(steps) and self.keep_effective_batch_size
        sizes = set()
        for larger in self._phases[TRAINING].tried:
            factor = halving_factor(larger, size)
            if factor and (not divide or steps % factor == 0):
                sizes.add(larger)
        return sorted(sizes, reverse=True)

    def grow(self, batch_size: int, predicted: str) -> SizeDecision:
        """Training's batch back to `batch_size`, one of `growth_sizes()`,
        once the memory that made it shrink is predicted to be free
        (`predicted` says so); spends no retry. Validation that follows
        training follows it, and the accumulation steps are divided so
        that each update averages the same samples."""
        sizes = self._phases[TRAINING]
        before = sizes.batch_size
        steps = self._accumulation_steps()
        sizes.tried.append(batch_size)
        if self.follows_training:
            self._phases[VALIDATION].tried.append(batch_size)
        if steps and self.keep_effective_batch_size:
            factor = halving_factor(batch_size, before)
            self.model.accumulation_steps = steps // factor
        return self._decision(TRAINING, before, steps, predicted)

    def restore(self, tried, accumulation_steps) -> SizeDecision:
        """Goes on with the training sizes a stopped job stored."""
        steps = self._accumulation_steps()
        self._phases[TRAINING].tried = [int(size) for size in tried]
        if accumulation_steps is not None and steps is not None:
            self.model.accumulation_steps = int(accumulation_steps)
        if self.follows_training:
            self._phases[VALIDATION].tried.append(self.batch_size(TRAINING))
        return self._decision(TRAINING, self.tried(TRAINING)[-2], steps)

    def _shrink(self, phase: str, halvings: int, *, new_size: bool) -> int:
        """Halves `phase`'s batch `halvings` times, or down to the floor.

        With `new_size`, the smaller size is a new one tried; else it
        replaces the current one (the jump within a retry, the pre-flight
        check). Validation that follows training follows it; training's
        halvings multiply the model's `accumulation_steps` when the
        effective batch is kept.

        Returns:
            The halvings done.
        """
        size = self.batch_size(phase)
        done = 0
        while done < halvings and size // 2 >= self.floor:
            size //= 2
            done += 1
        if not done:
            return 0
        changed = [phase]
        if phase == TRAINING and self.follows_training:
            changed.append(VALIDATION)
        elif phase == VALIDATION:
            self.follows_training = False
        for each in changed:
            tried = self._phases[each].tried
            if new_size:
                tried.append(size)
            else:
                tried[-1] = size
        steps = self._accumulation_steps()
        if phase == TRAINING and steps and self.keep_effective_batch_size:
            self.model.accumulation_steps = steps * 2**done
        return done

    def _decision(
        self, phase, before, steps_before, predicted="", *, final=True
    ) -> SizeDecision:
        """The change from `before` to the current size. What each update
        averages is said only in a `final` decision (a halving is not:
        the jump may take it further)."""
        note = ""
        if phase == TRAINING and final:
            note = self._effective_batch_note()
        return SizeDecision(
            phase=phase,
            batch_size_before=before,
            batch_size_after=self.batch_size(phase),
            accumulation_steps_before=steps_before,
            accumulation_steps_after=self._accumulation_steps(),
            predicted=predicted,
            effective_batch=note,
        )

    def _effective_batch_note(self) -> str:
        """What each update averages now, where it is not what was asked."""
        steps = self._accumulation_steps()
        asked = self.requested(TRAINING) * (self._steps_asked or 1)
        now = self.batch_size(TRAINING) * (steps or 1)
        if now == asked or window_closes_by_size(self.model):
            # A window of so many samples (or tokens) keeps them itself.
            return ""
        if steps is None:
            if self._said_no_accumulation:
                return ""
            self._said_no_accumulation = True
            return (
                f"Each update now averages {now} samples instead of "
                f"{asked}: {self.model.name} has no `accumulation_steps` "
                "(to keep the effective batch, train a "
                "`tfmemsafe.with_gradient_accumulation(model)`)"
            )
        if not self.keep_effective_batch_size:
            return (
                f"Each update now averages {now} samples instead of "
                f"{asked} (keep_effective_batch_size=False)"
            )
        return (
            f"The effective batch changes from {asked} to {now}: batch "
            f"size {self.requested(TRAINING)} does not halve evenly"
        )

    def _accumulation_steps(self) -> int | None:
        return accumulation_steps_of(self.model)


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


def halving_factor(larger: int, smaller: int) -> int:
    """The power of two that `larger` halves to `smaller` by (halves
    rounded down: 15 to 7 to 3 is 4), or 0 if it does not."""
    if larger <= smaller or smaller < 1:
        return 0
    factor = 1 << ((larger // smaller).bit_length() - 1)
    return factor if larger // factor == smaller else 0
