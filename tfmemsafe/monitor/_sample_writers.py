"""Where `MemoryMonitor` writes its readings: a CSV file, TensorBoard."""

from __future__ import annotations

import abc
import csv
import itertools
import os
import socket
import time
from typing import TYPE_CHECKING

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.core.framework import tensor_pb2

if TYPE_CHECKING:
    from tfmemsafe.monitor._record import MemorySample

# The CSV columns: the fields of a `MemorySample`, in order.
CSV_FIELDS = (
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


def open_writers(
    csv_path: str | None, log_dir: str | None, append: bool
) -> list[SampleWriter]:
    """Opens a writer for each output asked for.

    Args:
        csv_path: The CSV file, or `None` for none.
        log_dir: The TensorBoard log directory, or `None` for none; the
            event file goes in its `memory` subdirectory.
        append: Add to the CSV file instead of rewriting it.
    """
    writers = []
    if csv_path is not None:
        writers.append(CsvWriter(csv_path, append=append))
    if log_dir is not None:
        writers.append(TensorBoardWriter(os.path.join(log_dir, "memory")))
    return writers


class SampleWriter(abc.ABC):
    """Writes each `MemorySample` somewhere, as it is taken."""

    @abc.abstractmethod
    def write(self, sample: MemorySample):
        """Writes one reading."""

    @abc.abstractmethod
    def flush(self):
        """Makes what was written so far visible to readers."""

    @abc.abstractmethod
    def close(self):
        """Flushes and releases the file."""


class CsvWriter(SampleWriter):
    """Writes each reading as a row of a CSV file with a header.

    Args:
        path: str. The file; its directory is made if missing.
        append: bool. Add to the file instead of rewriting it. The header
            is written only if the file is empty.
    """

    def __init__(self, path: str, append: bool):
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._file = open(path, "a" if append else "w", newline="")
        self._rows = csv.writer(self._file)
        if self._file.tell() == 0:
            self._rows.writerow(CSV_FIELDS)

    def write(self, sample: MemorySample):
        values = (getattr(sample, name) for name in CSV_FIELDS)
        self._rows.writerow("" if value is None else value for value in values)

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


class TensorBoardWriter(SampleWriter):
    """Writes each reading as TensorBoard scalars, without TensorFlow ops.

    The tags are `memory_peak_mb/<phase>/<device>` and
    `memory_current_mb/<phase>/<device>`, at the sample's `step`.

    `tf.summary.scalar` needs the tensorboard package, which TensorFlow no
    longer installs, and `tf.summary.write` runs an op per value (hundreds
    of microseconds); building the event protos here takes about ten.

    Args:
        directory: str. Where a new event file is made.
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

    def write(self, sample: MemorySample):
        device = sample.device.replace(":", "_")
        scalars = {
            f"memory_peak_mb/{sample.phase}/{device}": sample.peak_mb,
            f"memory_current_mb/{sample.phase}/{device}": sample.current_mb,
        }
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
            step=sample.step,
            summary=tf.compat.v1.Summary(value=values),
        )
        self._records.write(event.SerializeToString())

    def flush(self):
        self._records.flush()

    def close(self):
        self._records.close()
