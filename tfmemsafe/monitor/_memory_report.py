"""`MemoryMonitor`'s summary table and plot, from what it recorded."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfmemsafe.monitor import _device_memory

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tfmemsafe.monitor._record import MemorySample

# A limit more than this many times the highest reading would flatten the
# plot to its floor, so it is named in the legend instead of drawn.
_PLOT_LIMIT_RANGE = 4.0


def summary(
    peaks: dict[str, dict[str, float]],
    limits_mb: dict[str, float | None],
    notes: list[str],
    *,
    started: bool,
) -> str:
    """Returns the table of peak memory per row (epoch or run) and device.

    Args:
        peaks: The peak in MB per device, for each row label (an epoch's
            number, `"evaluate"` or `"predict"`), in the order to show.
        limits_mb: The limit in MB (`None` if unknown) of each monitored
            device: the table's columns, in order.
        notes: Lines to add below the table.
        started: Whether the monitor was passed to a run: without
            readings, the summary then says why, not what to do.
    """
    devices = list(limits_mb)
    if not devices or not peaks:
        if not started:
            text = (
                "MemoryMonitor: no readings yet. Pass it to fit(), "
                "evaluate() or predict() in `callbacks`."
            )
        elif not devices:
            text = (
                "MemoryMonitor: no readings: none of the monitored devices "
                "keeps memory statistics."
            )
        else:
            text = "MemoryMonitor: no readings: the run ended before any."
        return "\n".join([text, *notes])
    rows = [
        (label, {d: f"{row[d]:.1f}" for d in devices if d in row})
        for label, row in peaks.items()
    ]
    rows.append(
        (
            "limit",
            {
                device: "unknown" if limit is None else f"{limit:.1f}"
                for device, limit in limits_mb.items()
            },
        )
    )
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
    return "\n".join(lines + notes)


def plot(
    samples: Sequence[MemorySample],
    path: str | os.PathLike | None,
    phase: str,
) -> Figure:
    """Draws the samples of one phase over the batches, a color per device.

    See `MemoryMonitor.plot`, which this implements.

    Raises:
        ImportError: If matplotlib is not installed.
        ValueError: If there are no samples of `phase`.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "`MemoryMonitor.plot()` requires matplotlib, an optional "
            "extra of tfmemsafe. Install it with "
            "`pip install tfmemsafe[plot]` (or `pip install matplotlib`)."
        ) from err
    drawn = [s for s in samples if s.phase == phase]
    if not drawn:
        have = sorted({s.phase for s in samples})
        raise ValueError(
            f"`phase` has no readings to plot. Received: phase={phase!r}; "
            f"phases with readings: {have or 'none (run fit() first)'}"
        )
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    top = max(s.peak_mb for s in drawn)
    highest = top
    by_device = {}
    for sample in drawn:
        by_device.setdefault(sample.device, []).append(sample)
    for index, (device, points) in enumerate(by_device.items()):
        color = f"C{index}"
        name = device
        if points[0].source == _device_memory.PROCESS_RSS:
            name += " (process RSS)"
        steps = [p.step for p in points]
        axes.plot(steps, [p.peak_mb for p in points], color=color, label=name)
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
    # An epoch, a resumed epoch or a new run begins where the batch index
    # stops growing.
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
