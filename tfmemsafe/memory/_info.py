"""Device memory: what is in use, the peak and the limit."""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from tfmemsafe import _checks

_MB = 1024 * 1024

# TensorFlow's BFC allocator on the CPU stops here unless
# TF_CPU_BFC_MEM_LIMIT_IN_MB says otherwise.
TF_BFC_DEFAULT_LIMIT_BYTES = 64 * 1024 * _MB

# The fraction of a device's limit that a batch must leave free to count
# as fitting: room for what no reading or prediction sees (the
# allocator's fragmentation, another convolution algorithm at a larger
# size, other work on the device). Every "does it fit" in tfmemsafe uses
# it, through `fits_within`.
HEADROOM = 0.1

# Per device, the highest peak that a measurement inside a `PeakWindow`
# reset away: `memory_info` still reports it, until `reset_peak_memory`.
_outer_peaks: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class MemoryInfo:
    """A reading of one device's memory.

    Attributes:
        device: The device name, e.g. `"GPU:0"` or `"CPU:0"`.
        current_bytes: Bytes in use by TensorFlow now, or `None` if unknown.
        peak_bytes: The most bytes in use since the last
            `reset_peak_memory`, or `None` if unknown.
        limit_bytes: The memory the device can give TensorFlow, or `None`
            if unknown.
        reason: Why a field is `None`, or `None` when all are known.
    """

    device: str
    current_bytes: int | None
    peak_bytes: int | None
    limit_bytes: int | None
    reason: str | None = None

    @property
    def current_mb(self) -> float | None:
        return _to_mb(self.current_bytes)

    @property
    def peak_mb(self) -> float | None:
        return _to_mb(self.peak_bytes)

    @property
    def limit_mb(self) -> float | None:
        return _to_mb(self.limit_bytes)


def _to_mb(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else num_bytes / _MB


def device_name(device) -> str:
    """Returns the short name (`"GPU:0"`) of a device.

    Accepts a short name, a full name such as
    `"/job:worker/replica:0/task:1/device:GPU:0"`, or a
    `tf.config.LogicalDevice` / `tf.config.PhysicalDevice`.
    """
    if isinstance(device, (tf.config.LogicalDevice, tf.config.PhysicalDevice)):
        device = device.name
    if not isinstance(device, str):
        raise TypeError(
            "`device` must be a device name such as 'GPU:0' or a "
            f"tf.config.LogicalDevice. Received: device={device!r} "
            f"of type {type(device).__name__}"
        )
    name = device.rsplit("device:", 1)[-1].lstrip("/")
    kind, _, index = name.rpartition(":")
    if not kind or not index.isdigit():
        raise ValueError(
            "`device` must name a device such as 'GPU:0' or 'CPU:0'. "
            f"Received: device={device!r}"
        )
    return f"{kind.upper()}:{index}"


def default_devices() -> list[str]:
    """Returns the devices whose memory matters for training here.

    Under a `tf.distribute` strategy scope: the strategy's local replica
    devices. Otherwise every logical GPU, or `["CPU:0"]` when there is none.

    Example:
    >>> tfmemsafe.default_devices()
    ['CPU:0']
    """
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        names = [device_name(d) for d in strategy.extended.worker_devices]
        return list(dict.fromkeys(names))
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [device_name(gpu) for gpu in gpus]
    return ["CPU:0"]


def memory_info(device=None, *, include_limit: bool = True) -> MemoryInfo:
    """Reads a device's current, peak and total memory.

    Current and peak come from `tf.config.experimental.get_memory_info`.
    The limit is, on a GPU, a logical device's `memory_limit` when one was
    configured, else the card's total memory read with NVML (install
    `nvidia-ml-py`); on the CPU, the machine's (or container's) memory,
    or with `TF_CPU_ALLOCATOR_USE_BFC=true` the BFC allocator's limit:
    `TF_CPU_BFC_MEM_LIMIT_IN_MB`, by default 64 GB. This never raises
    because statistics are unavailable: the unknown fields are `None` and
    `reason` says why.

    Args:
        device: str or `tf.config.LogicalDevice`. The device to read.
            Defaults to `None`, the first of `default_devices()`.
        include_limit: bool. Whether to look the limit up. The lookup may
            read files or query NVML, so code that polls every batch reads
            the limit once and passes `False` afterwards (`limit_bytes` is
            then `None`). Defaults to `True`.

    Returns:
        A `MemoryInfo`.

    Example:
    >>> x = tf.ones((1024, 1024))
    >>> tfmemsafe.memory_info("CPU:0").current_bytes >= 4 * 1024 * 1024
    True
    """
    name = device_name(device) if device is not None else default_devices()[0]
    reasons = []
    current = peak = None
    try:
        stats = tf.config.experimental.get_memory_info(name)
        current, peak = int(stats["current"]), int(stats["peak"])
        peak = max(peak, _outer_peaks.get(name, 0))
    except (ValueError, tf.errors.OpError) as err:
        reasons.append(f"get_memory_info({name!r}) failed: {err}")
    limit, limit_reason = _limit_bytes(name) if include_limit else (None, None)
    if limit_reason:
        reasons.append(limit_reason)
    return MemoryInfo(name, current, peak, limit, "; ".join(reasons) or None)


def reset_peak_memory(device=None) -> bool:
    """Resets a device's peak memory to its current use.

    Args:
        device: str or `tf.config.LogicalDevice`. Defaults to `None`, the
            first of `default_devices()`.

    Returns:
        `True` if the peak was reset, `False` if the device keeps no
        statistics.
    """
    name = device_name(device) if device is not None else default_devices()[0]
    _outer_peaks.pop(name, None)
    return _reset_allocator_peak(name)


def free_bytes(device) -> int | None:
    """What `device`'s limit leaves free now; `None` where the limit or
    the use is unknown."""
    info = memory_info(device)
    if info.current_bytes is None or info.limit_bytes is None:
        return None
    return info.limit_bytes - info.current_bytes


def _reset_allocator_peak(name: str) -> bool:
    try:
        tf.config.experimental.reset_memory_stats(name)
    except (ValueError, tf.errors.OpError):
        return False
    return True


def usable_bytes(limit_bytes: float, headroom: float = HEADROOM) -> float:
    """The memory a batch may use on a device: its limit less `headroom`."""
    return limit_bytes * (1.0 - headroom)


def fits_within(
    peak_bytes: float, limit_bytes: float, headroom: float = HEADROOM
) -> bool:
    """The one rule for what fits: the peak leaves `headroom` of the limit.

    Args:
        peak_bytes: float. A peak, measured or predicted.
        limit_bytes: float. The device's limit.
        headroom: float. The fraction of the limit to leave free.
            Defaults to `HEADROOM`, 0.1.

    Returns:
        Whether `peak_bytes <= limit_bytes * (1 - headroom)`.

    Raises:
        ValueError: `headroom` is not in [0, 1).

    Example:
    >>> tfmemsafe.memory.fits_within(850 * 2**20, 1024 * 2**20)
    True
    """
    headroom = _checks.fraction("headroom", headroom)
    return peak_bytes <= usable_bytes(limit_bytes, headroom)


class PeakWindow:
    """Measures peaks inside a window without losing the peak outside it.

    `reset()` starts a measurement: it resets the allocator's peak of each
    device, but first keeps the peak reached so far, so that
    `memory_info` (and a `MemoryMonitor`) still reports it until the next
    `reset_peak_memory`. `peak_bytes(device)` is the allocator's peak
    since the window's last `reset()`. tfmemsafe measures its memory
    estimate's probes and `find_max_batch_size`'s trials this way, so an
    epoch's `memory_peak_mb` still shows a step that ran out before them.

    Args:
        devices: list of str. The devices to measure.

    Example:
    >>> window = tfmemsafe.memory.PeakWindow(["CPU:0"])
    >>> window.reset()
    >>> y = tf.ones((1024, 1024))
    >>> window.peak_bytes("CPU:0") >= 4 * 2**20
    True
    """

    def __init__(self, devices):
        self.devices = [device_name(device) for device in devices]

    def reset(self) -> None:
        for name in self.devices:
            try:
                stats = tf.config.experimental.get_memory_info(name)
            except (ValueError, tf.errors.OpError):
                continue
            # `stats["peak"]` is the allocator's own, since the last reset.
            kept = max(_outer_peaks.get(name, 0), int(stats["peak"]))
            _outer_peaks[name] = kept
            _reset_allocator_peak(name)

    def peak_bytes(self, device) -> int | None:
        """The allocator's peak since `reset()`; `None` without statistics."""
        try:
            stats = tf.config.experimental.get_memory_info(device_name(device))
        except (ValueError, tf.errors.OpError):
            return None
        return int(stats["peak"])


def _limit_bytes(name: str) -> tuple[int | None, str | None]:
    kind, index = name.split(":")
    if kind == "CPU":
        return _cpu_limit_bytes()
    if kind == "GPU":
        return _gpu_limit_bytes(int(index))
    return None, f"no known memory limit for {name}"


def _cpu_limit_bytes() -> tuple[int | None, str | None]:
    machine = machine_memory_bytes()
    use_bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower()
    if use_bfc in ("true", "1"):
        cap = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip()
        if cap.isdigit():
            return int(cap) * _MB, None
        # Without a cap, TensorFlow's BFC allocator stops at 64 GB.
        limit = min(
            machine or TF_BFC_DEFAULT_LIMIT_BYTES, TF_BFC_DEFAULT_LIMIT_BYTES
        )
        return limit, None
    if machine is None:
        return None, "the machine's memory size is unknown"
    return machine, None


def machine_memory_bytes() -> int | None:
    """The machine's memory, or its container's cgroup limit if lower."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    limits.extend(_cgroup_limits())
    return min(limits) if limits else None


def _cgroup_limits() -> list[int]:
    limits = []
    for path in (
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        # "max" or a huge number means no limit.
        if text.isdigit() and int(text) < 2**60:
            limits.append(int(text))
    return limits


def _gpu_limit_bytes(index: int) -> tuple[int | None, str | None]:
    physical = tf.config.list_physical_devices("GPU")
    if index < len(physical):
        try:
            logical = tf.config.get_logical_device_configuration(
                physical[index]
            )
        except (ValueError, RuntimeError):
            logical = None
        if logical and logical[0].memory_limit:
            return int(logical[0].memory_limit) * _MB, None
    try:
        import pynvml
    except ImportError:
        return None, (
            "the GPU's total memory needs NVML: pip install nvidia-ml-py"
        )
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_nvml_index(index))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), None
    except pynvml.NVMLError as err:
        return None, f"NVML could not read GPU:{index}: {err}"


def _nvml_index(index: int) -> int:
    # NVML counts every GPU; TensorFlow counts the visible ones.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [part.strip() for part in visible.split(",") if part.strip()]
    if index < len(ids) and ids[index].isdigit():
        return int(ids[index])
    return index
