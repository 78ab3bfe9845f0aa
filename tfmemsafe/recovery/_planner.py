"""Batch sizes predicted to fit: the pre-flight check and the jump.

A `SizePlanner` makes one `MemoryEstimate` per phase when it is first
needed (before training, for `fit`'s pre-flight check, or after a phase's
first out-of-memory error) and says how many halvings of a batch size it
takes for the predicted peak to leave `HEADROOM` of the device's limit
free, its per-sample part taken `EXTRAPOLATION_MARGIN` larger beyond the
largest probe. Recovery then jumps there in one retry instead of halving
once per error. When no estimate can be made (the device keeps no
statistics or its limit is unknown, a multi-worker job, a probe ran out
of memory, the peak did not grow), it says why once, and recovery halves
one step at a time as before.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.history import OOMEvent
from tfmemsafe.recovery._policy import accumulation_steps_of

# The fraction of the device's limit a predicted peak must leave free:
# room for what the line does not see (fragmentation, another
# convolution algorithm at a larger size), as `max_batch_size` leaves.
HEADROOM = 0.1
# Beyond the largest probe, the per-sample part of a prediction is taken
# this much larger: the line is extrapolated there, and errors measured
# at 4x the largest probe reached -14% to -20% (docs/memory-estimate.md);
# a batch chosen by the line alone then ran out in one benchmark run of
# two.
EXTRAPOLATION_MARGIN = 0.25


class SizePlanner:
    """One memory estimate per phase, and the halvings it predicts.

    Attributes:
        estimates: dict. Phase to its `MemoryEstimate`, or to `None` when
            none could be made (it is not tried again).
    """

    def __init__(self, model: keras.Model, caller: str):
        self.model = model
        self.caller = caller
        self.estimates = {}

    def estimate(self, phase: str, source, largest: int):
        """The phase's estimate, made now if not yet tried; or `None`."""
        if phase not in self.estimates:
            self.estimates[phase] = self._make(phase, source, largest)
        return self.estimates[phase]

    def _make(self, phase: str, source, largest: int):
        why = None
        if distribute.is_multi_worker(self.model.distribute_strategy):
            why = "a multi-worker job (the workers could choose differently)"
        else:
            try:
                made = estimate_lib.estimate_source(
                    self.model, source, phase=phase, largest=largest
                )
            except (MemoryEstimateError, OutOfMemoryError) as err:
                why = str(err)
            except Exception as err:  # noqa: BLE001
                # Left for the real step to raise, where the callbacks see it.
                why = f"estimating raised {type(err).__name__}"
            else:
                if made.limit_bytes is not None:
                    return made
                why = f"the memory limit of {made.device} is unknown"
        logging.info(
            "%s: no memory estimate for %s, so it halves once per "
            "out-of-memory error: %s",
            self.caller,
            phase,
            why,
        )
        return None

    def halvings(
        self,
        phase: str,
        source,
        batch_size: int,
        floor: int,
        *,
        largest_probe: int,
    ) -> int:
        """How many halvings of `batch_size` the estimate predicts to fit.

        The fewest `k` for which `batch_size // 2**k` is predicted to leave
        `HEADROOM` of the limit free, or the most that stay at or above
        `floor` when none is; 0 without an estimate.

        Args:
            phase: str. `"training"`, `"validation"`, `"evaluation"` or
                `"prediction"`.
            source: `_sources.Source`. The phase's data.
            batch_size: int. The batch size to start from.
            floor: int. The smallest batch size allowed.
            largest_probe: int. No probe is larger (half a size that ran
                out, or half the size asked for).
        """
        made = self.estimate(phase, source, largest_probe)
        if made is None:
            return 0
        limit = made.limit_bytes * (1.0 - HEADROOM)
        count = 0
        while _peak(made, batch_size) > limit and batch_size // 2 >= floor:
            batch_size //= 2
            count += 1
        return count

    def halvings_after_error(self, sizes, source) -> int:
        """The further halvings of `sizes` (a `Halving`, just halved after
        an error) predicted to fit, probing below its current size."""
        return self.halvings(
            sizes.phase,
            source,
            sizes.batch_size,
            sizes.floor,
            largest_probe=sizes.batch_size,
        )

    def describe(self, phase: str, batch_size: int) -> str:
        """`"peak 812.3 MiB predicted against 90% of 450.0 MiB on CPU:0"`."""
        made = self.estimates[phase]
        return (
            f"peak {_mib(_peak(made, batch_size))} predicted against "
            f"{100 * (1 - HEADROOM):.0f}% of {_mib(made.limit_bytes)} on "
            f"{made.device}"
        )


def preflight(planner: SizePlanner, sizes, source, settings):
    """`fit`'s pre-flight check: the largest halving predicted to fit.

    Shrinks `sizes` (a `FitSizes`) to it, before the callbacks start
    (estimating trains), and says so in one log line.

    Returns:
        The `OOMEvent` (phase `"preflight"`) to record, in a list; empty
        when the batch asked for is predicted to fit or there is no
        estimate.
    """
    train = sizes.train
    requested = train.batch_size
    halvings = planner.halvings(
        "training",
        source,
        requested,
        train.floor,
        largest_probe=requested // 2,
    )
    if not halvings:
        return []
    predicted = planner.describe("training", requested)
    steps_before = accumulation_steps_of(planner.model)
    accumulation_steps = sizes.shrink("training", halvings)
    start = f"{train.batch_size}"
    if accumulation_steps and accumulation_steps != steps_before:
        start += (
            f" with accumulation steps {accumulation_steps} (the "
            "effective batch is kept)"
        )
    logging.warning(
        "tfmemsafe.fit: pre-flight check: batch size %d is predicted not "
        "to fit (%s). Starting at %s.",
        requested,
        predicted,
        start,
    )
    event = OOMEvent(
        epoch=settings.initial_epoch,
        step=0,
        phase="preflight",
        batch_size_before=requested,
        batch_size_after=train.batch_size,
        accumulation_steps=accumulation_steps,
        error=predicted,
        resumed_at_step=0,
    )
    return [event]


def _peak(made, batch_size: int) -> float:
    """The predicted peak, with `EXTRAPOLATION_MARGIN` beyond the probes."""
    largest_probe = max(size for size, _ in made.measurements)
    beyond = max(0, batch_size - largest_probe)
    margin = EXTRAPOLATION_MARGIN * made.per_sample_bytes * beyond
    return made.peak_bytes(batch_size) + margin


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
