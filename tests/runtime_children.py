"""Work run in fresh processes by runtime_test.

Kept apart from the test module, which imports tfmemsafe at its top: these
functions import it themselves, after setting up what they test. Keras
alone does not import tfmemsafe, so importing it first is safe.
"""

import dataclasses

import keras


def import_and_report(set_policy_first=None):
    """Imports tfmemsafe in a fresh process and reports its configuration."""
    if set_policy_first:
        keras.config.set_dtype_policy(set_policy_first)
    import tfmemsafe

    config = tfmemsafe.runtime_config()
    return {
        "config": dataclasses.asdict(config) if config else None,
        "policy": keras.config.dtype_policy().name,
    }


def configure_and_report(precision):
    """Configures twice and reports both results and what is in force."""
    import tfmemsafe

    first = tfmemsafe.configure(precision=precision)
    second = tfmemsafe.configure(precision=precision)
    return {
        "first": dataclasses.asdict(first),
        "second": dataclasses.asdict(second),
        "current": dataclasses.asdict(tfmemsafe.runtime_config()),
        "policy": keras.config.dtype_policy().name,
    }


def read_cpu_memory(run_op_first=False, configure_again=None):
    """Imports tfmemsafe and reports its CPU allocator and a CPU reading.

    Args:
        run_op_first: Whether to run a TensorFlow op before the import,
            which creates TensorFlow's CPU device with its allocator.
        configure_again: If not `None`, `cpu_bfc_allocator` for a second
            `configure()` call, made before any op.
    """
    import os
    from unittest import mock

    import tensorflow as tf
    from absl import logging

    if run_op_first:
        tf.constant(1.0) + 1.0
    logged = []
    with mock.patch.object(
        logging,
        "warning",
        side_effect=lambda message, *args: logged.append(message % args),
    ):
        import tfmemsafe

        config = tfmemsafe.runtime_config()
        if configure_again is not None:
            config = tfmemsafe.configure(cpu_bfc_allocator=configure_again)
    variable = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC")
    tensor = tf.ones((1024, 1024))  # 4 MiB
    info = tfmemsafe.memory_info("CPU:0")
    del tensor
    return {
        "config": dataclasses.asdict(config) if config else None,
        "variable": variable,
        "logged_warnings": logged,
        "current_bytes": info.current_bytes,
        "peak_bytes": info.peak_bytes,
        "reason": info.reason,
    }


def monitor_sources():
    """Trains a tiny model with a MemoryMonitor; reports its CPU readings."""
    import numpy as np

    import tfmemsafe

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    monitor = tfmemsafe.MemoryMonitor(devices="CPU:0", warn_at=None)
    history = model.fit(
        np.ones((32, 4)),
        np.ones((32, 1)),
        batch_size=8,
        epochs=1,
        callbacks=[monitor],
        verbose=0,
    )
    return {
        "sources": sorted({sample.source for sample in monitor.samples}),
        "memory_peak_mb": history.history["memory_peak_mb"],
        "reason": tfmemsafe.memory_info("CPU:0").reason,
    }
