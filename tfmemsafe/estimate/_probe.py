"""The probes: the model's real step at one batch size, and its peak.

`measure_default_sizes` chooses the probe sizes: from `_FIRST_PROBE`,
quadrupling twice and then doubling, until the line is straight, the
next probe would take too much of the memory the model's state leaves
free, or the data (or the largest batch asked for) ends them. Each
`Probe.run` trains (or evaluates, or predicts) `PROBE_STEPS` steps and
reads the peak of every step inside a `memory.PeakWindow`, so the peak
outside the probes stays visible to a `MemoryMonitor`.

What makes a reading the same in every process, whatever ran before:

- it is the step's growth over what was in use before the probe, plus
  the model's state counted from its variables: memory that something
  else holds (an earlier `fit`'s leftovers, a second model) is in neither;
- it is the median of `PROBE_STEPS` steps' peaks: TensorFlow's
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

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmemsafe import _arrays
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
from tfmemsafe.estimate._held import current_bytes
from tfmemsafe.estimate._held import data_on
from tfmemsafe.estimate._held import held_bytes
from tfmemsafe.estimate._held import state_bytes

# Training steps per probe; the reading is the median step's peak.
PROBE_STEPS = 5


class Probe:
    """Trains a few steps at a batch size and reads the devices' peaks.

    Args:
        model: The compiled `keras.Model`.
        source: `_sources.Source`. The data.
        devices: list of str. The devices to read.
        phase: str. `"training"`, `"evaluation"`, `"validation"` or
            `"prediction"`.
        limits: dict of device to its limit in bytes (or `None`).
        guarded: bool. Measure the step with the step guard's barrier.
        progress: A `keras.utils.Progbar` that each probe moves on, or
            `None`.

    Attributes:
        step_spread: float. The most any probe's highest step peaked above
            its median step, as a fraction of the median (0 before any).
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
        progress=None,
    ):
        self.model = model
        self.progress = progress
        self.source = source
        self.devices = devices
        self.phase = phase
        self.limits = limits or {}
        self.step_spread = 0.0
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
                # use the array's buffer in place or copy it in, and which
                # one differs between processes. Never copied again: a
                # second copy of the data would count against the cap as
                # the run never does. Without tensors
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
        if medians[device] > 0:
            highest = max(peaks[device]) / medians[device] - 1
            self.step_spread = max(self.step_spread, highest)
        if self.progress is not None:
            self.progress.update(
                len(self.tried),
                [
                    ("batch_size", batch_size),
                    ("peak_mib", medians[device] / 2**20),
                ],
            )
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
        before = {device: current_bytes(device) for device in self.devices}
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
        """Runs `PROBE_STEPS` steps of the phase at `batch_size`."""
        if arguments is None and self._arrays is not None:
            arguments = {"x": self._batches(batch_size), "shuffle": False}
        if arguments is None:
            arguments = self.source.trial_arguments(batch_size, PROBE_STEPS)
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
        """`PROBE_STEPS` batches gathered from the data's tensors, as the
        run's own are (`_arrays.gathered`): with its parallel gather and
        final prefetch, whose batches are alive during its steps.

        Of a size the traced step does not know, as Keras' own batches of
        arrays are where the last is short: so the first probe's trace
        serves them all (Keras traces again, for any size, at the second
        size it sees: the probes cost one trace, not two)."""
        return _arrays.cycled(
            self._arrays,
            batch_size,
            PROBE_STEPS,
            one_worker=self.source.one_worker,
            known_size=False,
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
    """`[device]`, if this process has it; else the model's replica
    devices."""
    if device is None:
        with model.distribute_strategy.scope():
            return memory.default_devices()
    name = memory.device_name(device)
    present = [memory.device_name(d) for d in tf.config.list_logical_devices()]
    if name not in present:
        raise ValueError(
            f"`device` must be a device this process has ({', '.join(present)}"
            f"). Received: device={device!r}"
        )
    return [name]


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
