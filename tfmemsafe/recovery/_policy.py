"""The batch sizes of one `tfmemsafe.fit` call, and how they shrink."""

from __future__ import annotations

from absl import logging

from tfmemsafe.recovery._retry import Halving
from tfmemsafe.recovery._retry import RetryBudget


class FitSizes:
    """The batch sizes of training and validation, and how they halve.

    Both phases spend one retry budget (`max_retries` counts both). Without
    a size of its own, validation follows training's halvings. Halving the
    training batch doubles an `AccumulatingModel`'s `accumulation_steps`
    when `keep_effective_batch_size` is on.
    """

    def __init__(self, model, settings, validation_source):
        self.model = model
        self.keep_effective_batch_size = settings.keep_effective_batch_size
        budget = RetryBudget(settings.max_retries)
        self.train = Halving(
            "training",
            settings.batch_size,
            model=model,
            min_batch_size=settings.min_batch_size,
            budget=budget,
        )
        self.validation = None
        self.validation_follows_training = False
        if validation_source is not None:
            size = settings.validation_batch_size
            if size is None:
                size = validation_source.batch_size
            self.validation_follows_training = size is None
            self.validation = Halving(
                "validation",
                size or settings.batch_size,
                model=model,
                min_batch_size=settings.min_batch_size,
                budget=budget,
            )
        self.warned_effective_batch = False

    def of(self, phase: str) -> Halving:
        return self.validation if phase == "validation" else self.train

    def halve(self, err: BaseException, phase: str):
        """Halves `phase`'s batch, or raises OutOfMemoryError from `err`.

        Returns:
            The batch size before, and the model's accumulation steps
            before and after (`None` for a model without them).
        """
        steps_before = accumulation_steps_of(self.model)
        before = self.of(phase).halve(err)
        if phase == "training" and self.validation_follows_training:
            self.validation.follow(self.train)
        return before, steps_before, self._follow(phase, before, 2)

    def shrink(self, phase: str, halvings: int) -> int | None:
        """Halves `phase`'s batch `halvings` more times, spending no retry.

        Returns:
            The model's accumulation steps after.
        """
        before = self.of(phase).batch_size
        done = self.of(phase).shrink(halvings)
        if not done:
            return accumulation_steps_of(self.model)
        if phase == "training" and self.validation_follows_training:
            self.validation.tried[-1] = self.train.batch_size
        return self._follow(phase, before, 2**done)

    def jump(self, phase: str, planner, source) -> None:
        """Halves `phase`'s batch, just halved after an error, on to the
        largest halving `planner` (a `SizePlanner`) predicts to fit."""
        self.shrink(phase, planner.halvings_after_error(self.of(phase), source))

    def _follow(self, phase: str, before: int, factor: int):
        """The accumulation steps after `phase`'s batch was divided by
        `factor`; doubles them for training (see `keep_effective_batch`)."""
        steps = accumulation_steps_of(self.model)
        if phase != "training":
            self.validation_follows_training = False
            return steps
        return self._keep_effective_batch(before, steps, factor)

    def _keep_effective_batch(self, before: int, steps: int | None, factor):
        after = self.train.batch_size
        if not self.keep_effective_batch_size:
            return steps
        if steps is None:
            if not self.warned_effective_batch:
                self.warned_effective_batch = True
                logging.warning(
                    "tfmemsafe.fit: %s has no `accumulation_steps`, so each "
                    "update now averages %d samples instead of %d. To keep "
                    "the effective batch, train a "
                    "`tfmemsafe.with_gradient_accumulation(model)`.",
                    self.model.name,
                    after,
                    before,
                )
            return None
        self.model.accumulation_steps = steps * factor
        if after * factor != before:
            logging.warning(
                "tfmemsafe.fit: the effective batch changes from %d to %d "
                "because batch size %d does not halve evenly.",
                before * steps,
                after * steps * factor,
                before,
            )
        return steps * factor


def accumulation_steps_of(model) -> int | None:
    """The model's `accumulation_steps`, or `None` if it has none."""
    steps = getattr(model, "accumulation_steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        return steps
    return None
