"""Runtime setup: GPU memory growth, the dtype policy, the CPU allocator."""

from __future__ import annotations

import dataclasses
import os

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _compat
from tfmemsafe import _tensorflow_logs
from tfmemsafe import memory

PRECISIONS = ("auto", "mixed_float16", "mixed_bfloat16", "float32")

# Tensor Cores, which make float16 matmuls and convolutions fast, arrived
# with compute capability 7.0 (Volta).
_MIN_MIXED_FLOAT16_CAPABILITY = (7, 0)

_ENV_AUTOCONFIGURE = "TFMEMSAFE_AUTOCONFIGURE"
_ENV_MEMORY_GROWTH = "TFMEMSAFE_MEMORY_GROWTH"
_ENV_PRECISION = "TFMEMSAFE_PRECISION"
_ENV_CPU_BFC_ALLOCATOR = "TFMEMSAFE_CPU_BFC_ALLOCATOR"
_BOOLEANS = {"1": True, "true": True, "0": False, "false": False}

# TensorFlow's own variables, read when its CPU device is created.
_TF_USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
_TF_BFC_LIMIT = "TF_CPU_BFC_MEM_LIMIT_IN_MB"

_config: RuntimeConfig | None = None
# The environment variables tfmemsafe set itself, with their values, so
# that calling configure() again recognises them as its own.
_environment_set: dict[str, str] = {}
_warned_cpu_device_exists = False


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """What `configure()` did.

    Attributes:
        memory_growth: Whether memory growth was requested.
        memory_growth_gpus: The physical GPUs that now have memory growth.
        precision: The precision that was asked for (`"auto"` or a policy).
        dtype_policy: The name of the Keras dtype policy now in force.
        reason: Why that policy was chosen.
        cpu_bfc_allocator: Whether TensorFlow's BFC allocator was requested
            for the CPU.
        cpu_allocator: The CPU allocator TensorFlow uses: `"bfc"`,
            `"onednn"` (oneDNN's, BFC-based) or `"default"` (the one that
            keeps no statistics, so CPU readings are the process's
            resident memory).
        cpu_allocator_reason: Why it is that one.
        onednn: Whether TensorFlow's oneDNN kernels are on (TensorFlow
            turns them on by default only on CPUs with AVX-512 VNNI/BF16
            or AMX; `TF_ENABLE_ONEDNN_OPTS` overrides).
        tensorflow_logs: What became of TensorFlow's INFO logs, which
            hold the allocator's dump after an out-of-memory error.
        warnings: What could not be done, and what to do about it.
    """

    memory_growth: bool
    memory_growth_gpus: tuple[str, ...]
    precision: str
    dtype_policy: str
    reason: str
    cpu_bfc_allocator: bool
    cpu_allocator: str
    cpu_allocator_reason: str
    onednn: bool = False
    tensorflow_logs: str = ""
    warnings: tuple[str, ...] = ()

    def __str__(self) -> str:
        gpus = ", ".join(self.memory_growth_gpus) or "none"
        lines = [
            f"tfmemsafe: dtype policy {self.dtype_policy} ({self.reason}); "
            f"memory growth on GPUs: {gpus}; CPU allocator "
            f"{self.cpu_allocator} ({self.cpu_allocator_reason}); oneDNN "
            f"{'on' if self.onednn else 'off'}; TensorFlow logs: "
            f"{self.tensorflow_logs or 'as TensorFlow sets them'}."
        ]
        lines += [f"tfmemsafe warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def configure(
    memory_growth: bool = True,
    precision: str = "auto",
    cpu_bfc_allocator: bool = True,
) -> RuntimeConfig:
    """Turns on GPU memory growth, sets the dtype policy and CPU allocator.

    `import tfmemsafe` calls this once with defaults read from the
    environment (`TFMEMSAFE_MEMORY_GROWTH`, `TFMEMSAFE_PRECISION`,
    `TFMEMSAFE_CPU_BFC_ALLOCATOR`; set `TFMEMSAFE_AUTOCONFIGURE=0` to skip
    it). Calling it again is safe: it applies the settings again and
    returns a fresh report.

    With `precision="auto"` the policy is `mixed_float16` when every
    visible GPU has compute capability >= 7.0, and `float32` otherwise (on
    a CPU, float16 is slower and saves no memory). A policy other than
    `float32` that you set yourself before calling is kept.

    TensorFlow's default CPU allocator keeps no statistics unless oneDNN is
    on (TensorFlow turns it on by default only on CPUs with AVX-512
    VNNI/BF16 or AMX). With `cpu_bfc_allocator=True`, `configure()` sets
    `TF_CPU_ALLOCATOR_USE_BFC=true`, so `memory_info("CPU:0")` reads the
    allocator on every CPU. This works only before TensorFlow's CPU device
    exists (before the first op); later, the report says so. A value of
    `TF_CPU_ALLOCATOR_USE_BFC` that you set yourself is kept.

    Args:
        memory_growth: bool. Whether to call
            `tf.config.experimental.set_memory_growth(gpu, True)` on every
            GPU, so TensorFlow takes memory as it needs it instead of all
            of it up front. Defaults to `True`.
        precision: str. One of `"auto"`, `"mixed_float16"`,
            `"mixed_bfloat16"` or `"float32"`. Defaults to `"auto"`.
        cpu_bfc_allocator: bool. Whether to have TensorFlow use its BFC
            allocator on the CPU, which keeps statistics. `False` undoes
            what an earlier call set, if TensorFlow has not started yet.
            Defaults to `True`.

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
    if not isinstance(cpu_bfc_allocator, bool):
        raise ValueError(
            "`cpu_bfc_allocator` must be True or False. "
            f"Received: cpu_bfc_allocator={cpu_bfc_allocator!r}"
        )
    _checks.one_of("precision", precision, PRECISIONS)
    gpus = tf.config.list_physical_devices("GPU")
    warnings = []
    grown = _set_memory_growth(gpus, warnings) if memory_growth else ()
    policy, reason = _choose_policy(precision, gpus)
    keras.config.set_dtype_policy(policy)
    cpu_allocator, cpu_reason = _set_cpu_allocator(cpu_bfc_allocator, warnings)
    _config = RuntimeConfig(
        memory_growth=memory_growth,
        memory_growth_gpus=grown,
        precision=precision,
        dtype_policy=keras.config.dtype_policy().name,
        reason=reason,
        cpu_bfc_allocator=cpu_bfc_allocator,
        cpu_allocator=cpu_allocator,
        cpu_allocator_reason=cpu_reason,
        onednn=_onednn_enabled(),
        tensorflow_logs=_tensorflow_logs.DONE,
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


def _set_cpu_allocator(requested: bool, warnings: list[str]) -> tuple[str, str]:
    """Sets or clears TF_CPU_ALLOCATOR_USE_BFC; returns (allocator, why)."""
    global _warned_cpu_device_exists
    value = os.environ.get(_TF_USE_BFC, "").strip()
    ours = value != "" and _environment_set.get(_TF_USE_BFC) == value
    if value and not ours:
        use_bfc = value.lower() in ("true", "1")
        return _allocator_in_use(use_bfc), (
            f"{_TF_USE_BFC}={value} was set before tfmemsafe; kept"
        )
    if _cpu_device_exists():
        if ours:
            if not requested:
                message = (
                    "Could not stop using the BFC allocator on the CPU: "
                    "TensorFlow's CPU device already exists."
                )
                warnings.append(message)
                logging.warning("%s", message)
            return "bfc", f"{_TF_USE_BFC}=true, set by tfmemsafe"
        allocator = _allocator_in_use(False)
        reason = "TensorFlow's CPU device already existed; left as it was"
        if requested and allocator == "default":
            message = (
                "TensorFlow's CPU device was created before tfmemsafe could "
                "choose its allocator; it keeps no statistics, so memory "
                "readings on the CPU are the process's resident memory. "
                "Import tfmemsafe before running any TensorFlow op, or set "
                f"{_TF_USE_BFC}=true before starting Python."
            )
            warnings.append(message)
            if not _warned_cpu_device_exists:
                _warned_cpu_device_exists = True
                logging.warning("%s", message)
        return allocator, reason
    if not requested:
        for name, set_value in list(_environment_set.items()):
            if os.environ.get(name) == set_value:
                del os.environ[name]
            del _environment_set[name]
        return _allocator_in_use(False), "not requested"
    _set_environment(_TF_USE_BFC, "true")
    reason = f"{_TF_USE_BFC}=true, set by tfmemsafe"
    if not os.environ.get(_TF_BFC_LIMIT, "").strip():
        # TensorFlow reads an empty limit as 0 bytes, and crashes.
        os.environ.pop(_TF_BFC_LIMIT, None)
        machine = memory.machine_memory_bytes()
        if machine and machine > memory.TF_BFC_DEFAULT_LIMIT_BYTES:
            # TensorFlow's BFC allocator would otherwise stop at 64 GB.
            _set_environment(_TF_BFC_LIMIT, str(machine // (1024 * 1024)))
    limit = os.environ.get(_TF_BFC_LIMIT)
    if limit is not None and _environment_set.get(_TF_BFC_LIMIT) == limit:
        reason += f", and {_TF_BFC_LIMIT}={limit}"
    return "bfc", reason


def _set_environment(name: str, value: str) -> None:
    os.environ[name] = value
    _environment_set[name] = value


def _allocator_in_use(use_bfc: bool) -> str:
    if use_bfc:
        return "bfc"
    return "onednn" if _onednn_enabled() else "default"


def _onednn_enabled() -> bool:
    return _compat.onednn_enabled()


def _cpu_device_exists() -> bool:
    """Whether TensorFlow's eager context, and so its CPU device, exists."""
    return _compat.eager_context_started()


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
    if not _read_env(_ENV_AUTOCONFIGURE, _BOOLEANS, True, env_warnings):
        _config = None
        logging.info("tfmemsafe: %s=0, runtime left as is.", _ENV_AUTOCONFIGURE)
        return None
    memory_growth = _read_env(_ENV_MEMORY_GROWTH, _BOOLEANS, True, env_warnings)
    precision = _read_env(
        _ENV_PRECISION, {p: p for p in PRECISIONS}, "auto", env_warnings
    )
    cpu_bfc_allocator = _read_env(
        _ENV_CPU_BFC_ALLOCATOR, _BOOLEANS, True, env_warnings
    )
    config = configure(
        memory_growth=memory_growth,
        precision=precision,
        cpu_bfc_allocator=cpu_bfc_allocator,
    )
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
