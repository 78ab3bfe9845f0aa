"""MemoryMonitor: device memory in the Keras logs, and a warning before OOM."""

from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
import os
import socket
import sys
import time

import keras
import tensorflow as tf
from absl import logging
from tensorflow.core.framework import summary_pb2
from tensorflow.core.framework import tensor_pb2

from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe import memory

_MB = 1024 * 1024

# Where a reading comes from.
ALLOCATOR = "allocator"
PROCESS_RSS = "process_rss"
_SOURCE_LABELS = {
    ALLOCATOR: "TensorFlow allocator",
    PROCESS_RSS: "process resident memory (RSS)",
}

_CSV_FIELDS = (
    "epoch",
    "batch",
    "step",
    "phase",
    "device",
    "current_mb",
    "peak_mb",
    "limit_mb",
    "source",
)

# What TensorBoard's scalar plugin expects of a scalar summary.
_SCALAR_METADATA = tf.compat.v1.SummaryMetadata(
    plugin_data=tf.compat.v1.SummaryMetadata.PluginData(plugin_name="scalars"),
    data_class=summary_pb2.DATA_CLASS_SCALAR,
)

# A limit more than this many times the highest reading would flatten the
# plot to its floor, so it is named in the legend instead of drawn.
_PLOT_LIMIT_RANGE = 4.0


@dataclasses.dataclass(frozen=True, slots=True)
class MemorySample:
    """One reading of one device's memory, taken after a batch.

    Attributes:
        epoch: The epoch (from 0), or `None` in `evaluate()` or `predict()`
            called outside `fit()`.
        batch: The batch index Keras gave the hook, within the epoch (or the
            evaluation or prediction run).
        step: How many batches of this phase came before this one since
            `fit()` started: the x axis of `plot()` and of TensorBoard.
        phase: `"train"`, `"evaluate"` (validation inside `fit()`, or
            `model.evaluate()`) or `"predict"`.
        device: The device name, e.g. `"GPU:0"`.
        current_mb: Megabytes in use after the batch.
        peak_mb: The most megabytes in use since the epoch (or run) began.
        limit_mb: The device's limit in megabytes, or `None` if unknown.
        source: `"allocator"` (TensorFlow's allocator statistics) or
            `"process_rss"` (the process's resident memory, used for a CPU
            without allocator statistics; its peak is the highest reading).
    """

    epoch: int | None
    batch: int
    step: int
    phase: str
    device: str
    current_mb: float
    peak_mb: float
    limit_mb: float | None
    source: str


class MemoryMonitor(keras.callbacks.Callback):
    """Records device memory during training and warns before it runs out.

    After every `every_n_batches` batches of training, evaluation and
    prediction, reads each device's memory in use and its peak (from
    `tf.config.experimental.get_memory_info`). The peak is reset when each
    epoch begins, so an epoch's peak is its own (validation included).

    At the end of each epoch it adds to the epoch `logs`:
    `memory_peak_mb` and `memory_current_mb`, the maximum over the devices,
    and, with several devices, `memory_peak_mb_gpu_0`,
    `memory_current_mb_gpu_0`, ... per device. `History`, `CSVLogger`,
    `TensorBoard`, `EarlyStopping` and `ModelCheckpoint` then see them
    like any metric, wherever the monitor is placed in `callbacks`: it
    moves itself to the front of the list when training begins, because
    Keras gives every callback the same `logs` in list order.

    When a device's peak passes `warn_at` of its limit, it logs a warning
    (once per epoch) naming what to try before the out-of-memory error
    comes. It never stops training: a device that keeps no statistics is
    reported once and skipped; a CPU without allocator statistics is read
    as the process's resident memory instead, labelled `"process_rss"`.

    Every reading is kept in `samples`; `summary()` tabulates the peak per
    epoch and `plot()` draws memory over the batches. State is reset in
    `on_train_begin`, so one instance can be passed to several `fit()`
    calls; `tfmemsafe.fit`, which calls `on_train_begin` once for all its
    retries, gets one record of them all. `evaluate()` and `predict()`
    outside `fit()` add their readings to the last run's.

    Args:
        devices: str, `tf.config.LogicalDevice`, or a list of them. The
            devices to monitor. Defaults to `None`: the model's
            `tf.distribute` replica devices, else every GPU, else `CPU:0`.
        every_n_batches: int. Read memory after the first batch of every
            epoch (or run) and every `every_n_batches` batches after it.
            The epoch logs are exact whatever this is. Defaults to `1`.
        warn_at: float in (0, 1], or `None` to turn the warning off. The
            fraction of a device's limit at which to warn. Defaults to
            `0.9`.
        log_dir: str. If given, each reading is written as TensorBoard
            scalars (`memory_peak_mb/<phase>/<device>` and
            `memory_current_mb/...`) to `<log_dir>/memory`, beside the
            `train` and `validation` runs of `keras.callbacks.TensorBoard`
            when it uses the same `log_dir`. Defaults to `None`.
        csv_path: str. If given, each reading is written as a row of this
            CSV file, rewritten at the start of every `fit()`. Defaults to
            `None`.
        verbose: int. `0` is silent, `1` logs warnings. Defaults to `1`.

    Example:
    ```python
    monitor = tfmemsafe.MemoryMonitor(csv_path="memory.csv")
    history = model.fit(x, y, epochs=3, callbacks=[monitor])
    history.history["memory_peak_mb"]  # [812.5, 815.0, 815.0]
    print(monitor.summary())
    monitor.plot("memory.png")
    ```
    """

    def __init__(
        self,
        devices=None,
        every_n_batches: int = 1,
        warn_at: float | None = 0.9,
        log_dir: str | os.PathLike | None = None,
        csv_path: str | os.PathLike | None = None,
        verbose: int = 1,
    ):
        super().__init__()
        self.devices = _check_devices(devices)
        self.every_n_batches = _checks.integer(
            "every_n_batches", every_n_batches, 1
        )
        if warn_at is not None:
            _checks.fraction(
                "warn_at",
                warn_at,
                low_closed=False,
                high_closed=True,
                what="a fraction of the memory limit",
                extra=", or None to turn the warning off",
            )
        self.warn_at = warn_at
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.csv_path = None if csv_path is None else os.fspath(csv_path)
        if verbose not in (0, 1):
            raise ValueError(
                f"`verbose` must be 0 or 1. Received: verbose={verbose!r}"
            )
        self.verbose = int(verbose)
        # Devices already reported as unreadable: said once per instance,
        # not again on every retry of the same training.
        self._reported = set()
        self._writer = None
        self._csv_file = None
        self._reset_state()

    def _reset_state(self):
        self.samples: list[MemorySample] = []
        self._sources: dict[str, str] = {}
        self._limits: dict[str, int | None] = {}
        self._unavailable: dict[str, str] = {}
        self._epoch_peaks: dict[int, dict[str, float]] = {}
        self._run_peaks: dict[str, dict[str, float]] = {}
        self._steps = {"train": 0, "evaluate": 0, "predict": 0}
        self._calls = {"train": 0, "evaluate": 0, "predict": 0}
        self._rss_peaks: dict[str, int] = {}
        self._epoch = None
        self._in_fit = False
        self._warned = False

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._run_first()
        self._close_outputs()  # Left open if the last fit() raised.
        self._reset_state()
        self._in_fit = True
        self._find_devices()
        self._open_outputs(append=False)

    def on_train_end(self, logs=None):
        self._in_fit = False
        self._close_outputs()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._calls["train"] = 0
        self._start_peak()

    def on_epoch_end(self, epoch, logs=None):
        readings = self._read_all()
        self._epoch_peaks[epoch] = {
            device: peak / _MB for device, (_, peak) in readings.items()
        }
        for device, (_, peak) in readings.items():
            self._check_limit(device, peak, "train", None)
        if logs is not None and readings:
            logs.update(_log_values(readings))
        self._flush_outputs()

    def on_train_batch_end(self, batch, logs=None):
        self._on_batch_end("train", batch)

    def on_test_begin(self, logs=None):
        self._on_run_begin("evaluate")

    def on_test_batch_end(self, batch, logs=None):
        self._on_batch_end("evaluate", batch)

    def on_test_end(self, logs=None):
        self._on_run_end("evaluate")

    def on_predict_begin(self, logs=None):
        self._on_run_begin("predict")

    def on_predict_batch_end(self, batch, logs=None):
        self._on_batch_end("predict", batch)

    def on_predict_end(self, logs=None):
        self._on_run_end("predict")

    # What the user reads.

    def summary(self) -> str:
        """Returns a table of the peak memory per epoch and device.

        Rows are the epochs of the last `fit()` (validation included), then
        any `evaluate()` or `predict()` run outside it, then the limit.
        Values are megabytes. Devices read as resident memory, and devices
        that could not be read, are named below the table.

        Example:
        >>> print(monitor.summary())
        MemoryMonitor: peak memory (MB) per epoch and device
        epoch       CPU:0
        0            42.1
        1            42.3
        limit     24105.0
        """
        devices = list(self._sources)
        rows = [(str(e), peaks) for e, peaks in self._epoch_peaks.items()]
        rows += list(self._run_peaks.items())
        if not devices or not rows:
            text = (
                "MemoryMonitor: no readings yet. Pass it to fit(), "
                "evaluate() or predict() in `callbacks`."
            )
            return "\n".join([text, *self._device_notes()])
        limits = {
            device: "unknown" if limit is None else f"{limit / _MB:.1f}"
            for device, limit in self._limits.items()
        }
        rows = [
            (label, {d: f"{peaks[d]:.1f}" for d in devices if d in peaks})
            for label, peaks in rows
        ]
        rows.append(("limit", limits))
        width = max(10, *(len(d) + 2 for d in devices))
        label_width = max(8, *(len(label) + 2 for label, _ in rows))
        header = "epoch".ljust(label_width) + "".join(
            d.rjust(width) for d in devices
        )
        lines = ["MemoryMonitor: peak memory (MB) per epoch and device", header]
        for label, values in rows:
            lines.append(
                label.ljust(label_width)
                + "".join(values.get(d, "-").rjust(width) for d in devices)
            )
        return "\n".join(lines + self._device_notes())

    def plot(self, path: str | os.PathLike | None = None, phase="train"):
        """Draws memory over the batches, one color per device.

        A solid line is each device's peak since its epoch began, a dotted
        line the memory in use after each batch, a dashed line the limit
        when it is known and within reach of the readings (otherwise the
        legend names it). Thin vertical lines mark where an epoch (or a
        resumed epoch, or another run) begins.

        Args:
            path: str. If given, the PNG file to write. Defaults to `None`.
            phase: str. Which readings to draw: `"train"`, `"evaluate"` or
                `"predict"`. Defaults to `"train"`.

        Returns:
            The `matplotlib.figure.Figure`.

        Raises:
            ImportError: If matplotlib is not installed.
            ValueError: If there are no readings for `phase`.

        Example:
        >>> monitor.plot("memory.png")
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as err:
            raise ImportError(
                "`MemoryMonitor.plot()` requires matplotlib, an optional "
                "extra of tfmemsafe. Install it with "
                "`pip install tfmemsafe[plot]` (or `pip install matplotlib`)."
            ) from err
        samples = [s for s in self.samples if s.phase == phase]
        if not samples:
            have = sorted({s.phase for s in self.samples})
            raise ValueError(
                f"`phase` has no readings to plot. Received: phase={phase!r}; "
                f"phases with readings: {have or 'none (run fit() first)'}"
            )
        figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
        axes = figure.add_subplot()
        top = max(s.peak_mb for s in samples)
        highest = top
        by_device = {}
        for sample in samples:
            by_device.setdefault(sample.device, []).append(sample)
        for index, (device, points) in enumerate(by_device.items()):
            color = f"C{index}"
            name = device
            if points[0].source == PROCESS_RSS:
                name += " (process RSS)"
            steps = [p.step for p in points]
            axes.plot(
                steps, [p.peak_mb for p in points], color=color, label=name
            )
            axes.plot(
                steps,
                [p.current_mb for p in points],
                color=color,
                linestyle=":",
                label=f"{name}, in use after the batch",
            )
            limit = points[0].limit_mb
            if limit is not None and limit <= _PLOT_LIMIT_RANGE * top:
                highest = max(highest, limit)
                axes.axhline(
                    limit,
                    color=color,
                    linestyle="--",
                    label=f"{device} limit ({limit:.0f} MB)",
                )
            elif limit is not None:
                axes.plot([], [], " ", label=f"{device} limit: {limit:.0f} MB")
        # An epoch, a resumed epoch or a new run begins where the batch
        # index stops growing.
        first = next(iter(by_device.values()))
        for before, sample in itertools.pairwise(first):
            if sample.epoch != before.epoch or sample.batch <= before.batch:
                axes.axvline(sample.step - 0.5, color="0.85", lw=0.8)
        axes.set_ylim(0, 1.25 * highest)  # Room for the legend.
        axes.set_xlabel(f"{phase} batch")
        axes.set_ylabel("memory (MB)")
        axes.set_title("Peak memory per epoch (solid) and in use (dotted)")
        axes.legend(loc="upper right", fontsize="small")
        if path is not None:
            figure.savefig(os.fspath(path), format="png")
        return figure

    # Reading memory.

    def _find_devices(self):
        """Decides how to read each device, saying once what cannot be."""
        self._sources, self._limits, self._unavailable = {}, {}, {}
        for device in self.devices or self._default_devices():
            info = memory.memory_info(device)
            if info.current_bytes is not None:
                self._sources[device] = ALLOCATOR
            elif device.startswith("CPU:") and _resident_bytes() is not None:
                self._sources[device] = PROCESS_RSS
                self._report(
                    device,
                    "MemoryMonitor: %s keeps no allocator statistics (%s); "
                    "reporting the process's resident memory (RSS) for it "
                    "instead, labelled 'process_rss' in the samples.",
                    info.reason,
                )
            else:
                self._unavailable[device] = info.reason or "no statistics"
                self._report(
                    device,
                    "MemoryMonitor: cannot read the memory of %s (%s); "
                    "monitoring the other devices.",
                    info.reason,
                )
                continue
            self._limits[device] = info.limit_bytes

    def _default_devices(self) -> list[str]:
        strategy = getattr(self.model, "distribute_strategy", None)
        if (
            strategy is not None
            and not tf.distribute.has_strategy()
            and strategy is not tf.distribute.get_strategy()
        ):
            with strategy.scope():
                return memory.default_devices()
        return memory.default_devices()

    def _report(self, device, message, reason):
        if device not in self._reported:
            self._reported.add(device)
            if self.verbose:
                logging.warning(message, device, reason)

    def _read(self, device) -> tuple[int, int] | None:
        """Returns (current, peak) bytes, the peak since the last reset."""
        if self._sources[device] == PROCESS_RSS:
            current = _resident_bytes()
            peak = max(current, self._rss_peaks.get(device, 0))
            self._rss_peaks[device] = peak
            return current, peak
        info = memory.memory_info(device, include_limit=False)
        if info.current_bytes is None:
            return None
        return info.current_bytes, info.peak_bytes

    def _read_all(self) -> dict[str, tuple[int, int]]:
        readings = {}
        for device in self._sources:
            reading = self._read(device)
            if reading is not None:
                readings[device] = reading
        return readings

    def _start_peak(self):
        """Starts a new peak: each epoch (or run) has its own."""
        self._warned = False
        for device, source in self._sources.items():
            if source == PROCESS_RSS:
                self._rss_peaks[device] = _resident_bytes()
            else:
                memory.reset_peak_memory(device)

    def _on_batch_end(self, phase, batch):
        step = self._steps[phase]
        self._steps[phase] += 1
        self._calls[phase] += 1
        if (self._calls[phase] - 1) % self.every_n_batches:
            return
        epoch = self._epoch if self._in_fit else None
        for device, (current, peak) in self._read_all().items():
            limit = self._limits[device]
            sample = MemorySample(
                epoch=epoch,
                batch=int(batch),
                step=step,
                phase=phase,
                device=device,
                current_mb=current / _MB,
                peak_mb=peak / _MB,
                limit_mb=None if limit is None else limit / _MB,
                source=self._sources[device],
            )
            self.samples.append(sample)
            self._write(sample)
            self._check_limit(device, peak, phase, batch)

    def _on_run_begin(self, phase):
        self._calls[phase] = 0
        if self._in_fit:
            return  # Validation: part of the epoch and of its peak.
        self._epoch = None
        self._find_devices()
        self._start_peak()
        self._open_outputs(append=True)

    def _on_run_end(self, phase):
        if self._in_fit:
            return
        self._run_peaks[phase] = {
            device: peak / _MB for device, (_, peak) in self._read_all().items()
        }
        self._close_outputs()

    def _check_limit(self, device, peak, phase, batch):
        limit = self._limits.get(device)
        if (
            self._warned
            or self.warn_at is None
            or not limit
            or peak < self.warn_at * limit
        ):
            return
        self._warned = True
        if not self.verbose:
            return
        if not self._in_fit:
            where = f"in {phase}()"
        elif phase == "train":
            where = f"in epoch {self._epoch}"
        else:
            where = f"in the validation of epoch {self._epoch}"
        if batch is not None:
            where += f" (batch {batch})"
        logging.warning(
            "MemoryMonitor: %s reached %.1f MB %s, %.0f%% of its %.1f MB "
            "limit (warn_at=%g); a larger batch or input may run out of "
            "memory. Use a smaller batch size, with gradient accumulation "
            "(`tfmemsafe.with_gradient_accumulation`) to keep the effective "
            "batch size. Or %s",
            device,
            peak / _MB,
            where,
            100 * peak / limit,
            limit / _MB,
            self.warn_at,
            _messages.OOM_ADVICE[0].lower() + _messages.OOM_ADVICE[1:],
        )

    def _device_notes(self) -> list[str]:
        notes = [
            f"{device}: {_SOURCE_LABELS[source]}; its peak is the highest "
            "reading, not an exact high-water mark."
            for device, source in self._sources.items()
            if source == PROCESS_RSS
        ]
        notes += [
            f"{device}: not monitored ({reason})."
            for device, reason in self._unavailable.items()
        ]
        return notes

    # Outputs: callback order, CSV and TensorBoard.

    def _run_first(self):
        """Moves this callback to the front of the `CallbackList` calling it.

        Keras passes one `logs` dict to the callbacks' `on_epoch_end` in
        list order, and no earlier hook shares that dict; a `CSVLogger` or
        `EarlyStopping` listed before this callback would read the epoch
        logs before the memory keys are added. Moving from the position
        being iterated to the front skips and repeats no callback.
        """
        frame = sys._getframe(1)
        for _ in range(3):
            frame = frame.f_back
            if frame is None:
                return
            caller = frame.f_locals.get("self")
            if isinstance(caller, keras.callbacks.CallbackList):
                callbacks = caller.callbacks
                for index, callback in enumerate(callbacks):
                    if callback is self:
                        callbacks.insert(0, callbacks.pop(index))
                        return
                return

    def _open_outputs(self, append):
        if self.csv_path is not None and self._csv_file is None:
            directory = os.path.dirname(self.csv_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            mode = "a" if append else "w"
            self._csv_file = open(self.csv_path, mode, newline="")
            self._csv_writer = csv.writer(self._csv_file)
            if self._csv_file.tell() == 0:
                self._csv_writer.writerow(_CSV_FIELDS)
        if self.log_dir is not None and self._writer is None:
            self._writer = _EventFile(os.path.join(self.log_dir, "memory"))

    def _write(self, sample: MemorySample):
        if self._csv_file is not None:
            values = (getattr(sample, name) for name in _CSV_FIELDS)
            self._csv_writer.writerow(
                "" if value is None else value for value in values
            )
        if self._writer is not None:
            device = sample.device.replace(":", "_")
            self._writer.write(
                sample.step,
                {
                    f"memory_peak_mb/{sample.phase}/{device}": sample.peak_mb,
                    f"memory_current_mb/{sample.phase}/{device}": (
                        sample.current_mb
                    ),
                },
            )

    def _flush_outputs(self):
        if self._csv_file is not None:
            self._csv_file.flush()
        if self._writer is not None:
            self._writer.flush()

    def _close_outputs(self):
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _check_devices(devices) -> list[str] | None:
    if devices is None:
        return None
    if isinstance(
        devices, (str, tf.config.LogicalDevice, tf.config.PhysicalDevice)
    ):
        devices = [devices]
    try:
        names = [memory.device_name(device) for device in devices]
    except (TypeError, ValueError) as err:
        raise ValueError(
            "`devices` must be None, a device name such as 'GPU:0', or a "
            f"list of them. Received: devices={devices!r}"
        ) from err
    if not names:
        raise ValueError(
            "`devices` must name at least one device, or be None for the "
            f"default ones. Received: devices={devices!r}"
        )
    return list(dict.fromkeys(names))


def _log_values(readings: dict[str, tuple[int, int]]) -> dict[str, float]:
    """The epoch log entries: the maximum over devices, then each device."""
    values = {
        "memory_peak_mb": max(peak for _, peak in readings.values()) / _MB,
        "memory_current_mb": max(cur for cur, _ in readings.values()) / _MB,
    }
    if len(readings) > 1:
        for device, (current, peak) in readings.items():
            suffix = device.replace(":", "_").lower()
            values[f"memory_peak_mb_{suffix}"] = peak / _MB
            values[f"memory_current_mb_{suffix}"] = current / _MB
    return values


def _resident_bytes() -> int | None:
    """The process's resident memory in bytes, or `None` if unknown."""
    return _resident_reader()()


@functools.cache
def _resident_reader():
    try:
        import psutil
    except ImportError:
        pass
    else:
        process = psutil.Process()
        return lambda: process.memory_info().rss
    try:
        page_size = os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/statm") as f:
            f.read()
    except (OSError, ValueError, AttributeError):
        pass
    else:
        return functools.partial(_statm_resident_bytes, page_size)
    try:
        import resource
    except ImportError:
        return lambda: None
    # Only the lifetime peak is available here; better than nothing.
    scale = 1 if sys.platform == "darwin" else 1024
    return lambda: scale * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _statm_resident_bytes(page_size: int) -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page_size


class _EventFile:
    """Writes TensorBoard scalars to an event file, without TensorFlow ops.

    `tf.summary.scalar` needs the tensorboard package, which TensorFlow no
    longer installs, and `tf.summary.write` runs an op per value (hundreds
    of microseconds); building the event protos here takes about ten.
    """

    _serial = itertools.count()

    def __init__(self, directory: str):
        tf.io.gfile.makedirs(directory)
        name = (
            f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}"
            f".{os.getpid()}.{next(self._serial)}.v2"
        )
        self._records = tf.io.TFRecordWriter(os.path.join(directory, name))
        self._records.write(
            tf.compat.v1.Event(
                wall_time=time.time(), file_version="brain.Event:2"
            ).SerializeToString()
        )

    def write(self, step: int, scalars: dict[str, float]):
        values = [
            tf.compat.v1.Summary.Value(
                tag=tag,
                metadata=_SCALAR_METADATA,
                tensor=tensor_pb2.TensorProto(
                    dtype=tf.float32.as_datatype_enum, float_val=[value]
                ),
            )
            for tag, value in scalars.items()
        ]
        event = tf.compat.v1.Event(
            wall_time=time.time(),
            step=step,
            summary=tf.compat.v1.Summary(value=values),
        )
        self._records.write(event.SerializeToString())

    def flush(self):
        self._records.flush()

    def close(self):
        self._records.close()
