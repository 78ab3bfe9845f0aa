"""How `MemoryMonitor` reads devices: allocator statistics, else RSS."""

from __future__ import annotations

import functools
import os
import sys

from absl import logging

from tfmemsafe import memory

# Where a reading comes from.
ALLOCATOR = "allocator"
PROCESS_RSS = "process_rss"
_SOURCE_LABELS = {
    ALLOCATOR: "TensorFlow allocator",
    PROCESS_RSS: "process resident memory (RSS)",
}


class DeviceMemory:
    """Reads the memory in use and its peak on a set of devices.

    `discover()` decides how to read each device: TensorFlow's allocator
    statistics where the device keeps them, the process's resident memory
    (RSS) for a CPU without them, or not at all. A device that cannot be
    read as it should is reported once per instance, with the reason.

    Args:
        verbose: int. `0` is silent, `1` logs what cannot be read.
    """

    def __init__(self, verbose: int):
        self._verbose = verbose
        # Devices already reported: said once per instance, not again on
        # every retry of the same training.
        self._reported: set[str] = set()
        self.discover([])

    def discover(self, devices: list[str]):
        """Decides how to read each device, saying once what cannot be."""
        # The source of each readable device, in the order given.
        self.sources: dict[str, str] = {}
        # The limit in bytes of each readable device, `None` if unknown.
        self.limits: dict[str, int | None] = {}
        # Why each unreadable device cannot be read.
        self.unavailable: dict[str, str] = {}
        # The highest RSS since `start_peak()`, per RSS device.
        self._rss_peaks: dict[str, int] = {}
        for device in devices:
            info = memory.memory_info(device)
            if info.current_bytes is not None:
                self.sources[device] = ALLOCATOR
            elif device.startswith("CPU:") and resident_bytes() is not None:
                self.sources[device] = PROCESS_RSS
                self._report(
                    device,
                    "MemoryMonitor: %s keeps no allocator statistics (%s); "
                    "reporting the process's resident memory (RSS) for it "
                    "instead, labelled 'process_rss' in the samples.",
                    info.reason,
                )
            else:
                self.unavailable[device] = info.reason or "no statistics"
                self._report(
                    device,
                    "MemoryMonitor: cannot read the memory of %s (%s); "
                    "monitoring the other devices.",
                    info.reason,
                )
                continue
            self.limits[device] = info.limit_bytes

    def start_peak(self):
        """Starts a new peak on every device."""
        for device, source in self.sources.items():
            if source == PROCESS_RSS:
                self._rss_peaks[device] = resident_bytes()
            else:
                memory.reset_peak_memory(device)

    def read(self) -> dict[str, tuple[int, int]]:
        """Returns (current, peak) bytes per device that could be read.

        The peak is the highest since the last `start_peak()`.
        """
        readings = {}
        for device, source in self.sources.items():
            if source == PROCESS_RSS:
                current = resident_bytes()
                peak = max(current, self._rss_peaks.get(device, 0))
                self._rss_peaks[device] = peak
                readings[device] = current, peak
                continue
            info = memory.memory_info(device, include_limit=False)
            if info.current_bytes is not None:
                readings[device] = info.current_bytes, info.peak_bytes
        return readings

    def notes(self) -> list[str]:
        """Lines naming the devices read as RSS, and those not read."""
        notes = [
            f"{device}: {_SOURCE_LABELS[source]}; its peak is the highest "
            "reading, not an exact high-water mark."
            for device, source in self.sources.items()
            if source == PROCESS_RSS
        ]
        notes += [
            f"{device}: not monitored ({reason})."
            for device, reason in self.unavailable.items()
        ]
        return notes

    def _report(self, device, message, reason):
        if device not in self._reported:
            self._reported.add(device)
            if self._verbose:
                logging.warning(message, device, reason)


def resident_bytes() -> int | None:
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
