"""Running a function or script in fresh processes: alone or as a cluster."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from tfmemsafe import _checks
from tfmemsafe.testing._allocator import memory_cap_environment
from tfmemsafe.testing._child import SubprocessError
from tfmemsafe.testing._child import _Child

_DEFAULT_TIMEOUT = 600
# TensorFlow's coordination service stops a cluster whose task sends no
# heartbeat for 10 s, and a busy machine can hold a worker's process off
# the CPU that long. Workers started here allow this many seconds.
_HEARTBEAT_TIMEOUT_S = 60


def run_with_memory_cap(
    target: Callable | str,
    cap_mb: int,
    *,
    args: Sequence = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = _DEFAULT_TIMEOUT,
    capture_output: bool = True,
) -> Any:
    """Runs a function or script in a fresh process with a capped CPU heap.

    TensorFlow in the child can allocate at most `cap_mb` megabytes on the
    CPU; past that it raises a genuine `tf.errors.ResourceExhaustedError`,
    as a full GPU would. Use it to reproduce, test and benchmark
    out-of-memory behaviour on any machine.

    Args:
        target: The work to run. A module-level function (or its path,
            `"package.module:function"`), called with `args` and `kwargs`,
            whose JSON-serializable return value is returned; or the path
            of a Python script (`"train.py"`), run with `args` as its
            command line, whose standard output is returned.
        cap_mb: int. The allocator limit in megabytes.
        args: Positional arguments for the function, or the script's
            command-line arguments. Must be JSON-serializable.
        kwargs: Keyword arguments for the function.
        env: Extra environment variables for the child.
        timeout: float. Seconds before the child (and its children) are
            killed. Defaults to 600.
        capture_output: bool. `False` lets the child print straight to
            this process's stdout and stderr as it runs (a script then
            returns `None`, and errors carry no stderr tail). Defaults to
            `True`.

    Returns:
        The function's return value, or the script's standard output.

    Raises:
        SubprocessError: If the child fails, times out or dies. The
            child's exception is rebuilt and chained as `__cause__`, and
            the message ends with the tail of the child's standard error.

    Example:
    >>> def train(batch_size):
    ...     ...  # build and fit a model
    ...     return float(history.history["loss"][-1])
    >>> run_with_memory_cap("my_tests:train", 300, args=[1024])
    """
    child_env = dict(memory_cap_environment(cap_mb))
    child_env.update(env or {})
    return run_in_subprocess(
        target,
        args=args,
        kwargs=kwargs,
        env=child_env,
        timeout=timeout,
        capture_output=capture_output,
    )


def run_in_subprocess(
    target: Callable | str,
    *,
    args: Sequence = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = _DEFAULT_TIMEOUT,
    capture_output: bool = True,
) -> Any:
    """Runs a function or script in a fresh Python process.

    For work that changes process-wide state (environment variables read
    at import, the Keras dtype policy, logical devices). The child sees
    this process's `sys.path`, so anything importable here is there too.
    Arguments and returns are as for `run_with_memory_cap`.

    With `TFMEMSAFE_TESTING_PRELOAD=1` in the child's environment (this
    process's or `env`), a function target whose output is captured is
    forked instead from a server process that has imported TensorFlow
    and Keras and made no device yet, which saves each child that import;
    the same holds for `run_with_memory_cap` and `run_workers`. Leave it
    unset where the import itself is under test.
    """
    with tempfile.TemporaryDirectory(prefix="tfmemsafe-") as tmp:
        child = _Child(target, args, kwargs, env, capture_output, tmp)
        child.wait(timeout)
        return child.outcome()


def run_workers(
    target: Callable | str,
    num_workers: int = 2,
    *,
    args: Sequence = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    worker_env: Sequence[Mapping[str, str]] | None = None,
    timeout: float = _DEFAULT_TIMEOUT,
    return_exceptions: bool = False,
) -> list:
    """Runs a function as the workers of a local multi-worker cluster.

    Starts `num_workers` fresh processes on this machine, each with a
    `TF_CONFIG` naming all of them (free loopback ports) and its own task
    index, so that `tf.distribute.MultiWorkerMirroredStrategy()` in the
    function forms one cluster. Its coordination service waits 60 s for a
    worker's missing heartbeat (TensorFlow's default: 10 s), so that a
    busy machine does not stop the cluster. All are killed, with their
    children, if any is still running after `timeout` seconds.

    Args:
        target: A module-level function (or `"module:function"`), run by
            every worker with `args` and `kwargs`. It can read its index
            from `TF_CONFIG`.
        num_workers: int. How many workers. Defaults to 2.
        args: JSON-serializable positional arguments.
        kwargs: JSON-serializable keyword arguments.
        env: Extra environment variables for every worker.
        worker_env: One mapping of extra environment variables per
            worker (for example a memory cap on one of them).
        timeout: float. Seconds for the whole cluster. Defaults to 600.
        return_exceptions: bool. If `True`, a failed worker's
            `SubprocessError` takes its place in the returned list instead
            of being raised. Defaults to `False`.

    Returns:
        The workers' return values, by task index.

    Raises:
        SubprocessError: The first failed worker's error (unless
            `return_exceptions`).

    Example:
    >>> def train():
    ...     strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ...     ...
    ...     return [w.tolist() for w in model.get_weights()]
    >>> first, second = tfmemsafe.testing.run_workers(train, 2)
    """
    num_workers = _checks.integer("num_workers", num_workers, 1)
    worker_env = list(worker_env or [{}] * num_workers)
    if len(worker_env) != num_workers:
        raise ValueError(
            "`worker_env` must have one mapping per worker. Received: "
            f"{len(worker_env)} mappings for num_workers={num_workers}"
        )
    cluster = {
        "worker": [f"localhost:{port}" for port in _free_ports(num_workers)]
    }
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="tfmemsafe-") as tmp:
        children = []
        try:
            for index in range(num_workers):
                config = {
                    "cluster": cluster,
                    "task": {"type": "worker", "index": index},
                }
                child_env = {
                    **(env or {}),
                    **worker_env[index],
                    "TF_CONFIG": json.dumps(config),
                }
                directory = os.path.join(tmp, str(index))
                os.mkdir(directory)
                children.append(
                    _Child(
                        target,
                        args,
                        kwargs,
                        child_env,
                        True,
                        directory,
                        setup=f"{__name__}:_patient_coordination",
                    )
                )
            for child in children:
                child.wait(max(deadline - time.monotonic(), 0.1))
        finally:
            for child in children:
                child.kill()
        results = []
        for child in children:
            try:
                results.append(child.outcome())
            except SubprocessError as err:
                if not return_exceptions:
                    raise
                results.append(err)
    return results


def _patient_coordination() -> None:
    """In a worker, before its target: the coordination service that
    `MultiWorkerMirroredStrategy` starts waits `_HEARTBEAT_TIMEOUT_S` for
    a missing heartbeat."""
    import tensorflow as tf

    from tfmemsafe import _compat

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    _compat.configure_coordination_service(
        resolver.cluster_spec(), _HEARTBEAT_TIMEOUT_S
    )


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("localhost", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
