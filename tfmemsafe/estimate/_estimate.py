"""A measured memory model of a model's training step.

`estimate_memory` runs the model's real training step, as `model.fit`
compiles it, at a few small batch sizes, reads the allocator's peak after
each, and fits a line `peak = fixed + per_sample x batch` through those
past the floor (the peak that small batches share, see
`_probe.measure_default_sizes`). The `MemoryEstimate` it returns predicts the
peak at any batch size and the largest batch that fits a memory limit.
See docs/memory-estimate.md.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe._sources import source_for
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.estimate import _probe

# A probe is past the floor when it grew the peak over the first probe's
# by at least this share of what the largest probe grew it.
_PAST_FLOOR = 0.25


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The peak memory of a training step as a line in the batch size.

    `peak_bytes(b) = fixed_bytes + per_sample_bytes * b`, fitted to the
    allocator's peaks at the larger probe sizes in `measurements` (those
    past the floor that small batches share).
    The fixed part holds the weights, the optimizer state, the gradients
    and whatever else the process keeps on the device (a dataset's arrays,
    say); the per-sample part the activations kept for the backward pass
    and the batch itself.

    Attributes:
        device: str. The device measured; under a `tf.distribute`
            strategy, the replica device whose peak was highest.
        limit_bytes: int or `None`. The device's memory limit (see
            `tfmemsafe.memory_info`), if known.
        fixed_bytes: int. The line's value at batch 0.
        per_sample_bytes: float. The line's slope. Under a strategy, per
            sample of the global batch, on one replica device.
        measurements: tuple of `(batch_size, peak_bytes)` pairs, every
            probe, smallest first. Batch sizes are global.
    """

    device: str
    limit_bytes: int | None
    fixed_bytes: int
    per_sample_bytes: float
    measurements: tuple[tuple[int, int], ...]

    def peak_bytes(self, batch_size: int) -> int:
        """The predicted peak of a training step at `batch_size`.

        Args:
            batch_size: int. A (global) batch size.

        Returns:
            The predicted peak in bytes.
        """
        batch_size = _checks.integer("batch_size", batch_size, 1)
        return int(
            math.ceil(self.fixed_bytes + self.per_sample_bytes * batch_size)
        )

    def max_batch_size(
        self,
        limit_bytes: int | None = None,
        headroom: float = memory.HEADROOM,
        multiple: int = 1,
    ) -> int:
        """The largest batch whose predicted peak leaves `headroom` free.

        Args:
            limit_bytes: int or `None`. The memory to fit in; lets you ask
                about a device you do not have ("would batch 512 fit a
                16 GiB card?"). Defaults to `None`, the measured device's
                `limit_bytes`.
            headroom: float. The fraction of the limit to leave free, in
                [0, 1), for what the line does not see: the allocator's
                fragmentation, a different convolution algorithm at a
                larger size, other work on the device. Defaults to 0.1.
            multiple: int. Round down to a multiple of this (the number
                of replicas, say). Defaults to 1.

        Returns:
            The batch size, or 0 when not even `multiple` samples are
            predicted to fit.

        Raises:
            ValueError: If an argument is out of range, or `limit_bytes`
                is `None` and the device's limit is unknown.

        Example:
        >>> estimate.max_batch_size(limit_bytes=16 * 1024**3, multiple=8)
        4096
        """
        if limit_bytes is None:
            limit_bytes = self.limit_bytes
            if limit_bytes is None:
                raise ValueError(
                    f"`limit_bytes` is required: the memory limit of "
                    f"{self.device} is unknown. Received: limit_bytes=None"
                )
        limit_bytes = _checks.integer("limit_bytes", limit_bytes, 1)
        headroom = _checks.fraction("headroom", headroom)
        multiple = _checks.integer("multiple", multiple, 1)
        room = memory.usable_bytes(limit_bytes, headroom) - self.fixed_bytes
        if room < self.per_sample_bytes * multiple:
            return 0
        size = int(room // self.per_sample_bytes)
        return size - size % multiple

    def __str__(self) -> str:
        limit = (
            "limit unknown"
            if self.limit_bytes is None
            else f"limit {mib(self.limit_bytes)}"
        )
        lines = [
            f"MemoryEstimate on {self.device} ({limit})",
            f"  peak = {mib(self.fixed_bytes)} + "
            f"{self.per_sample_bytes / 1024:.1f} KiB x batch",
            f"  {'batch':>8}  {'measured':>12}  {'predicted':>12}  error",
        ]
        for size, peak in self.measurements:
            predicted = self.peak_bytes(size)
            lines.append(
                f"  {size:>8}  {mib(peak):>12}  {mib(predicted):>12}  "
                f"{100 * (predicted - peak) / peak:+.1f}%"
            )
        if self.limit_bytes is not None:
            lines.append(
                f"  largest batch with {100 * memory.HEADROOM:.0f}% headroom: "
                f"{self.max_batch_size()}"
            )
        return "\n".join(lines)


def estimate_memory(
    model: keras.Model,
    data,
    *,
    batch_sizes=None,
    device=None,
) -> MemoryEstimate:
    """Measures the peak memory of a training step at a few batch sizes.

    Runs the model's real training step, compiled as `model.fit` compiles
    it (its `train_step`, `jit_compile`, distribution strategy, dtype
    policy and loss scaling, an `AccumulatingModel`'s windows,
    `Checkpointed` layers), for two steps at each probe batch size. Before
    each probe it resets the device's peak-memory statistic, and after it
    reads the peak; a line `peak = fixed + per_sample x batch` is fitted to
    the peaks by least squares.

    The model is left exactly as it was found: its weights, optimizer
    variables (including `iterations`), metric states, accumulation
    windows and random-seed state are put back, as are `model.history`
    and its compiled functions. An optimizer that was not built yet is
    built (with zero state, as `fit` would build it).

    With `batch_sizes=None` it chooses the probes: doubling (quadrupling
    while the peak hardly grows) sizes from 8 (times the replicas), at
    most seven, never to a size predicted to grow the peak (over the line's
    value at batch 0) by more than 20% of the free memory, so that a
    batch four times the largest probe still fits; it stops earlier once
    the peak has grown by half the first probe's and the last two slopes
    agree within 15%. Small batches share a floor (the optimizer update,
    the data, on CPUs without oneDNN the capped buffers of Eigen's
    convolution gradients) that the line must not be fitted to: it is
    fitted to the probes past it (see `_fit_line`). Under a strategy,
    sizes are global and the peak is the highest of the replica devices.

    Args:
        model: A compiled `keras.Model`.
        data: Training data of any kind `tfmemsafe.fit` accepts. A few
            batches of it are read at each probe size.
        batch_sizes: list of int, or `None`. The probe sizes, at least
            two different ones, each small enough to fit. Defaults to
            `None`, chosen as above.
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
    source = source_for(data, "data", labelled=True)
    replicas = model.distribute_strategy.num_replicas_in_sync
    if batch_sizes is not None:
        batch_sizes = _check_batch_sizes(batch_sizes, replicas)
    return estimate_source(
        model, source, batch_sizes=batch_sizes, device=device
    )


def estimate_source(
    model: keras.Model,
    source,
    *,
    phase: str = "training",
    batch_sizes: list[int] | None = None,
    largest: int | None = None,
    device=None,
) -> MemoryEstimate:
    """`estimate_memory` on a checked `_sources.Source`, for any phase.

    Args:
        model: A compiled `keras.Model`.
        source: `_sources.Source`. The data.
        phase: str. The step to measure: `"training"` (`model.fit`),
            `"evaluation"` or `"validation"` (`model.evaluate`), or
            `"prediction"` (`model.predict`).
        batch_sizes: list of int or `None`. Checked probe sizes, sorted.
        largest: int or `None`. No default probe is larger than this
            (recovery passes half the size that ran out).
        device: As in `estimate_memory`.

    Returns:
        A `MemoryEstimate`.
    """
    replicas = model.distribute_strategy.num_replicas_in_sync
    devices = _probe.devices_of(model, device)
    limits = _probe.check_statistics(devices)
    probe = _probe.Probe(model, source, devices, phase)
    try:
        if batch_sizes is None:
            measurements = _probe.measure_default_sizes(
                probe, source, replicas, limits, largest
            )
        else:
            measurements = [probe.run(size) for size in batch_sizes]
    finally:
        probe.close()
    sizes = [size for size, _, _ in measurements]
    peaks = [peak for _, peak, _ in measurements]
    fixed, per_sample = _fit_line(sizes, peaks)
    if per_sample <= 0:
        raise MemoryEstimateError(
            "Could not estimate memory: the peak did not grow with the batch "
            f"size (batch sizes {sizes}, peaks {[mib(p) for p in peaks]}). "
            "Pass larger `batch_sizes`."
        )
    # The device whose peak was highest at the largest probe.
    device = measurements[-1][2]
    estimate = MemoryEstimate(
        device=device,
        limit_bytes=limits[device],
        fixed_bytes=int(round(fixed)),
        per_sample_bytes=float(per_sample),
        measurements=tuple(zip(sizes, peaks, strict=True)),
    )
    logging.info("tfmemsafe.estimate_memory (%s):\n%s", phase, estimate)
    return estimate


def _fit_line(sizes, peaks) -> tuple[float, float]:
    """The line `peak = fixed + per_sample * size` through the probes.

    Fitted to the probes past the floor: those that grew the peak over
    the smallest probe's by at least `_PAST_FLOOR` of what the largest
    grew it, and always the largest two. Least squares on them, made no
    shallower than the secant of the two largest, then moved up to pass
    no lower than any probe. A step's peak is the largest of many
    moments' memory, each growing linearly with the batch, so it bends
    upwards (the moment with the most activations takes over) and a line
    through smaller probes would fall short; probes on the floor would
    flatten it most. Where the peak barely grew, noise can make the
    largest probes' line fall; then it is fitted to all of them.
    """
    order = np.argsort(sizes)
    sizes = np.asarray(sizes, float)[order]
    peaks = np.asarray(peaks, float)[order]
    growth = peaks - peaks[0]
    past_floor = growth >= _PAST_FLOOR * growth[-1]
    past_floor[-2:] = True
    fixed, per_sample = _lifted_line(sizes[past_floor], peaks[past_floor])
    if per_sample <= 0:
        fixed, per_sample = _lifted_line(sizes, peaks)
    # The floor does not go away at larger batches: the line reads no
    # lower than any probe.
    fixed = max(fixed, float(np.max(peaks - per_sample * sizes)))
    return fixed, per_sample


def _lifted_line(sizes, peaks) -> tuple[float, float]:
    """Least squares, no shallower than the last secant, lifted to the last."""
    per_sample, fixed = np.polyfit(sizes, peaks, 1)
    (s1, s2), (p1, p2) = sizes[-2:], peaks[-2:]
    per_sample = max(per_sample, (p2 - p1) / (s2 - s1))
    fixed = max(fixed, p2 - per_sample * s2)
    return float(fixed), float(per_sample)


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
