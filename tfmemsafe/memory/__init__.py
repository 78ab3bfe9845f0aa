"""Device memory: readings, limits, and out-of-memory errors.

Owns every question asked of a device's memory: what is in use, the peak
since the last reset, the limit (the GPU's total, the capped CPU
allocator's, the machine's or the cgroup's), and whether an exception is
an out-of-memory error (`is_oom_error`, from the message shapes of
TensorFlow, XLA, cuDNN, cuBLAS and CUDA). The rest of tfmemsafe reads
memory only through here.
"""

from tfmemsafe.memory._info import HEADROOM
from tfmemsafe.memory._info import TF_BFC_DEFAULT_LIMIT_BYTES
from tfmemsafe.memory._info import MemoryInfo
from tfmemsafe.memory._info import PeakWindow
from tfmemsafe.memory._info import default_devices
from tfmemsafe.memory._info import device_name
from tfmemsafe.memory._info import fits_within
from tfmemsafe.memory._info import free_bytes
from tfmemsafe.memory._info import machine_memory_bytes
from tfmemsafe.memory._info import memory_info
from tfmemsafe.memory._info import reset_peak_memory
from tfmemsafe.memory._info import usable_bytes
from tfmemsafe.memory._oom import is_oom_error
from tfmemsafe.memory._region import reserve_one_region

__all__ = [
    "HEADROOM",
    "TF_BFC_DEFAULT_LIMIT_BYTES",
    "MemoryInfo",
    "PeakWindow",
    "default_devices",
    "device_name",
    "fits_within",
    "free_bytes",
    "is_oom_error",
    "machine_memory_bytes",
    "memory_info",
    "reserve_one_region",
    "reset_peak_memory",
    "usable_bytes",
]
