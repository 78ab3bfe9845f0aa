"""The capped CPU allocator: its environment, failures and training peak."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

import keras
import tensorflow as tf

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._per_step_variables import without_per_step_variables


class AllocatorFailures:
    """Counts the allocations TensorFlow's BFC allocator failed.

    A context manager. While it is active, this process's standard error
    (where TensorFlow's C++ logging writes) goes to a temporary file; on
    exit the file is written back to standard error and `count` is the
    number of the allocator's "ran out of memory trying to allocate"
    reports in it: one per failed allocation, each having waited about
    ten seconds, whether or not anything caught the error.

    Attributes:
        count: int or `None`. The failures; `None` until it exits.

    Example:
    >>> with tfmemsafe.testing.AllocatorFailures() as failures:
    ...     tfmemsafe.fit(model, (x, y), batch_size=4096)
    >>> failures.count
    0
    """

    REPORT = "ran out of memory trying to allocate"

    def __init__(self):
        self.count = None
        self._log = None
        self._saved = None

    def __enter__(self) -> AllocatorFailures:
        sys.stderr.flush()
        self._log = tempfile.TemporaryFile("w+b")
        self._saved = os.dup(2)
        os.dup2(self._log.fileno(), 2)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        os.write(2, text)
        self.count = text.decode(errors="replace").count(self.REPORT)


def memory_cap_environment(cap_mb: int) -> dict[str, str]:
    """Returns the environment that caps TensorFlow's CPU allocator.

    `TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` make
    the allocator refuse allocations past the cap with a real
    `ResourceExhaustedError`; `TF_ENABLE_ONEDNN_OPTS=0` because TF 2.21's
    oneDNN kernels crash after such an error; `CUDA_VISIBLE_DEVICES=""`
    so the work runs on the capped CPU; and, unless this process has it
    set, `TF_CPP_MIN_LOG_LEVEL=1`, which keeps TensorFlow's allocator dump
    (about 1,900 INFO lines per failed allocation) out of the child's
    output while its one-line WARNING, which `AllocatorFailures` counts,
    stays. TensorFlow reads oneDNN's switch and the log level as it is
    imported, and the cap as it makes its first device: set them before.
    """
    cap_mb = _checks.integer("cap_mb", cap_mb, 1)
    environment = {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(cap_mb),
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }
    if not os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip():
        environment["TF_CPP_MIN_LOG_LEVEL"] = "1"
    return environment


def training_peak_bytes(
    model: keras.Model,
    data: Callable[[int], tf.data.Dataset],
    batch_size: int,
    steps: int = 3,
) -> int | None:
    """Returns the peak memory of a few training steps, or `None` on OOM.

    Resets the default device's peak, trains `steps` steps of
    `data(batch_size)` with `model.fit`, and reads the allocator's peak
    (`tfmemsafe.memory_info`). The model's compiled train function is
    dropped afterwards, so that the next call at another size traces
    afresh at its shape; the steps run without Grappler's `AddN` rewrite,
    as tfmemsafe's own do, so that a call that runs out leaves nothing to
    break the next.

    Args:
        model: keras.Model. A compiled model; it trains, so its weights
            change.
        data: A callable from a batch size to a `tf.data.Dataset` of at
            least `steps` batches, such as `random_data(...)`.
        batch_size: int. The batch size to measure.
        steps: int. How many training steps. Defaults to 3.

    Returns:
        The peak in bytes, or `None` if the steps ran out of memory (or the
        device keeps no allocator statistics).

    Example:
    >>> model = tfmemsafe.testing.reference_model("mlp")
    >>> data = tfmemsafe.testing.random_data((256,))
    >>> peak = tfmemsafe.testing.training_peak_bytes(model, data, 512)
    >>> peak > 0  # With allocator statistics, e.g. a capped CPU.
    True
    """
    steps = _checks.integer("steps", steps, 1)
    memory.reserve_one_region()  # The layout tfmemsafe's estimates read.
    memory.reset_peak_memory()
    try:
        with without_per_step_variables():
            model.fit(data(batch_size).take(steps), shuffle=False, verbose=0)
    except tf.errors.ResourceExhaustedError:
        return None
    finally:
        model.train_function = None
    return memory.memory_info(include_limit=False).peak_bytes
