"""Runtime setup: GPU memory growth and the mixed-precision policy."""

from __future__ import annotations

import dataclasses
import os

import keras
import tensorflow as tf
from absl import logging

PRECISIONS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")

# Tensor Cores, which make float16 matmuls and convolutions fast, arrived
# with compute capability 7.0 (Volta).
_MIN_MIXED_FLOAT16_CAPABILITY = (7, 0)

ENV_AUTOCONFIGURE = "TFMEMSAFE_AUTOCONFIGURE"
ENV_MEMORY_GROWTH = "TFMEMSAFE_MEMORY_GROWTH"
ENV_PRECISION = "TFMEMSAFE_PRECISION"
_BOOLEANS = {"1": True, "true": True, "0": False, "false": False}

_config: RuntimeConfig | None = None


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """What `configure()` did.

    Attributes:
        memory_growth: Whether memory growth was requested.
        memory_growth_gpus: The physical GPUs that now have memory growth.
        precision: The precision that was asked for (`"auto"` or a policy).
        dtype_policy: The name of the Keras dtype policy now in force.
        reason: Why that policy was chosen.
        warnings: What could not be done, and what to do about it.
    """

    memory_growth: bool
    memory_growth_gpus: tuple[str, ...]
    precision: str
    dtype_policy: str
    reason: str
    warnings: tuple[str, ...] = ()

    def __str__(self) -> str:
        gpus = ", ".join(self.memory_growth_gpus) or "none"
        lines = [
            f"tfmemsafe: dtype policy {self.dtype_policy} ({self.reason}); "
            f"memory growth on GPUs: {gpus}."
        ]
        lines += [f"tfmemsafe warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def configure(
    memory_growth: bool = True, precision: str = "auto"
) -> RuntimeConfig:
    """Turns on GPU memory growth and sets the Keras dtype policy.

    `import tfmemsafe` calls this once with defaults read from the
    environment (`TFMEMSAFE_MEMORY_GROWTH`, `TFMEMSAFE_PRECISION`; set
    `TFMEMSAFE_AUTOCONFIGURE=0` to skip it). Calling it again is safe: it
    applies the settings again and returns a fresh report.

    With `precision="auto"` the policy is `mixed_float16` when every
    visible GPU has compute capability >= 7.0, and `float32` otherwise (on
    a CPU, float16 is slower and saves no memory). A policy other than
    `float32` that you set yourself before calling is kept.

    Args:
        memory_growth: bool. Whether to call
            `tf.config.experimental.set_memory_growth(gpu, True)` on every
            GPU, so TensorFlow takes memory as it needs it instead of all
            of it up front. Defaults to `True`.
        precision: str. One of `"auto"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"float32"`. Defaults to `"auto"`.

    Returns:
        A `RuntimeConfig` saying what was done.

    Raises:
        ValueError: If an argument is not one of the accepted values.

    Example:
    >>> config = tfmemsafe.configure(precision="float32")
    >>> config.dtype_policy
    'float32'
    """
    global _config
    if not isinstance(memory_growth, bool):
        raise ValueError(
            "`memory_growth` must be True or False. "
            f"Received: memory_growth={memory_growth!r}"
        )
    if precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {', '.join(map(repr, PRECISIONS))}. "
            f"Received: precision={precision!r}"
        )
    gpus = tf.config.list_physical_devices("GPU")
    warnings = []
    grown = _set_memory_growth(gpus, warnings) if memory_growth else ()
    policy, reason = _choose_policy(precision, gpus)
    keras.config.set_dtype_policy(policy)
    _config = RuntimeConfig(
        memory_growth=memory_growth,
        memory_growth_gpus=grown,
        precision=precision,
        dtype_policy=keras.config.dtype_policy().name,
        reason=reason,
        warnings=tuple(warnings),
    )
    logging.info("%s", _config)
    return _config


def runtime_config() -> RuntimeConfig | None:
    """Returns the `RuntimeConfig` in force, or `None` if never configured."""
    return _config


def _set_memory_growth(gpus, warnings: list[str]) -> tuple[str, ...]:
    grown = []
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as err:
            if tf.config.experimental.get_memory_growth(gpu):
                grown.append(gpu.name)
                continue
            message = (
                f"Could not turn on memory growth for {gpu.name}: {err}. "
                "Import tfmemsafe before creating any tensor or model, or "
                "set TF_FORCE_GPU_ALLOW_GROWTH=true before starting Python."
            )
            warnings.append(message)
            logging.warning("%s", message)
        else:
            grown.append(gpu.name)
    return tuple(grown)


def _choose_policy(precision: str, gpus) -> tuple[str, str]:
    if precision != "auto":
        return precision, "requested"
    current = keras.config.dtype_policy().name
    if current != "float32":
        return current, f"kept the policy {current!r} that was already set"
    if not gpus:
        return "float32", (
            "no GPU; on a CPU mixed_float16 is slower and saves no memory"
        )
    capabilities = {}
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        capabilities[gpu.name] = details.get("compute_capability")
    slow = {
        name: cc
        for name, cc in capabilities.items()
        if cc is None or tuple(cc) < _MIN_MIXED_FLOAT16_CAPABILITY
    }
    if slow:
        listed = ", ".join(
            f"{name} (compute capability {_format_cc(cc)})"
            for name, cc in slow.items()
        )
        return "float32", (
            f"{listed} lacks Tensor Cores (compute capability < 7.0)"
        )
    listed = ", ".join(
        f"{name} ({_format_cc(cc)})" for name, cc in capabilities.items()
    )
    return "mixed_float16", (
        f"every GPU has compute capability >= 7.0: {listed}"
    )


def _format_cc(cc) -> str:
    return "unknown" if cc is None else ".".join(str(part) for part in cc)


def configure_from_environment() -> RuntimeConfig | None:
    """Runs `configure()` with the settings in the environment.

    Called once by `import tfmemsafe`. An invalid value logs a warning
    naming the variable, the value and the accepted values, and the
    default is used instead, so a typo never breaks the import.
    """
    global _config
    env_warnings = []
    if not _read_env(ENV_AUTOCONFIGURE, _BOOLEANS, True, env_warnings):
        _config = None
        logging.info("tfmemsafe: %s=0, runtime left as is.", ENV_AUTOCONFIGURE)
        return None
    memory_growth = _read_env(ENV_MEMORY_GROWTH, _BOOLEANS, True, env_warnings)
    precision = _read_env(
        ENV_PRECISION, {p: p for p in PRECISIONS}, "auto", env_warnings
    )
    config = configure(memory_growth=memory_growth, precision=precision)
    _config = dataclasses.replace(
        config, warnings=tuple(env_warnings) + config.warnings
    )
    return _config


def _read_env(name: str, accepted: dict, default, warnings: list[str]):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = accepted.get(raw.strip().lower())
    if value is None:
        message = (
            f"Ignoring {name}={raw!r}: expected one of "
            f"{', '.join(accepted)}. Using the default, {default!r}."
        )
        warnings.append(message)
        logging.warning("%s", message)
        return default
    return value
