"""The probes: the model's real step at one batch size, and its peak.

`measure_default_sizes` chooses the probe sizes: from `_FIRST_PROBE`,
doubling (or quadrupling while the floor hides the slope) until the line
is straight or the next probe would take too much of the free memory.
Each `Probe.run` trains (or evaluates, or predicts) `_PROBE_STEPS` steps
and reads the peak inside a `memory.PeakWindow`, so the peak outside the
probes stays visible to a `MemoryMonitor`.
"""

from __future__ import annotations

import gc

import keras
from absl import logging

from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe._model_state import ModelState
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError

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


def measure_default_sizes(probe, source, replicas, limits, largest) -> list:
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


class Probe:
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
            mib(peaks[device]),
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


def devices_of(model, device) -> list[str]:
    if device is not None:
        return [memory.device_name(device)]
    with model.distribute_strategy.scope():
        return memory.default_devices()


def check_statistics(devices) -> dict:
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
