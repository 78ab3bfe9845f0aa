"""The default probes' batch sizes: from a small one up, until the line
through their peaks is straight, the next would take too much of the
free memory, or the data (or the largest batch trained) ends them."""

from __future__ import annotations

import math

from tfmemsafe.errors import MemoryEstimateError

# Default probes. A step's peak is not a line from batch 1: at small
# batches a floor that no sample adds to sets it (the optimizer update,
# the data, and on oneDNN-off CPUs the im2col buffers of Eigen's
# convolution gradients, which Eigen caps: a floor for any conv net), and
# it grows with the batch only past that. So sizes
# are `_FIRST_PROBE`, four and sixteen times it, then double, and stop
# when
# - the next size is predicted (by the last slope) to grow the peak over
#   the line's value at batch 0 by more than `PROBE_BUDGET` of the free
#   memory (so that no probe runs out and a batch four times the largest
#   still fits): it is then cut to the largest size within the budget
#   and probed last (`_within_budget`);
# - or the peak has grown by at least `_GROWN` times the second probe's
#   (the per-sample part is a real share of it) and the last two slopes
#   agree to `_SLOPE_AGREEMENT` (the line is straight there);
# - or after `_MAX_PROBES` (each costs a `model.fit` of its steps);
# - or at the data's size (or the largest the caller asks for), the last
#   size cut to it where two sizes were probed before.
# "Free" is the limit less the model's state, the same in every process.
# The first size is probed twice and read the second time, and no
# decision reads the first probe's level, only slopes past it.
_FIRST_PROBE = 8
# The fewest samples the default probes need: their first two sizes.
FEWEST_PROBED = 4 * _FIRST_PROBE
_QUADRUPLED = 2
_MIN_PROBES = 3
_MAX_PROBES = 7
PROBE_BUDGET = 0.2
_GROWN = 1.5
_SLOPE_AGREEMENT = 0.15
# A last probe sized to the budget is run only this far past the largest.
_LAST_PROBE_STEP = 1.25


def measure_default_sizes(
    probe, source, replicas, limits, largest, budget=PROBE_BUDGET
) -> list:
    """The default probes' `(batch_size, peak_bytes, device)`, smallest
    first; `budget` is the fraction of the free memory they may grow the
    peak by (`PROBE_BUDGET` unless a caller probes nearer the limit)."""
    samples = source.num_samples
    if largest is not None:
        samples = largest if samples is None else min(samples, largest)
    # A global batch needs a sample per replica; none is larger than the data.
    size = replicas * max(1, _FIRST_PROBE // replicas)
    if samples is not None:
        size = min(size, max(replicas, samples - samples % replicas))
    # A first, unread probe: what the first `fit` on the data leaves for
    # the rest of them (a copy of a dataset's tensors, the traced step's
    # constants) is then in use before every probe that is read.
    probe.run(size)
    measurements = [probe.run(size)]
    free = free_bytes(probe, limits)
    last = False
    while len(measurements) < _MAX_PROBES and not last:
        size *= 4 if len(measurements) <= _QUADRUPLED else 2
        if samples is not None and size > samples:
            # Cut to the data (or `largest`), and probed last, past the
            # first two sizes.
            size = samples - samples % replicas
            if (
                len(measurements) < 2
                or size < _LAST_PROBE_STEP * measurements[-1][0]
            ):
                break
            last = True
        if len(measurements) >= 2:
            if _straight(measurements):
                break
            size, predicted, cut = _within_budget(
                measurements, size, free, replicas, budget
            )
            if size is None:
                break
            last = last or cut
            if not probe.room_for(predicted):
                break  # Something else holds memory now: stay safe.
        measurements.append(probe.run(size))
    if len(measurements) < 2:
        raise MemoryEstimateError(
            "Could not estimate memory: the data has too few samples for "
            f"two probe batch sizes (at most {samples}). Pass `batch_sizes`."
        )
    return measurements


def _straight(measurements) -> bool:
    """Whether the peak has grown well past the floor along a line."""
    (s0, p0, _), (s1, p1, _), (s2, p2, _) = ([(0, 0, None)] + measurements)[-3:]
    slope = (p2 - p1) / (s2 - s1)
    before = (p1 - p0) / (s1 - s0)
    second = measurements[1][1]
    return (
        len(measurements) >= _MIN_PROBES + 1
        and p2 - second >= _GROWN * second
        and slope > 0
        and abs(slope - before) <= _SLOPE_AGREEMENT * slope
    )


def _within_budget(measurements, size, free, replicas, budget):
    """`(size, predicted_peak, last)` for the next probe, `size` at most.

    Growth is counted from the line's value at batch 0, not from a probe
    (which may sit on the floor), so that four times the largest probe is
    predicted to grow the peak by at most 4 x `budget` of the free
    memory. The slope is the widest secant's, from the second probe: one
    step scheduled with more at once in a middle probe then moves it
    least. A size over the budget is cut to the largest within it, and
    that probe is the last (`last`): so where the probes end moves a
    little with the readings, not by a factor two (a conv net's probes
    used to end at 128 in some processes and 256 in others, and the
    line through them differed by a quarter). `size` is `None` when not
    even `_LAST_PROBE_STEP` times the largest probe is within it.
    """
    (s1, p1, _), (s2, p2, _) = measurements[-2:]
    if len(measurements) >= 3:
        s1, p1, _ = measurements[1]
    slope = max((p2 - p1) / (s2 - s1), 0)
    base = min(measurements[1][1], max(p2 - slope * s2, 0))
    last = False
    if free is not None and slope > 0:
        within = s2 + (budget * free + base - p2) / slope
        if size > within:
            size = _rounded_down(int(within), replicas)
            if size < _LAST_PROBE_STEP * s2:
                return None, None, True
            last = True
    return size, p2 + slope * (size - s2), last


def _rounded_down(size: int, replicas: int) -> int:
    """`size` down to a multiple of 8 (and of the replicas)."""
    step = 8 * replicas // math.gcd(8, replicas)
    return size - size % step


def free_bytes(probe, limits) -> int | None:
    """The least memory the model's state (and the data's tensors, where
    they count) leaves below a device's limit."""
    free = [
        limit - probe.counted_bytes(device)
        for device, limit in limits.items()
        if limit
    ]
    return min(free) if free else None
