"""Which devices a `MemoryMonitor` reads: the ones asked for, or the model's."""

from __future__ import annotations

import tensorflow as tf

from tfmemsafe import memory


def check_devices(devices) -> list[str] | None:
    """`MemoryMonitor`'s `devices` argument, as a list of device names."""
    if devices is None:
        return None
    if isinstance(
        devices, (str, tf.config.LogicalDevice, tf.config.PhysicalDevice)
    ):
        devices = [devices]
    try:
        names = [memory.device_name(device) for device in devices]
    except (TypeError, ValueError) as err:
        raise ValueError(
            "`devices` must be None, a device name such as 'GPU:0', or a "
            f"list of them. Received: devices={devices!r}"
        ) from err
    if not names:
        raise ValueError(
            "`devices` must name at least one device, or be None for the "
            f"default ones. Received: devices={devices!r}"
        )
    return list(dict.fromkeys(names))


def existing(devices: list[str]) -> list[str]:
    """`devices`, if this process has them all; else a Keras-style error."""
    present = [
        memory.device_name(device)
        for device in tf.config.list_logical_devices()
    ]
    missing = [device for device in devices if device not in present]
    if missing:
        raise ValueError(
            "`devices` must name devices that this process has; "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not among them ({', '.join(present)}). "
            f"Received: devices={devices!r}"
        )
    return devices


def model_devices(model) -> list[str]:
    """The model's `tf.distribute` replica devices, else the defaults."""
    strategy = getattr(model, "distribute_strategy", None)
    if (
        strategy is not None
        and not tf.distribute.has_strategy()
        and strategy is not tf.distribute.get_strategy()
    ):
        with strategy.scope():
            return memory.default_devices()
    return memory.default_devices()
