"""MemoryMonitor: device memory in the Keras logs, and a warning before OOM."""

from __future__ import annotations

import os

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe.monitor import _device_memory
from tfmemsafe.monitor import _devices
from tfmemsafe.monitor import _memory_report
from tfmemsafe.monitor import _sample_writers
from tfmemsafe.monitor._record import MemorySample
from tfmemsafe.monitor._record import Record

_MB = 1024 * 1024


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
    like any metric if they come after the monitor in `callbacks`: Keras
    gives every callback the same `logs` in list order. `tfmemsafe.fit`
    puts monitors first; in `model.fit`, list the monitor first.

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
    csv_logger = keras.callbacks.CSVLogger("log.csv")
    # First, so that the callbacks after it see memory_peak_mb.
    history = model.fit(x, y, epochs=3, callbacks=[monitor, csv_logger])
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
        self.devices = _devices.check_devices(devices)
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
        # Lives as long as the instance: it reports an unreadable device
        # once, not again on every fit() or retry.
        self._memory = _device_memory.DeviceMemory(self.verbose)
        # The open CSV and TensorBoard writers, while a run is going on.
        self._writers: list[_sample_writers.SampleWriter] = []
        # Empty until the first run, for summary() and plot().
        self._record = Record()

    @property
    def samples(self) -> list[MemorySample]:
        """Every reading since the last `fit()` began: `MemorySample`s."""
        return self._record.samples

    # Keras hooks.

    def on_train_begin(self, logs=None):
        self._close_writers()  # Left open if the last fit() raised.
        self._discover()  # Before the record: it may refuse the devices.
        self._record = Record(in_fit=True, started=True)
        self._open_writers(append=False)

    def on_train_end(self, logs=None):
        self._record.in_fit = False
        self._close_writers()

    def on_epoch_begin(self, epoch, logs=None):
        self._record.epoch = epoch
        self._record.calls["train"] = 0
        self._start_peak()

    def on_epoch_end(self, epoch, logs=None):
        readings = self._memory.read()
        self._record.epoch_peaks[epoch] = {
            device: peak / _MB for device, (_, peak) in readings.items()
        }
        for device, (_, peak) in readings.items():
            self._check_limit(device, peak, "train", None)
        if logs is not None and readings:
            logs.update(_log_values(readings))
        for writer in self._writers:
            writer.flush()

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
        record = self._record
        peaks = {str(e): p for e, p in record.epoch_peaks.items()}
        peaks.update(record.run_peaks)
        limits_mb = {
            device: None if limit is None else limit / _MB
            for device, limit in self._memory.limits.items()
        }
        return _memory_report.summary(
            peaks, limits_mb, self._memory.notes(), started=record.started
        )

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
        return _memory_report.plot(self._record.samples, path, phase)

    # Recording.

    def _start_peak(self):
        """Starts a new peak: each epoch (or run) has its own."""
        self._record.warned = False
        self._memory.start_peak()

    def _on_batch_end(self, phase, batch):
        record = self._record
        step = record.steps[phase]
        record.steps[phase] += 1
        record.calls[phase] += 1
        if (record.calls[phase] - 1) % self.every_n_batches:
            return
        epoch = record.epoch if record.in_fit else None
        for device, (current, peak) in self._memory.read().items():
            limit = self._memory.limits[device]
            sample = MemorySample(
                epoch=epoch,
                batch=int(batch),
                step=step,
                phase=phase,
                device=device,
                current_mb=current / _MB,
                peak_mb=peak / _MB,
                limit_mb=None if limit is None else limit / _MB,
                source=self._memory.sources[device],
            )
            record.samples.append(sample)
            for writer in self._writers:
                writer.write(sample)
            self._check_limit(device, peak, phase, batch)

    def _discover(self):
        """Decides how to read the devices, refusing ones that don't exist."""
        if self.devices is None:
            self._memory.discover(_devices.model_devices(self.model))
        else:
            self._memory.discover(_devices.existing(self.devices))

    def _on_run_begin(self, phase):
        self._record.calls[phase] = 0
        if self._record.in_fit:
            return  # Validation: part of the epoch and of its peak.
        self._record.epoch = None
        self._record.started = True
        self._discover()
        self._start_peak()
        self._open_writers(append=True)

    def _on_run_end(self, phase):
        if self._record.in_fit:
            return
        self._record.run_peaks[phase] = {
            device: peak / _MB
            for device, (_, peak) in self._memory.read().items()
        }
        self._close_writers()

    def _check_limit(self, device, peak, phase, batch):
        limit = self._memory.limits.get(device)
        near = self._record.first_near_limit(peak, limit, self.warn_at)
        if near and self.verbose:
            where = self._record.where(phase, batch)
            _warn_near_limit(device, peak, limit, self.warn_at, where)

    # Writing the samples as they come.

    def _open_writers(self, append):
        if not self._writers:
            self._writers = _sample_writers.open_writers(
                self.csv_path, self.log_dir, append=append
            )

    def _close_writers(self):
        for writer in self._writers:
            writer.close()
        self._writers = []


def monitors_first(callbacks) -> list:
    """Returns the callbacks with every `MemoryMonitor` first.

    Keras passes one `logs` dict down the list in order, so the callbacks
    after a monitor see its `memory_peak_mb` in their `on_epoch_end`.
    `tfmemsafe.fit`, `evaluate`, `predict` and `AccumulatingModel.fit` order
    their lists this way; for a plain `model.fit`, list the monitor first
    or pass `monitors_first([...])`.

    Args:
        callbacks: A list of `keras.callbacks.Callback`.

    Returns:
        A new list: the monitors, then the others, each in their order.

    Example:
    >>> model.fit(x, y, callbacks=monitors_first([csv_logger, monitor]))
    """
    callbacks = list(callbacks)
    monitors = [c for c in callbacks if isinstance(c, MemoryMonitor)]
    return monitors + [c for c in callbacks if not isinstance(c, MemoryMonitor)]


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


def _warn_near_limit(device, peak, limit, warn_at, where):
    """Logs that `device` peaked at `peak` bytes, `warn_at` of its limit."""
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
        warn_at,
        _messages.OOM_ADVICE[0].lower() + _messages.OOM_ADVICE[1:],
    )
