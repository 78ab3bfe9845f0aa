"""Device memory where Keras users look: the `MemoryMonitor` callback.

Owns `MemoryMonitor` (the peak and current memory of each device in the
epoch logs, a warning near the limit, CSV and TensorBoard writers, a
summary and a plot), `MemorySample` (one reading) and `monitors_first`
(the callback order that lets later callbacks see the monitor's keys).
"""

from tfmemsafe.monitor._monitor import MemoryMonitor
from tfmemsafe.monitor._monitor import monitors_first
from tfmemsafe.monitor._record import MemorySample

__all__ = ["MemoryMonitor", "MemorySample", "monitors_first"]
