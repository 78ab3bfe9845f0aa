"""The probes: the model's real step at one batch size, and its peak.

`measure_default_sizes` chooses the probe sizes: from `_FIRST_PROBE`,
quadrupling twice and then doubling, until the line is straight or the
next probe would take too much of the memory the model's state leaves
free. Each `Probe.run` trains (or evaluates, or predicts) `_PROBE_STEPS`
steps and reads the peak of every step inside a `memory.PeakWindow`, so
the peak outside the probes stays visible to a `MemoryMonitor`.

What makes a reading the same in every process, whatever ran before:

- it is the step's growth over what was in use before the probe, plus
  the model's state counted from its variables: memory that something
  else holds (an earlier `fit`'s leftovers, a second model) is in neither;
- it is the median of `_PROBE_STEPS` steps' peaks: TensorFlow's
  executor runs independent ops in parallel, and the same step peaks
  differently from one run to the next (on CPUs without oneDNN, whether
  Eigen's convolution gradients' im2col buffers, up to 30 MB each, are
  alive at once: a conv net's steps at batch 8 peaked at 88.5 MiB in
  most steps and at 66.3 or 92.8 MiB in one of five or so). The highest
  or the lowest of a few steps catches a rare schedule in some processes
  and not in others; the median is the common one in all. What a rarer
  schedule adds is left to the headroom (docs/memory-estimate.md);
- the probe sizes are fixed, and where they stop depends on the device's
  limit, the model's state and the slopes; only a probe that would not
  fit beside what is in use now is left out (`Probe.room_for`), for
  safety, and that does depend on what else is held.
"""

from __future__ import annotations

import gc
import math

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _sources
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe._model_state import ModelState
from tfmemsafe._model_state import gradient_accumulators_of
from tfmemsafe._model_state import optimizers_of
from tfmemsafe._per_step_variables import without_per_step_variables
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe._step_guard import StepGuard
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError

# Training steps per probe; the reading is the median step's peak.
_PROBE_STEPS = 5
# Default probes. A step's peak is not a line from batch 1: at small
# batches a floor that no sample adds to sets it (the optimizer update,
# the data, and on oneDNN-off CPUs the im2col buffers of Eigen's
# convolution gradients, capped at ~30 MB each: a floor of 60-70 MiB for
# any conv net), and it grows with the batch only past that. So sizes
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
# - or after `_MAX_PROBES` (each costs a retrace).
# "Free" is the limit less the model's state, the same in every process.
# The first size is probed twice and read the second time, and no
# decision reads the first probe's level, only slopes past it.
_FIRST_PROBE = 8
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
            break
        if len(measurements) >= 2:
            if _straight(measurements):
                break
            size, predicted, last = _within_budget(
                measurements, size, free, replicas, budget
            )
            if size is None:
                break
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


def state_bytes(model) -> int:
    """Bytes of the model's variables, its metrics' and its optimizers'.

    What stays in memory between steps, on each replica device: counted,
    so the same in every process.
    """
    variables = [*model.variables, *model.metrics_variables]
    for optimizer in optimizers_of(model):
        variables += optimizer.variables
    for accumulator in gradient_accumulators_of(model):
        variables += accumulator.state_variables()
    return _bytes_of(variables)


def gradient_bytes(model) -> int:
    """Bytes of one gradient of every trainable variable of the model:
    what a split's gradient sums take."""
    return _bytes_of(model.trainable_variables)


def _bytes_of(variables) -> int:
    seen, total = set(), 0
    for variable in variables:
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        dtype = tf.as_dtype(keras.backend.standardize_dtype(variable.dtype))
        total += int(np.prod(variable.shape, dtype=np.int64)) * dtype.size
    return total


class Probe:
    """Trains a few steps at a batch size and reads the devices' peaks.

    Args:
        model: The compiled `keras.Model`.
        source: `_sources.Source`. The data.
        devices: list of str. The devices to read.
        phase: str. `"training"`, `"evaluation"`, `"validation"` or
            `"prediction"`.
        limits: dict of device to its limit in bytes (or `None`).
    """

    def __init__(
        self,
        model,
        source,
        devices,
        phase="training",
        limits=None,
        *,
        guarded=False,
    ):
        self.model = model
        self.source = source
        self.devices = devices
        self.phase = phase
        self.limits = limits or {}
        if not model.built:  # So that all its variables exist to be saved.
            model(source.sample_inputs(), training=False)
        self.state = ModelState(model)
        self.guard = None
        try:
            self.state_bytes = state_bytes(model)
            self._arrays = None
            if isinstance(source, _sources.Arrays):
                # The run's tensors (`Arrays.tensors`), gathered from as
                # the run gathers: converted once, before every probe's
                # window, and what that added to the allocator counted
                # (`data_on`), not read: a tensor converted from NumPy may
                # use the array's buffer in place or copy it in, a 24 MiB
                # swing between processes on a small conv net's data.
                # Never copied again: a second copy took a third of a 300
                # MB cap from a run whose data was 96 MiB. Without tensors
                # (leaves that Keras converts itself), copies of the
                # arrays: an op's copy raises when memory is short, where
                # converting an array in `fit` can end the process.
                parts = source.tensors()
                if parts is None:
                    with tf.device("CPU:0"):
                        parts = tuple(
                            None
                            if part is None
                            else keras.tree.map_structure(_copied, part)
                            for part in (
                                source.x,
                                source.y,
                                source.sample_weight,
                            )
                        )
                self._arrays = parts
            self.window = memory.PeakWindow(devices)
            self.tried = []
            # Last, so that nothing after it can raise and leave it on.
            if (
                guarded
                and phase == "training"
                and not StepGuard.installed_on(model)
            ):
                # The step as `tfmemsafe.fit` trains it: its updates wait for
                # every gradient and run one after another. Released at once,
                # they peak at some steps by one more copy of the largest
                # variable than at others (11-13% spread on an MLP's probes).
                self.guard = StepGuard(
                    model, optimizers_of(model), gradient_accumulators_of(model)
                )
        except BaseException:
            # The guard off the model, and the copy's files now rather
            # than when the garbage is collected.
            try:
                if self.guard is not None:
                    self.guard.close()
            finally:
                self.state.close()
            raise

    def data_on(self, device) -> int:
        """The data's bytes counted in `device`'s readings."""
        return data_on(device, self.source)

    def counted_bytes(self, device) -> int:
        """What every reading on `device` counts besides the step's growth:
        the model's state and the data's tensors, both in use before it."""
        return self.state_bytes + self.data_on(device)

    def room_for(self, peak_bytes: float) -> bool:
        """Whether `peak_bytes` of this model's fits beside what is in use."""
        for device in self.devices:
            limit = self.limits.get(device)
            if not limit:
                continue
            held = held_bytes(device, self.counted_bytes(device))
            if held + peak_bytes > limit:
                return False
        return True

    def run(self, batch_size: int, arguments=None) -> tuple[int, int, str]:
        """Returns `(batch_size, peak_bytes, device)` of the highest device.

        `peak_bytes` is the median step's growth over what was in use
        before the probe, plus the model's state. `arguments`, if given,
        are the `model.fit` arguments to train on instead of the source's.
        """
        self.tried.append(batch_size)
        peaks, error = self.step_peaks(batch_size, arguments)
        if error is not None:
            raise OutOfMemoryError(
                f"Could not estimate memory: a probe batch of {batch_size} "
                "ran out of memory. Pass smaller `batch_sizes`.",
                self.tried,
            ) from error
        medians = {
            device: int(np.median(values))
            for device, values in peaks.items()
            if values
        }
        if not medians:
            raise MemoryEstimateError(
                f"Could not estimate memory: {', '.join(self.devices)} "
                "reported no peak memory after a training step."
            )
        device = max(medians, key=lambda d: medians[d])
        logging.vlog(
            1,
            "tfmemsafe.estimate_memory: batch %d peaked at %s on %s.",
            batch_size,
            mib(medians[device]),
            device,
        )
        return batch_size, medians[device], device

    def step_peaks(self, batch_size: int, arguments=None):
        """Every step's peak on each device, as `run` reads them, and the
        out-of-memory error that stopped the steps (else `None`).

        A step's peak is its growth over what was in use before the
        steps, plus the model's state (and the arrays, for array data).
        After an error, the steps that ended before it are in the lists,
        and what the failed steps held is collected.
        """
        # What the previous probe's `fit` left (its iterator, a copy of the
        # data) must not count in this one's peak, nor in its baseline.
        gc.collect()
        before = {device: _current_bytes(device) for device in self.devices}
        steps = _StepPeaks(self.window, self.devices)
        error = None
        try:
            # A probe that runs out must not break the next: at a fixed
            # batch shape Grappler's `AddN` rewrite would
            # (`_per_step_variables`); nor read a batch only to drop it
            # (`_sample_batch`).
            with without_per_step_variables(), without_sample_batch(self.model):
                self._steps(batch_size, steps, arguments)
        except Exception as err:
            if not memory.is_oom_error(err):
                raise
            error = err
            gc.collect()
        peaks = {
            device: [
                self.counted_bytes(device) + max(peak - before[device], 0)
                for peak in steps.peaks.get(device, [])
                if peak
            ]
            for device in self.devices
        }
        return peaks, error

    def _steps(self, batch_size: int, steps, arguments=None) -> None:
        """Runs `_PROBE_STEPS` steps of the phase at `batch_size`."""
        if arguments is None and self._arrays is not None:
            arguments = {"x": self._batches(batch_size), "shuffle": False}
        if arguments is None:
            arguments = self.source.trial_arguments(batch_size, _PROBE_STEPS)
        callbacks = [steps]
        if self.phase == "training":
            self.model.fit(
                **arguments, epochs=1, verbose=0, callbacks=callbacks
            )
            return
        arguments.pop("shuffle", None)
        count = arguments.pop("steps_per_epoch", None)
        if self.phase == "prediction":
            for name in ("y", "sample_weight"):
                arguments.pop(name, None)
            self.model.predict(
                **arguments, steps=count, verbose=0, callbacks=callbacks
            )
        else:
            self.model.evaluate(
                **arguments, steps=count, verbose=0, callbacks=callbacks
            )

    def _batches(self, batch_size: int):
        """`_PROBE_STEPS` batches gathered from the data's tensors, as the
        run's own are (`_sources.gathered`): with its parallel gather and
        final prefetch, whose batches are alive during its steps."""
        return _sources.cycled(
            tuple(part for part in self._arrays if part is not None),
            batch_size,
            _PROBE_STEPS,
            one_worker=self.source.one_worker,
        )

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.state.restore()
        self.state.close()
        self._arrays = None


def _copied(array):
    """A tensor of `array` in the allocator's memory (never NumPy's)."""
    tensor = tf.convert_to_tensor(array)
    if tensor.dtype.is_floating or tensor.dtype.is_integer:
        return tensor + 0
    return tf.identity(tensor)  # Booleans, strings: not numbers to add.


def data_on(device, source) -> int:
    """The bytes of `source`'s tensors that `device`'s memory holds all
    through a run: arrays' (`Arrays.resident_bytes`), in host memory, so
    on a CPU; none on an accelerator, nor for a pipeline's batches."""
    return source.resident_bytes() if _is_host(device) else 0


def data_held_on(device, source) -> int:
    """Of `data_on`, what `device`'s memory holds now: nothing before the
    arrays are converted, nor between Keras' own conversions."""
    return source.resident_bytes_now() if _is_host(device) else 0


def _is_host(device) -> bool:
    return memory.device_name(device).startswith("CPU:")


def _current_bytes(device) -> int:
    return memory.memory_info(device, include_limit=False).current_bytes or 0


def held_bytes(device, state_bytes: int) -> int:
    """What is in use on `device` besides the model's state, now."""
    return max(_current_bytes(device) - state_bytes, 0)


class _StepPeaks(keras.callbacks.Callback):
    """Every step's peak, each device's.

    The window is reset just before each step, so a reading is the step's,
    not that of `fit`'s setup: converting arrays to tensors may briefly
    hold two copies of the data, a one-off that no batch size changes.
    """

    def __init__(self, window, devices):
        super().__init__()
        self.window = window
        self.devices = devices
        self.peaks = {}

    def on_train_batch_begin(self, batch, logs=None):
        self.window.reset()

    def on_train_batch_end(self, batch, logs=None):
        for device in self.devices:
            peak = self.window.peak_bytes(device) or 0
            self.peaks.setdefault(device, []).append(peak)

    on_test_batch_begin = on_train_batch_begin
    on_predict_batch_begin = on_train_batch_begin
    on_test_batch_end = on_train_batch_end
    on_predict_batch_end = on_train_batch_end


def devices_of(model, device=None) -> list[str]:
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
