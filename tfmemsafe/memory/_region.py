"""A capped CPU allocator's memory in one region, before it is measured.

TensorFlow's BFC allocator on the CPU always grows: it takes memory from
the system in regions, the first of 2 MiB and each next twice the last,
as allocations need them (`allow_growth` is fixed on for the CPU). A
chunk never spans two regions, so where a step's tensors fall depends on
how the process grew its allocator before, and so does the step's peak:
a transformer block's training step at batch 256 under a 700 MB cap
peaked at 96.5 to 123.6 MiB over what was in use, in four fresh
processes of the same code, each process keeping its own level however
often the step was traced again; with the allocator grown by one
allocation first, 96.4 to 97.6 MiB in all four
(docs/memory-estimate.md, "Repeatability").

`reserve_one_region()` gives the allocator most of its remaining memory
as one region: one allocation of an uninitialized tensor (no page of it
is touched, so the process's resident memory does not grow), freed at
once. Later allocations are then carved from that region, the same way
in every process. It is done once per process, on a capped CPU (a BFC
allocator with `TF_CPU_BFC_MEM_LIMIT_IN_MB` set), by tfmemsafe's
estimates and `fit` before they measure or train, and only where it
cannot fail: a failed allocation costs the allocator's ten-second wait.
A GPU's allocator grows the same way under memory growth; there this is
not done, since growing is what memory growth is asked for.
"""

from __future__ import annotations

import os
import threading

import tensorflow as tf
from absl import logging

from tfmemsafe.memory import _info

# What is left out of the region: the allocator may already hold regions
# up to about four times the most it ever had in use (each twice the
# last, the last up to twice a request), and what it keeps besides.
_GROWN_REGIONS = 4
_SPARE_BYTES = 16 * 2**20
# Not worth a region (or not safe to ask for) below this share of the
# limit.
_SMALLEST_SHARE = 0.5
_ROW_BYTES = 2**20

_lock = threading.Lock()
_done = False


def reserve_one_region() -> int:
    """Grows a capped CPU allocator by one region, once per process.

    Returns:
        The bytes reserved, 0 when nothing was done (not a capped CPU,
        done before, or too much already in use to be sure it fits).
    """
    global _done
    with _lock:
        if _done:
            return 0
        _done = True
        return _reserve()


def _reserve() -> int:
    if not _capped_cpu():
        return 0
    try:
        stats = tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, tf.errors.OpError):
        return 0
    limit, _ = _info._cpu_limit_bytes()
    if not limit:
        return 0
    most = max(
        int(stats["current"]),
        int(stats["peak"]),
        _info._outer_peaks.get("CPU:0", 0),
    )
    size = limit - _GROWN_REGIONS * most - _SPARE_BYTES
    if size < _SMALLEST_SHARE * limit:
        logging.info(
            "tfmemsafe: the capped CPU allocator is left to grow region by "
            "region: with up to %d bytes in use so far, one region might "
            "not fit.",
            most,
        )
        return 0
    # Whole MiB, as rows of a matrix: `Empty` takes an int32 shape, and
    # one dimension of bytes stops at 2 GiB.
    rows = size // _ROW_BYTES
    size = rows * _ROW_BYTES
    window = _info.PeakWindow(["CPU:0"])
    window.reset()  # The peak so far is kept; the reservation's is not.
    try:
        with tf.device("CPU:0"):
            block = tf.raw_ops.Empty(
                shape=[rows, _ROW_BYTES], dtype=tf.uint8, init=False
            )
        del block
        logging.info(
            "tfmemsafe: the capped CPU allocator reserved %d bytes as one "
            "region, so that a step peaks alike in every process.",
            size,
        )
    except tf.errors.ResourceExhaustedError:
        logging.info(
            "tfmemsafe: could not reserve one region of %d bytes.", size
        )
        size = 0
    finally:
        _info._reset_allocator_peak("CPU:0")
    return size


def _capped_cpu() -> bool:
    use_bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower()
    cap = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip()
    return use_bfc in ("true", "1") and cap.isdigit()
