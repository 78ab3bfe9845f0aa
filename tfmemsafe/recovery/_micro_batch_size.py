"""How many rows each micro-batch of a held batch trains: `MicroBatchSize`.

The counter of `SplitBatchOnOOM`, in the shape of Keras'
`LossScaleOptimizer`, which halves its scale on a bad step and grows it
after `dynamic_growth_steps` clean ones. Here the value is the rows of
one micro-batch (`None`: the whole batch), and the steps it learns from
are measured:

- After a clean step on a device that keeps memory statistics, the peak
  above what was in use before it, per micro-batch row, is kept.
- After an out-of-memory error, the next size is the largest that this
  measurement predicts to leave `memory.HEADROOM` of the limit free,
  beside what is in use now: one error from a batch 8x too large, not
  three. With nothing measured, or only one size larger than the one
  predicted, the first micro-batch is a probe of a sixteenth of the rows
  that ran out, measured, and the rest of the batch is sized from it:
  one size alone cannot tell the peak's part that shrinks with the rows
  from the part that does not (TensorFlow's CPU convolution gradients
  take a workspace of about 30 MiB whatever the rows), so read down from
  it the line under-predicts. A prediction that ran out halves instead.
  A size that ran out is a fact: nothing at or above it is chosen after
  an error while as much memory is held as when it ran out.
- After `grow_back_after` clean steps the size doubles, unless the
  measurement predicts the double not to fit. A grow-back to a size that
  ran out beside no more memory than is held now (or with nothing to
  compare) doubles the clean steps before the next: what it ran out of
  may be held by something the statistics do not count (another process
  on a GPU), so no size is given up for good, and none is retried every
  `grow_back_after` steps.
"""

from __future__ import annotations

import math

from tfmemsafe import memory

# The probe's rows, as a fraction of the rows that ran out, when nothing
# was measured yet.
_PROBE_FRACTION = 16


class MicroBatchSize:
    """The rows of each micro-batch of one run, shrunk and grown back.

    Args:
        grow_back_after: int or `None`. Clean steps before the size
            doubles; `None`: never.
        limit_bytes: int or `None`. The device's memory limit (`None`:
            unknown, so nothing is predicted).
        rows: int or `None`. The rows to start at; `None`: whole batches.
        floor: int. The fewest rows a micro-batch may have.
    """

    def __init__(
        self,
        grow_back_after: int | None,
        limit_bytes: int | None,
        rows: int | None = None,
        floor: int = 1,
    ):
        self.grow_back_after = grow_back_after
        self.limit_bytes = limit_bytes
        self.floor = floor
        self.rows = rows  # Rows of a micro-batch; `None`: the whole batch.
        self.clean_steps = 0
        # Rows -> the peak above what was in use, last measured at them.
        self._above = {}
        # Rows -> the bytes in use when a micro-batch of them ran out.
        self._ran_out = {}
        self._wait = grow_back_after  # Clean steps before a grow-back.
        self._probe = None  # Rows of the next attempt's probe, if any.

    def whole(self) -> None:
        """Whole batches from now on: the rows it started at cannot be
        used (the batches cannot be split exactly)."""
        self.rows = None

    def rows_for(self, rows: int) -> int:
        """The rows of each micro-batch of a batch of `rows`."""
        return rows if self.rows is None else max(1, min(rows, self.rows))

    def probe_rows(self) -> int | None:
        """The rows of the next split's first micro-batch, to be measured
        before the others are sized; `None` when no probe is needed."""
        return self._probe

    def measured(self, rows: int, peak_bytes, in_use_bytes) -> None:
        """Keeps a clean micro-batch's peak above what was in use before
        it; the rest of a probed batch is sized from it."""
        probed = self._probe is not None and rows <= self._probe
        if probed:
            self._probe = None
        if peak_bytes is None or in_use_bytes is None or rows < 1:
            return
        self._above[rows] = max(peak_bytes - in_use_bytes, 0)
        if probed:
            fitting = self._fitting_rows(in_use_bytes)
            if fitting is not None:
                fitting = self._below_failures(fitting, in_use_bytes)
                self.rows = max(self.floor, fitting)

    def trained(self) -> None:
        """Counts a clean step."""
        self.clean_steps += 1

    def ran_out(self, rows: int, in_use_bytes) -> int | None:
        """The micro-batch rows to try after micro-batches of `rows` ran
        out with `in_use_bytes` in use; `None` when `rows` was the
        floor."""
        self.clean_steps = 0
        # A probe is one attempt's first micro-batch: where it (or the
        # attempt) ran out, the next is decided anew, never that probe.
        self._probe = None
        if rows <= self.floor:
            return None
        held = self._ran_out.get(rows)
        if held is None or in_use_bytes is None or in_use_bytes < held:
            self._ran_out[rows] = in_use_bytes
        fitting = self._fitting_rows(in_use_bytes)
        if fitting is None and in_use_bytes is not None and not self._above:
            # Nothing measured yet: measure a small first piece.
            self._probe = max(self.floor, rows // _PROBE_FRACTION)
            fitting = rows // 2
        elif fitting is None or fitting >= rows:
            fitting = rows // 2  # The prediction was wrong: halve.
        elif self._slope() is None and fitting < max(self._above):
            # Read down from one larger size: through the origin, that
            # under-predicts a smaller size's peak by what does not shrink
            # with the rows (a kernel's workspace). The first micro-batch
            # is measured before the others are sized.
            self._probe = max(self.floor, min(fitting, rows // _PROBE_FRACTION))
        self.rows = max(self.floor, self._below_failures(fitting, in_use_bytes))
        return self.rows

    def grow_back_due(self) -> bool:
        """Whether enough clean steps went by for `grow_back_rows` to ask
        what is in use."""
        return (
            self.rows is not None
            and self._wait is not None
            and self.clean_steps >= self._wait
        )

    def grow_back_rows(self, in_use_bytes) -> int | None:
        """The micro-batch rows to try on this step instead of the current
        ones, or `None` to stay."""
        if not self.grow_back_due():
            return None
        larger = 2 * self.rows
        if self._below_failures(larger, in_use_bytes) < larger:
            # It ran out beside no more than is held now, or nothing
            # tells: try, but twice as rarely each time.
            self._wait *= 2
        fitting = self._fitting_rows(in_use_bytes)
        if fitting is not None and fitting < larger:
            return None
        self.clean_steps = 0
        return larger

    def grew_back(self, rows: int, batch_rows: int) -> None:
        """Takes micro-batches of `rows` (of batches of `batch_rows`)."""
        self.rows = None if rows >= batch_rows else rows

    def _fitting_rows(self, in_use_bytes) -> int | None:
        """The most rows predicted to leave the headroom free beside
        `in_use_bytes`, or `None` when nothing predicts."""
        line = self._line()
        if line is None or self.limit_bytes is None or in_use_bytes is None:
            return None
        fixed, per_row = line
        room = memory.usable_bytes(self.limit_bytes) - in_use_bytes - fixed
        if room < per_row:
            # Something else holds the headroom too: half of what is free,
            # leaving the rest to what allocates beside the step (tf.data's
            # read-ahead, on a CPU).
            room = (self.limit_bytes - in_use_bytes) / 2 - fixed
        return max(0, math.floor(room / per_row))

    def _slope(self):
        """`(fixed, per_row)` bytes above what is in use, through the two
        largest sizes measured when they are at least twice apart (two
        close readings give a slope of noise) and the larger peaks
        higher; else `None`."""
        sizes = sorted(self._above, reverse=True)
        if not sizes:
            return None
        large = sizes[0]
        small = next((r for r in sizes if 2 * r <= large), None)
        if small is None:
            return None
        per_row = (self._above[large] - self._above[small]) / (large - small)
        if per_row <= 0:
            return None
        return self._above[large] - per_row * large, per_row

    def _line(self):
        """`(fixed, per_row)` bytes above what is in use, from the
        measurements: `_slope`, else all of it per row (an over-estimate
        of a larger size, the safe side for a grow-back; an under-estimate
        of a smaller one, so `ran_out` probes); `None` when nothing grows
        with the rows."""
        line = self._slope()
        if line is not None:
            return line
        if not self._above:
            return None
        large = max(self._above)
        if self._above[large] <= 0:
            return None
        return 0.0, self._above[large] / large

    def _below_failures(self, rows: int, in_use_bytes) -> int:
        """`rows`, or less than the smallest size that ran out beside no
        more memory in use than `in_use_bytes` (any, when unknown)."""
        failed = [
            size
            for size, held in self._ran_out.items()
            if held is None or in_use_bytes is None or held <= in_use_bytes
        ]
        return rows if not failed else min(rows, min(failed) - 1)


class DeviceReadings:
    """What the devices of a strategy hold now, and their peak since the
    last `reset`: the measurements `MicroBatchSize` learns from.

    Args:
        strategy: The model's `tf.distribute.Strategy`.
    """

    def __init__(self, strategy):
        with strategy.scope():
            self.devices = memory.default_devices()
        self.limit_bytes = memory.memory_info(self.devices[0]).limit_bytes
        self._window = memory.PeakWindow(self.devices)

    def reset(self) -> None:
        """Starts a new peak."""
        self._window.reset()

    def in_use(self):
        """The most bytes in use on a device, or `None` (no statistics)."""
        return _most(
            memory.memory_info(d, include_limit=False).current_bytes
            for d in self.devices
        )

    def peak(self):
        """The highest peak on a device since `reset`, or `None`."""
        return _most(self._window.peak_bytes(d) for d in self.devices)


def _most(readings):
    readings = list(readings)
    return None if None in readings else max(readings)
