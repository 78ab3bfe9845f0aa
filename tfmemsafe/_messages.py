"""Message text shared by the library's errors, warnings and logs."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

import keras

# What to try when halving the batch was not enough. Shared by every error
# and warning that tells a user their model does not fit.
OOM_ADVICE = (
    "Instead, try mixed precision (`tfmemsafe.configure("
    'precision="mixed_float16")` on a GPU), gradient checkpointing '
    "(`tfmemsafe.Checkpointed`), a frozen backbone "
    "(`tfmemsafe.build_frozen_mobilenet_v2`) or a smaller input."
)

_MAX_LINE = 300


def mib(num_bytes: float) -> str:
    """Formats bytes as `"812.3 MiB"`."""
    return f"{num_bytes / 2**20:.1f} MiB"


def format_sizes(sizes: Iterable[int]) -> str:
    """Formats batch sizes as `"256, 128, 64"`."""
    return ", ".join(str(size) for size in sizes)


def error_line(error: BaseException | str) -> str:
    """The line of an error worth showing: the one that says what ran out.

    TensorFlow's first line is often generic ("Graph execution error:"), so
    the first line that mentions OOM or RESOURCE_EXHAUSTED wins, then the
    first that mentions memory or an allocation, leaving out the lines of
    the traceback TensorFlow quotes (`File "train.py", line 9, in
    fit_in_memory`); else the first line; without Keras' bold. At most 300
    characters.
    """
    if isinstance(error, BaseException):
        text = getattr(error, "message", None) or str(error)
        fallback = type(error).__name__
    else:
        text, fallback = error, ""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith('File "')]
    for line in said:
        if "OOM" in line or "RESOURCE_EXHAUSTED" in line:
            return line[:_MAX_LINE]
    for line in said:
        if "memory" in line.lower() or "allocat" in line.lower():
            return line[:_MAX_LINE]
    return lines[0][:_MAX_LINE] if lines else fallback


def progress_bar(title: str, verbose, unit_name: str):
    """A Keras progress bar of unknown length under a title line, for
    work that runs before `fit`'s own bars; `None` when `verbose` is 0.

    Args:
        title: str. What is being done, printed once above the bar.
        verbose: `"auto"`, 0, 1 or 2, as `model.fit` takes it (2: one
            line when done).
        unit_name: str. What one step of the bar is (`"probe"`).
    """
    if verbose == 0:
        return None
    # Keras' progress bars write to standard output; the title goes there
    # too, so that it stands above its bar.
    sys.stdout.write(f"{title}\n")
    sys.stdout.flush()
    return keras.utils.Progbar(
        None,
        verbose=2 if verbose == 2 else 1,
        unit_name=unit_name,
        stateful_metrics=("batch_size", "peak_mib"),
    )
