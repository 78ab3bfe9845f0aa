"""A measured memory model of a model's training step.

`estimate_memory` runs the model's real training step, as `model.fit`
compiles it, at a few small batch sizes, reads the allocator's peak after
each, and fits a line `peak = fixed + per_sample x batch` through those
past the floor (the peak that small batches share, see
`_measure_default_sizes`). The `MemoryEstimate` it returns predicts the
peak at any batch size and the largest batch that fits a memory limit.
See docs/memory-estimate.md.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import keras
import numpy as np
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._model_state import ModelState
from tfmemsafe._sources import source_for
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError

_MIB = 1024 * 1024
# Training steps per probe: the first step allocates what only it needs
# (the optimizer's first update, tracing); the second shows the steady one.
_PROBE_STEPS = 2
# Default probes. A step's peak is not a line from batch 1: at small
# batches a floor that no sample adds to sets it (the optimizer update,
# the data, and on oneDNN-off CPUs the im2col buffers of Eigen's
# convolution gradients, capped at ~30 MB each: a floor of 60-70 MiB for
# any conv net), and it grows with the batch only past that. So sizes
# double from `_FIRST_PROBE` (quadruple while the peak has grown by less
# than `_SMALL_GROWTH` of the free memory), and stop when
# - the next size is predicted (by the last slope) to grow the peak over
#   the line's value at batch 0 by more than `_PROBE_BUDGET` of the free
#   memory, so that no probe runs out and a batch four times the largest
#   still fits;
# - or the peak has grown by at least `_GROWN` times the first probe's
#   (the per-sample part is a real share of it) and the last two slopes
#   agree to `_SLOPE_AGREEMENT` (the line is straight there);
# - or after `_MAX_PROBES` (each costs a retrace).
# The line is fitted to the probes past the floor: see `_fit_line`.
_FIRST_PROBE = 8
_MIN_PROBES = 3
_MAX_PROBES = 7
_PROBE_BUDGET = 0.2
_SMALL_GROWTH = 0.01
_GROWN = 1.5
_SLOPE_AGREEMENT = 0.15
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
            else f"limit {_mib(self.limit_bytes)}"
        )
        lines = [
            f"MemoryEstimate on {self.device} ({limit})",
            f"  peak = {_mib(self.fixed_bytes)} + "
            f"{self.per_sample_bytes / 1024:.1f} KiB x batch",
            f"  {'batch':>8}  {'measured':>12}  {'predicted':>12}  error",
        ]
        for size, peak in self.measurements:
            predicted = self.peak_bytes(size)
            lines.append(
                f"  {size:>8}  {_mib(peak):>12}  {_mib(predicted):>12}  "
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
    devices = _devices(model, device)
    limits = _check_statistics(devices)
    probe = _Probe(model, source, devices, phase)
    try:
        if batch_sizes is None:
            measurements = _measure_default_sizes(
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
            f"size (batch sizes {sizes}, peaks {[_mib(p) for p in peaks]}). "
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


def _measure_default_sizes(probe, source, replicas, limits, largest) -> list:
    samples = source.num_samples
    if largest is not None:
        samples = largest if samples is None else min(samples, largest)
    # A global batch needs a sample per replica; none is larger than the data.
    size = replicas * max(1, _FIRST_PROBE // replicas)
    if samples is not None:
        size = min(size, max(replicas, samples - samples % replicas))
    measurements = [probe.run(size)]
    free = _free_bytes(limits, probe.current)
    first = measurements[0][1]
    while len(measurements) < _MAX_PROBES:
        last = measurements[-1][1]
        factor = 2
        if free is not None and last - first < _SMALL_GROWTH * free:
            factor = 4  # The floor still hides the slope: go faster.
        size *= factor
        if samples is not None and size > samples:
            break
        if len(measurements) >= 2:
            (s0, p0, _), (s1, p1, _), (s2, p2, _) = (
                [(0, 0, None)] + measurements
            )[-3:]
            slope = (p2 - p1) / (s2 - s1)
            before = (p1 - p0) / (s1 - s0)
            if (
                len(measurements) >= _MIN_PROBES
                and last - first >= _GROWN * first
                and slope > 0
                and abs(slope - before) <= _SLOPE_AGREEMENT * slope
            ):
                break
            # Growth is counted from the line's value at batch 0, not from
            # the first probe (which may sit on the floor), so that four
            # times the probe is predicted to grow the peak by at most
            # 4 x `_PROBE_BUDGET` of the free memory.
            slope = max(slope, 0)
            predicted = p2 + slope * (size - s2)
            base = min(first, max(p2 - slope * s2, 0))
            if free is not None and predicted - base > _PROBE_BUDGET * free:
                break
        measurements.append(probe.run(size))
    if len(measurements) < 2:
        raise MemoryEstimateError(
            "Could not estimate memory: the data has too few samples for "
            f"two probe batch sizes (at most {samples}). Pass `batch_sizes`."
        )
    return measurements


def _free_bytes(limits, current) -> int | None:
    """The least memory free on a device, below its limit."""
    free = [
        limits[device] - current[device]
        for device in current
        if limits.get(device) is not None
    ]
    return min(free) if free else None


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


class _Probe:
    """Trains a few steps at a batch size and reads the devices' peaks."""

    def __init__(self, model, source, devices, phase="training"):
        self.model = model
        self.source = source
        self.devices = devices
        self.phase = phase
        if not model.built:  # So that all its variables exist to be saved.
            model(source.sample_inputs(), training=False)
        self.state = ModelState(model)
        self.window = memory.PeakWindow(devices)
        self.current = {}
        self.tried = []

    def run(self, batch_size: int) -> tuple[int, int, str]:
        """Returns `(batch_size, peak_bytes, device)` of the highest peak."""
        self.tried.append(batch_size)
        # What the previous probe's `fit` left (its iterator, a copy of the
        # data) must not count in this one's peak.
        gc.collect()
        for device in self.devices:
            self.current[device] = memory.memory_info(
                device, include_limit=False
            ).current_bytes
        try:
            self._steps(batch_size)
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            raise OutOfMemoryError(
                f"Could not estimate memory: a probe batch of {batch_size} "
                "ran out of memory. Pass smaller `batch_sizes`.",
                self.tried,
            ) from err
        peaks = {
            device: self.window.peak_bytes(device) for device in self.devices
        }
        device = max(peaks, key=lambda d: peaks[d] or 0)
        if not peaks[device]:
            raise MemoryEstimateError(
                f"Could not estimate memory: {device} reported no peak "
                "memory after a training step."
            )
        logging.vlog(
            1,
            "tfmemsafe.estimate_memory: batch %d peaked at %s on %s.",
            batch_size,
            _mib(peaks[device]),
            device,
        )
        return batch_size, peaks[device], device

    def _steps(self, batch_size: int) -> None:
        """Runs `_PROBE_STEPS` steps of the phase at `batch_size`."""
        arguments = self.source.trial_arguments(batch_size, _PROBE_STEPS)
        callbacks = [_ResetPeakAtFirstStep(self.window)]
        if self.phase == "training":
            self.model.fit(
                **arguments, epochs=1, verbose=0, callbacks=callbacks
            )
            return
        arguments.pop("shuffle", None)
        steps = arguments.pop("steps_per_epoch", None)
        if self.phase == "prediction":
            for name in ("y", "sample_weight"):
                arguments.pop(name, None)
            self.model.predict(
                **arguments, steps=steps, verbose=0, callbacks=callbacks
            )
        else:
            self.model.evaluate(
                **arguments, steps=steps, verbose=0, callbacks=callbacks
            )

    def close(self) -> None:
        self.state.restore()


class _ResetPeakAtFirstStep(keras.callbacks.Callback):
    """Resets the window's peak just before the first step.

    So the peak is the step's, not that of `fit`'s setup: converting arrays
    to tensors may briefly hold two copies of the data, a one-off that no
    batch size changes.
    """

    def __init__(self, window):
        super().__init__()
        self.window = window

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.window.reset()

    on_test_batch_begin = on_train_batch_begin
    on_predict_batch_begin = on_train_batch_begin


def _devices(model, device) -> list[str]:
    if device is not None:
        return [memory.device_name(device)]
    with model.distribute_strategy.scope():
        return memory.default_devices()


def _check_statistics(devices) -> dict:
    """The devices' limits; raises if a device keeps no statistics."""
    limits = {}
    for device in devices:
        info = memory.memory_info(device)
        if info.peak_bytes is None:
            raise MemoryEstimateError(
                f"Could not estimate memory: {device} keeps no allocator "
                f"statistics ({info.reason}). On a CPU, TensorFlow's default "
                "allocator keeps none unless oneDNN is on: set the "
                "environment variable TF_CPU_ALLOCATOR_USE_BFC=true before "
                "TensorFlow is imported (importing tfmemsafe first does "
                "this), or pass `device` a GPU."
            )
        limits[device] = info.limit_bytes
    return limits


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


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / _MIB:.1f} MiB"
