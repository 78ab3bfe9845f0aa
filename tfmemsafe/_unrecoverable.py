"""The out-of-memory errors after which nothing may be retried in the
process: `refuse_xla_on_cpu`, which both the in-step recovery and the
batch search ask first."""

from __future__ import annotations

import keras

from tfmemsafe import memory
from tfmemsafe.errors import OutOfMemoryError


class ModelUnusableError(OutOfMemoryError):
    """The `OutOfMemoryError` after which the model must not be touched.

    Callers that put a model back after a failure (`find_max_batch_size`'s
    trials) skip that for this error.
    """


def refuse_xla_on_cpu(model: keras.Model, err: Exception) -> None:
    """Raises `ModelUnusableError` if `err` came from XLA on the CPU.

    An allocation that fails inside a step compiled by XLA for the CPU
    leaves TensorFlow's CPU allocator inconsistent (TensorFlow 2.21:
    "Check failed: h != kInvalidChunkHandle" in bfc_allocator.cc when a
    buffer is freed later): the next use of the model's variables, or the
    process's exit, aborts it. Nothing can be put back or retried in this
    process, so nothing is tried: the error says why and what to do. On a
    GPU, XLA reports a failed allocation as an ordinary error and the run
    recovers as any other.
    """
    if getattr(model, "jit_compile", False) is not True:
        return
    with model.distribute_strategy.scope():
        devices = memory.default_devices()
    if any(not device.startswith("CPU") for device in devices):
        return
    raise ModelUnusableError(
        "Out of memory in a step compiled with XLA (`jit_compile=True`) "
        "on the CPU. TensorFlow cannot go on in this process after that: "
        "its CPU allocator is left inconsistent, and the next use of the "
        "model or the end of the process aborts it, so tfmemsafe does not "
        "retry and the model is not put back. Instead, restart the process "
        "and compile with `jit_compile=False` (then an out-of-memory error "
        "is recovered in the process), or train at a smaller batch size "
        "(`tfmemsafe.find_max_batch_size` on the model compiled without "
        "XLA finds one)."
    ) from err
