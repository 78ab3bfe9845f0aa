"""A measured memory model of a model's training step.

`estimate_memory` runs the model's real training step, as `model.fit`
compiles it, at a few small batch sizes, reads the allocator's peak of
each (the step's growth over what was in use, plus the model's counted
state: the same in every process), and fits a line
`peak = fixed + per_sample x batch` through the largest (past the floor
that small batches share, see `_probe_sizes.measure_default_sizes`). With
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
from tfmemsafe import _messages
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe._sources import source_for
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.estimate import _graph
from tfmemsafe.estimate import _lengths
from tfmemsafe.estimate import _probe
from tfmemsafe.estimate import _probe_sizes
from tfmemsafe.estimate._result import MemoryEstimate

# The probes the line's slope is fitted to: the largest three.
_FITTED = 3


def estimate_memory(
    model: keras.Model,
    data,
    *,
    batch_sizes=None,
    lengths=None,
    device=None,
    verbose="auto",
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
        verbose: `"auto"`, 0 or 1, as `model.fit` takes it: 1 (and
            `"auto"`) shows a progress bar of the probes, with each one's
            batch size and peak; 0 shows nothing. Defaults to `"auto"`.

    Returns:
        A `MemoryEstimate`.

    Raises:
        MemoryEstimateError: If the device keeps no memory statistics, or
            the peak did not grow with the batch size.
        OutOfMemoryError: If a probe ran out of memory.
        TypeError: If `model` or `data` is of the wrong kind.
        ValueError: If an argument is out of range, or `device` is not
            one this process has.

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
    _checks.verbose(verbose)
    return estimate_source(
        model,
        source,
        batch_sizes=batch_sizes,
        lengths=lengths,
        device=device,
        verbose=verbose,
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
    probe_budget: float = _probe_sizes.PROBE_BUDGET,
    guarded: bool = False,
    verbose=0,
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
        largest: int or `None`. No default probe, at any length, is
            larger than this (the pre-flight check and the planner pass half
            the batch, `find_max_batch_size` its `max_batch_size`, length
            buckets the most examples a bucket holds).
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
        verbose: `"auto"`, 0 or 1. A progress bar of the probes, as
            `model.fit`'s. Defaults to 0.

    Returns:
        A `MemoryEstimate`.
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    devices = _probe.devices_of(model, device)
    limits = _probe.check_statistics(devices)
    # Every process's allocator laid out alike before the probes read it.
    memory.reserve_one_region()
    progress = _messages.progress_bar(
        f"tfmemsafe: measuring the {phase} step's memory", verbose, "probe"
    )
    probe = _probe.Probe(
        model,
        source,
        devices,
        phase,
        limits,
        guarded=guarded,
        progress=progress,
    )
    try:
        if batch_sizes is None:
            measurements = _probe_sizes.measure_default_sizes(
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
            free = _probe_sizes.free_bytes(probe, limits)
            line = (fixed, per_sample)
            second = _lengths.measure_lengths(
                probe,
                model,
                source,
                lengths,
                measurements,
                line,
                free,
                largest,
            )
    finally:
        probe.close()
        if progress is not None:
            progress.update(len(probe.tried), finalize=True)
    # The device whose peak was highest at the largest probe.
    device = measurements[-1][2]
    traced = _graph.per_sample_bytes(model, source.sample_inputs())
    # Per sample of the global batch, on one replica device, in one
    # micro-batch of an `AccumulatingModel`.
    split = replicas * getattr(model, "accumulation_steps", 1)
    largest_tensor = 0.0 if traced is None else traced.largest / split
    if lengths:
        second["largest_tensor_lengths"] = _lengths.largest_at_lengths(
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
        step_spread=probe.step_spread,
        **second,
    )
    logging.info("tfmemsafe.estimate_memory (%s):\n%s", phase, estimate)
    return estimate


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
    batch_sizes = list(batch_sizes)
    if not all(_checks.is_integer(size, replicas) for size in batch_sizes):
        raise ValueError(
            f"`batch_sizes` must be integers of at least {replicas}. "
            f"Received: batch_sizes={batch_sizes!r}"
        )
    sizes = [int(size) for size in batch_sizes]
    if len(set(sizes)) < 2:
        raise ValueError(
            "`batch_sizes` must hold at least two different sizes, to fit "
            f"a line through. Received: batch_sizes={batch_sizes!r}"
        )
    if any(size % replicas for size in sizes):
        raise ValueError(
            f"`batch_sizes` must be multiples of the {replicas} replicas: "
            "they are global batch sizes. "
            f"Received: batch_sizes={batch_sizes!r}"
        )
    return sorted(sizes)
