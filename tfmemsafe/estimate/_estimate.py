"""A measured memory model of a model's training step.

`estimate_memory` runs the model's real training step, as `model.fit`
compiles it, at a few small batch sizes, reads the allocator's peak of
each (the step's growth over what was in use, plus the model's counted
state: the same in every process), and fits a line
`peak = fixed + per_sample x batch` through the largest (past the floor
that small batches share, see `_probe.measure_default_sizes`). With
`lengths`, it also probes samples made longer, and the per-sample part
becomes a polynomial in the length (`_lengths`). The `MemoryEstimate` it
returns predicts the peak at any batch size (and length) and the largest
batch that fits a memory limit. See docs/memory-estimate.md.
"""

from __future__ import annotations

import keras
import numpy as np
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe._sources import source_for
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.estimate import _graph
from tfmemsafe.estimate import _lengths
from tfmemsafe.estimate import _probe
from tfmemsafe.estimate._result import MemoryEstimate

# The probes the line's slope is fitted to: the largest three.
_FITTED = 3
# A length's second probe is at most this many times its first.
_LENGTH_PROBE_SPAN = 4
# What a length adds to the fixed part is extrapolated by the length's
# steepest power (16 times at four times the length, for a transformer's
# quadratic), so a pair of probes that makes it more than this share of
# the first's growth is read again: one low reading of the second (252.8
# MB where five other processes read 307.3, at 64 samples of 256 tokens)
# made 26.6 MB at 256 tokens into 400 MB at 1024.
_CONFIRMED_EXCESS = 0.05


def estimate_memory(
    model: keras.Model,
    data,
    *,
    batch_sizes=None,
    lengths=None,
    device=None,
) -> MemoryEstimate:
    """Measures the peak memory of a training step at a few batch sizes.

    Runs the model's real training step, compiled as `model.fit` compiles
    it (its `train_step`, `jit_compile`, distribution strategy, dtype
    policy and loss scaling, an `AccumulatingModel`'s windows,
    `Checkpointed` layers), for five steps at each probe batch size. A
    probe's peak is its median step's growth over the memory in use
    before it, plus the model's state counted from its variables: so
    what something else holds, and what ran before (training,
    `evaluate`, `predict`, an earlier estimate), changes no reading. A
    line `peak = fixed + per_sample x batch` is fitted to the largest
    probes (see `_fit_line`).

    The model is left exactly as it was found: its weights, optimizer
    variables (including `iterations`), metric states, accumulation
    windows and random-seed state are put back, as are `model.history`
    and its compiled functions. An optimizer that was not built yet is
    built (with zero state, as `fit` would build it).

    With `batch_sizes=None` it chooses the probes (`_probe`): 8 (times
    the replicas), 32, 128, then doubling, at most seven; it stops before
    a size that would not fit beside what is in use now; a size
    predicted to grow the peak by more than 20% of the memory the model's
    state leaves below the limit is cut to the largest within it and
    probed last (so that a batch four times the largest probe still
    fits); and earlier, after four, once the peak has grown by 1.5
    times the second probe's and the last two slopes agree within 15%.
    Under a strategy, sizes are global and the peak is the highest of the
    replica devices.

    With `lengths`, the data's samples are also made longer (or shorter)
    along axis 1, repeating their own values, and the step is probed at
    each length at two batch sizes: the per-sample part becomes a
    polynomial in the length, with the powers that the traced forward
    pass's tensors hold (a GRU's are linear in it, attention's scores
    quadratic). `peak_bytes(batch_size, length=...)` and
    `max_batch_size(length=...)` then answer for any length.

    Args:
        model: A compiled `keras.Model`.
        data: Training data of any kind `tfmemsafe.fit` accepts. A few
            batches of it are read at each probe size.
        batch_sizes: list of int, or `None`. The probe sizes, at least
            two different ones, each small enough to fit. Defaults to
            `None`, chosen as above.
        lengths: list of int, or `None`. Other lengths (axis 1 of the
            inputs) to probe, besides the data's own; the model must
            accept inputs of any length there. Defaults to `None`: no
            second dimension.
        device: str or `tf.config.LogicalDevice`. The device to read.
            Defaults to `None`: the replica devices of the model's
            strategy, or `tfmemsafe.default_devices()`.

    Returns:
        A `MemoryEstimate`.

    Raises:
        MemoryEstimateError: If the device keeps no memory statistics, or
            the peak did not grow with the batch size.
        OutOfMemoryError: If a probe ran out of memory.
        TypeError: If `model` or `data` is of the wrong kind.
        ValueError: If an argument is out of range.

    Example:
    >>> estimate = tfmemsafe.estimate_memory(model, (x, y))
    >>> estimate.max_batch_size()
    1184
    >>> estimate.peak_bytes(512) / 2**20
    181.3
    """
    _checks.compiled_model(model, "estimate_memory")
    source = source_for(
        data, "data", labelled=True, strategy=model.distribute_strategy
    )
    replicas = model.distribute_strategy.num_replicas_in_sync
    if batch_sizes is not None:
        batch_sizes = _check_batch_sizes(batch_sizes, replicas)
    if lengths is not None:
        lengths = _check_lengths(lengths, source)
    return estimate_source(
        model, source, batch_sizes=batch_sizes, lengths=lengths, device=device
    )


def estimate_source(
    model: keras.Model,
    source,
    *,
    phase: str = "training",
    batch_sizes: list[int] | None = None,
    lengths: list[int] | None = None,
    largest: int | None = None,
    device=None,
    probe_budget: float = _probe.PROBE_BUDGET,
    guarded: bool = False,
) -> MemoryEstimate:
    """`estimate_memory` on a checked `_sources.Source`, for any phase.

    Args:
        model: A compiled `keras.Model`.
        source: `_sources.Source`. The data.
        phase: str. The step to measure: `"training"` (`model.fit`),
            `"evaluation"` or `"validation"` (`model.evaluate`), or
            `"prediction"` (`model.predict`).
        batch_sizes: list of int or `None`. Checked probe sizes, sorted.
        lengths: list of int or `None`. Checked other lengths, sorted.
        largest: int or `None`. No default probe is larger than this
            (recovery passes half the size that ran out).
        device: As in `estimate_memory`.
        probe_budget: float. The share of the free memory (the limit less
            the model's state) that the default probes may grow the peak
            by. The larger, the nearer the limit the line is measured,
            and the less it is extrapolated (a line through probes of a
            fifth of the free memory fell short by 12 to 16% at sizes
            that filled it, on a transformer; see `tfmemsafe.data.
            memory_buckets`). Defaults to `PROBE_BUDGET`, 0.2.
        guarded: bool. Measure the training step as `tfmemsafe.fit` trains
            it, with the step guard's barrier and ordered updates (see
            `_step_guard`), where none is installed already. Defaults to
            `False`: the step as plain `model.fit` runs it.

    Returns:
        A `MemoryEstimate`.
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    devices = _probe.devices_of(model, device)
    limits = _probe.check_statistics(devices)
    # Every process's allocator laid out alike before the probes read it.
    memory.reserve_one_region()
    probe = _probe.Probe(model, source, devices, phase, limits, guarded=guarded)
    try:
        if batch_sizes is None:
            measurements = _probe.measure_default_sizes(
                probe, source, replicas, limits, largest, probe_budget
            )
        else:
            measurements = [probe.run(size) for size in batch_sizes]
        sizes = [size for size, _, _ in measurements]
        peaks = [peak for _, peak, _ in measurements]
        fixed, per_sample = _fit_line(sizes, peaks)
        if per_sample <= 0:
            raise MemoryEstimateError(
                "Could not estimate memory: the peak did not grow with the "
                f"batch size (batch sizes {sizes}, peaks "
                f"{[mib(p) for p in peaks]}). Pass larger `batch_sizes`."
            )
        second = {}
        if lengths:
            free = _probe.free_bytes(probe, limits)
            line = (fixed, per_sample)
            second = _measure_lengths(
                probe, model, source, lengths, measurements, line, free
            )
    finally:
        probe.close()
    # The device whose peak was highest at the largest probe.
    device = measurements[-1][2]
    traced = _graph.per_sample_bytes(model, source.sample_inputs())
    # Per sample of the global batch, on one replica device, in one
    # micro-batch of an `AccumulatingModel`.
    split = replicas * getattr(model, "accumulation_steps", 1)
    largest_tensor = 0.0 if traced is None else traced.largest / split
    if lengths:
        second["largest_tensor_lengths"] = _largest_at_lengths(
            model, source, lengths, split
        )
    estimate = MemoryEstimate(
        device=device,
        limit_bytes=limits[device],
        fixed_bytes=int(round(fixed)),
        per_sample_bytes=float(per_sample),
        measurements=tuple(zip(sizes, peaks, strict=True)),
        state_bytes=probe.state_bytes,
        largest_tensor_bytes=largest_tensor,
        data_bytes=probe.data_on(device),
        **second,
    )
    logging.info("tfmemsafe.estimate_memory (%s):\n%s", phase, estimate)
    return estimate


def _largest_at_lengths(model, source, lengths, split):
    """`(length, bytes)`: the traced step's largest tensor per sample (of
    the global batch, on one replica device) at each of `lengths`."""
    pairs = []
    for length in lengths:
        traced = _graph.per_sample_bytes(model, source.sample_inputs(), length)
        if traced is not None:
            pairs.append((int(length), traced.largest / split))
    return tuple(pairs)


def _measure_lengths(probe, model, source, lengths, measurements, line, free):
    """The per-sample and fixed parts' polynomials in the length.

    At each length, two batch sizes: the first holds about half as many
    elements as the largest probe of the data's own length (fewer, if the
    length's power predicts it to grow the peak by more than `allowed`:
    twice what the largest probe did, at most half the free memory); the
    second is as large as the first's reading predicts to grow the peak
    by `allowed`, two to `_LENGTH_PROBE_SPAN` times the first. The
    length's per-sample part is what the second holds above the data's
    length's `fixed`, per sample: its average, not the pair's slope, which
    at 512 tokens came from batches of 1 and 2 and read 12 to 20 MiB a
    sample where 7 samples held 18.6 each. What the first holds above
    the line through the second is what the length adds to the fixed
    part; where that is more than `_CONFIRMED_EXCESS` of the first's
    growth, both probes are read again, and it must show in both
    readings. (Where the polynomial falls below a probe, the estimate is
    raised there: `MemoryEstimate.per_sample_bytes_at`.)
    """
    fixed, slope = line
    base = _lengths.base_length(source)
    powers = _graph.length_powers(model, source.sample_inputs(), base)
    if powers is None:
        raise MemoryEstimateError(
            "Could not estimate memory at other lengths: the model could "
            f"not be traced with inputs of another length than {base}."
        )
    replicas = model.distribute_strategy.num_replicas_in_sync
    top, top_peak, _ = measurements[-1]
    grown = max(top_peak - measurements[0][1], slope * top)
    allowed = 2 * grown if free is None else min(2 * grown, free / 2)
    points, slopes, triples, excess = [base], [slope], [], [0.0]

    def run(batch_size):
        arguments = _lengths.resized_arguments(
            source, batch_size, length, _probe._PROBE_STEPS
        )
        _, peak, _ = probe.run(batch_size, arguments)
        triples.append((batch_size, length, peak))
        return peak

    for length in lengths:
        ratio = (length / base) ** max(powers)
        size = max(replicas, int(top * base / length) // 2)
        # Predicted growth at `size`, by the steepest power the graph has.
        while size > replicas and slope * size * ratio > allowed:
            size //= 2
        first = max(size - size % replicas, replicas)
        low = run(first)
        # Per sample at the first, with what the length adds to the fixed.
        each = max(low - fixed, 1.0) / first
        second = min(int(allowed / each), _LENGTH_PROBE_SPAN * first)
        second = max(second - second % replicas, 2 * first)
        while second > 2 * first and not probe.room_for(fixed + each * second):
            second = max(second // 2 - second // 2 % replicas, 2 * first)
        high = run(second)
        average, added = _per_sample_and_added(
            fixed, (first, low), (second, high)
        )
        if added > _CONFIRMED_EXCESS * max(low - fixed, 1.0):
            # Each read again: the higher at the second (a step can reach
            # it), the lower at the first (both must show what is added).
            high = max(high, run(second))
            low = min(low, run(first))
            average, added = _per_sample_and_added(
                fixed, (first, low), (second, high)
            )
        points.append(length)
        slopes.append(average)
        excess.append(max(added, 0.0))
    coefficients = _lengths.fit_powers(points, slopes, powers)
    fixed_coefficients = _lengths.fit_powers(
        points, excess, powers, relative=False
    )
    if _lengths.polynomial(coefficients, base) <= 0:
        raise MemoryEstimateError(
            "Could not estimate memory at other lengths: the peak did not "
            f"grow with the batch at length {base} "
            f"(slopes {[round(s) for s in slopes]} bytes a sample)."
        )
    return {
        "length": base,
        "length_coefficients": coefficients,
        "length_fixed_coefficients": fixed_coefficients,
        "length_measurements": tuple(triples),
    }


def _per_sample_and_added(fixed, low, high) -> tuple[float, float]:
    """`(per_sample, added)` of a length's pair of probes, `(size, peak)`
    each: per sample, the average over the fixed part at the larger; added,
    what the smaller holds beyond that (what the length adds to the fixed
    part)."""
    (first, low_peak), (second, high_peak) = low, high
    per_sample = max(high_peak - fixed, 0.0) / second
    return per_sample, low_peak - fixed - per_sample * first


def _fit_line(sizes, peaks) -> tuple[float, float]:
    """The line `peak = fixed + per_sample * size` through the probes.

    Its slope is the least-squares slope of the largest `_FITTED` probes.
    A step's peak is the largest of many moments' memory, each growing
    linearly with the batch, so it bends upwards (the moment with the
    most activations takes over) and the largest probes are the nearest
    to the slope beyond; three of them rather than the last two, so that
    one probe whose median step happened to hold a little less or more
    (an MLP's 1024 read 35.1 MiB where the line through its neighbours
    reads 40) does not tilt it. The line then passes no lower than any
    probe (the floor does not go away at larger batches). If the peak
    fell, the least-squares line through all of them.
    """
    order = np.argsort(sizes)
    sizes = np.asarray(sizes, float)[order]
    peaks = np.asarray(peaks, float)[order]
    per_sample, _ = np.polyfit(sizes[-_FITTED:], peaks[-_FITTED:], 1)
    if per_sample <= 0:
        per_sample, _ = np.polyfit(sizes, peaks, 1)
    fixed = float(np.max(peaks - per_sample * sizes))
    return fixed, float(per_sample)


def _check_lengths(lengths, source) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise TypeError(
            "`lengths` must be a list of integers or None. "
            f"Received: lengths={lengths!r}"
        )
    checked = sorted({_checks.integer("lengths", n, 1) for n in lengths})
    base = _lengths.base_length(source)
    if base is None:
        raise ValueError(
            "`lengths` needs data whose inputs have a length, a second "
            "axis after the batch's. Received data whose sample shapes "
            f"are {[shape for shape, _ in source.sample_signature()]}"
        )
    checked = [n for n in checked if n != base]
    if not checked:
        raise ValueError(
            f"`lengths` must hold a length other than the data's own, "
            f"{base}. Received: lengths={list(lengths)!r}"
        )
    return checked


def _check_batch_sizes(batch_sizes, replicas: int) -> list[int]:
    if isinstance(batch_sizes, (str, bytes)) or not hasattr(
        batch_sizes, "__iter__"
    ):
        raise TypeError(
            "`batch_sizes` must be a list of integers or None. "
            f"Received: batch_sizes={batch_sizes!r}"
        )
    sizes = [_checks.integer("batch_sizes", s, replicas) for s in batch_sizes]
    if len(set(sizes)) < 2:
        raise ValueError(
            "`batch_sizes` must hold at least two different sizes, to fit "
            f"a line through. Received: batch_sizes={list(batch_sizes)!r}"
        )
    if any(size % replicas for size in sizes):
        raise ValueError(
            f"`batch_sizes` must be multiples of the {replicas} replicas: "
            "they are global batch sizes. "
            f"Received: batch_sizes={list(batch_sizes)!r}"
        )
    return sorted(sizes)
