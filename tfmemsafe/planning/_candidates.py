"""The candidates of a plan and their predicted peaks: `predicted`; the
choice among them: `chosen`.

For a model (as it is, or with its blocks recomputed), the whole batch and
halvings of it as micro-batches, each predicted by the memory model (the
static bound first, probes only where the bound does not settle it).
"""

from __future__ import annotations

from tfmemsafe import _checks
from tfmemsafe import estimate as estimate_lib
from tfmemsafe import memory
from tfmemsafe.planning._memory_plan import Candidate
from tfmemsafe.planning._size_planner import SizePlanner

# Step times this close are one speed, on a machine whose load moves
# them: the simpler candidate is chosen.
_CLOSE = 0.05

# Candidates predicted to fit, per model: the fewest micro-batches, and
# twice as many, for where the first does not train within the limit.
FITTING_PER_MODEL = 2


def limit_of(memory_limit, devices) -> int | None:
    """The bytes to plan within: the devices' smallest limit, or less."""
    known = [memory.memory_info(d).limit_bytes for d in devices]
    device_limit = min((b for b in known if b), default=None)
    if memory_limit is None:
        return device_limit
    _checks.integer("memory_limit", memory_limit, 1)
    return (
        memory_limit
        if device_limit is None
        else min(memory_limit, device_limit)
    )


def predicted(
    planned, model, source, rows, limit, split, every=False, fewer_than=None
) -> list[Candidate]:
    """Candidates from the whole batch to the fewest micro-batches
    predicted to fit, and twice as many (the whole batch alone without
    `split`; with `every`, every halving down to one row; with
    `fewer_than`, none of that many micro-batches or more); each with its
    prediction."""
    recompute = planned is not model
    if limit is None:
        # Nothing can fit an unknown limit: the whole batch is measured,
        # and split as it runs out.
        why = "the device's memory limit is unknown"
        return [Candidate(1, rows, recompute, None, why, None)]
    planner = SizePlanner(planned, "tfmemsafe.plan", memory_estimate=True)
    sums = estimate_lib.gradient_bytes(planned)
    candidates, fitting = [], 0
    micro = rows
    while micro >= 1 and (every or fitting < FITTING_PER_MODEL):
        pieces = -(-rows // micro)
        if fewer_than is not None and pieces >= fewer_than:
            break
        peak, by = planner.peak_bytes(
            "training",
            source,
            micro,
            largest_probe=max(1, rows // 2),
            limit=limit,
            beside=sums if pieces > 1 else 0,  # The split's gradient sums.
        )
        if peak is None:
            # Nothing predicts: the whole batch is measured, and split as
            # it runs out.
            return [Candidate(1, rows, recompute, None, by, None)]
        fits = memory.fits_within(peak, limit)
        fitting += fits
        candidates.append(
            Candidate(pieces, micro, recompute, int(peak), by, fits)
        )
        micro = micro // 2 if micro > 1 and split else 0
    return candidates


def chosen(candidates) -> Candidate:
    """The first measured candidate (the simplest: no recomputation,
    then fewer micro-batches) within `_CLOSE` of the fastest; without one,
    the one predicted to need least memory (or the last considered)."""
    trained = [c for c in candidates if c.trained]
    if trained:
        fastest = min(c.step_seconds for c in trained)
        return next(
            c
            for c in _simplest_first(trained)
            if c.step_seconds <= fastest * (1 + _CLOSE)
        )
    with_prediction = [
        c
        for c in candidates
        if c.predicted_peak_bytes is not None
        and not c.note.startswith("failed")
    ]
    if with_prediction:
        return min(with_prediction, key=lambda c: c.predicted_peak_bytes)
    return candidates[-1]


def _simplest_first(candidates) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.checkpointing, c.micro_batches))
