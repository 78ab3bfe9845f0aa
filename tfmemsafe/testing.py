"""Run code in a fresh Python process, optionally under a real memory cap.

TensorFlow reads its allocator settings once, when it is imported, and
keeps global state (the dtype policy, logical devices) for the life of the
process. Tests of that state, and tests that need a genuine
`ResourceExhaustedError` on a machine without a GPU, therefore run in a
child process. `run_with_memory_cap` starts one whose CPU allocator is
capped, so TensorFlow really runs out of memory, and raises the error
back in the parent where `tfmemsafe.is_oom_error` recognises it.
`run_workers` starts a local multi-worker cluster of such processes, and
`AllocatorFailures` counts the allocator's own out-of-memory reports.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from tfmemsafe import _checks
from tfmemsafe import _messages

_DEFAULT_TIMEOUT = 600
_STDERR_TAIL_LINES = 30

# The child's entry point. It imports nothing from TensorFlow or tfmemsafe
# itself, so the target decides what is imported and when.
_BOOTSTRAP = r"""
import importlib, json, sys, traceback
payload = json.loads(sys.argv[1])
module_name, _, qualname = payload["target"].partition(":")
try:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    result = {"value": obj(*payload["args"], **payload["kwargs"])}
except BaseException as err:
    traceback.print_exc()
    cls = type(err)
    result = {"error": {"module": cls.__module__, "name": cls.__name__,
                        "message": str(err)}}
try:
    text = json.dumps(result)
except (TypeError, ValueError) as err:
    result = {"error": {"module": "builtins", "name": "TypeError",
                        "message": "the return value is not "
                        "JSON-serializable: %s" % err}}
    text = json.dumps(result)
with open(payload["result_path"], "w") as f:
    f.write(text)
sys.exit(1 if "error" in result else 0)
"""


class SubprocessError(RuntimeError):
    """A child process started by `tfmemsafe.testing` failed.

    The child's exception, rebuilt in this process (TensorFlow errors keep
    their class, so `is_oom_error` works on it), is chained as
    `__cause__`.

    Attributes:
        returncode: The child's exit code (negative: killed by a signal).
        stderr: The last lines of the child's standard error.
        stdout: The child's standard output.
    """

    def __init__(self, message: str, returncode: int, stderr: str, stdout=""):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr
        self.stdout = stdout


class AllocatorFailures:
    """Counts the allocations TensorFlow's BFC allocator failed.

    A context manager. While it is active, this process's standard error
    (where TensorFlow's C++ logging writes) goes to a temporary file; on
    exit the file is written back to standard error and `count` is the
    number of the allocator's "ran out of memory trying to allocate"
    reports in it: one per failed allocation, each having waited about
    ten seconds, whether or not anything caught the error.

    Attributes:
        count: int or `None`. The failures; `None` until it exits.

    Example:
    >>> with tfmemsafe.testing.AllocatorFailures() as failures:
    ...     tfmemsafe.fit(model, (x, y), batch_size=4096)
    >>> failures.count
    0
    """

    REPORT = "ran out of memory trying to allocate"

    def __init__(self):
        self.count = None
        self._log = None
        self._saved = None

    def __enter__(self) -> AllocatorFailures:
        sys.stderr.flush()
        self._log = tempfile.TemporaryFile("w+b")
        self._saved = os.dup(2)
        os.dup2(self._log.fileno(), 2)
        return self

    def __exit__(self, *exc_info) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._log.seek(0)
        text = self._log.read()
        self._log.close()
        os.write(2, text)
        self.count = text.decode(errors="replace").count(self.REPORT)


def memory_cap_environment(cap_mb: int) -> dict[str, str]:
    """Returns the environment that caps TensorFlow's CPU allocator.

    `TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` make
    the allocator refuse allocations past the cap with a real
    `ResourceExhaustedError`; `TF_ENABLE_ONEDNN_OPTS=0` because TF 2.21's
    oneDNN kernels crash after such an error; `CUDA_VISIBLE_DEVICES=""`
    so the work runs on the capped CPU. These must be set before
    TensorFlow is imported.
    """
    cap_mb = _checks.integer("cap_mb", cap_mb, 1)
    return {
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
        "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(cap_mb),
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }


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
    function forms one cluster. All are killed, with their children, if
    any is still running after `timeout` seconds.

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
                    _Child(target, args, kwargs, child_env, True, directory)
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


class _Child:
    """One child process running a function or a script."""

    def __init__(self, target, args, kwargs, env, capture, directory):
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p and os.path.isdir(p)]
        )
        child_env.update(env or {})
        self.result_path = None
        if isinstance(target, str) and target.endswith(".py"):
            if not os.path.isfile(target):
                raise ValueError(
                    f"`target` script not found. Received: target={target!r}"
                )
            self.name = target
            command = [sys.executable, target, *map(str, args)]
        else:
            self.name = _target_path(target)
            self.result_path = os.path.join(directory, "result.json")
            payload = {
                "target": self.name,
                "args": list(args),
                "kwargs": dict(kwargs or {}),
                "result_path": self.result_path,
            }
            command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(payload)]
        self.capture = capture
        pipe = subprocess.PIPE if capture else None
        self.process = subprocess.Popen(
            command,
            env=child_env,
            stdout=pipe,
            stderr=pipe,
            text=True,
            start_new_session=True,
        )
        self.stdout = self.stderr = ""

    def wait(self, timeout: float) -> None:
        """Waits for the child; kills it (and its group) after `timeout`."""
        try:
            stdout, stderr = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            stdout, stderr = self.process.communicate()
            stderr = (stderr or "") + (
                f"\n[killed: still running after {timeout:.0f} s]"
            )
        except BaseException:
            # Ctrl-C in the parent: leave no orphans behind.
            self.kill()
            raise
        self.stdout, self.stderr = stdout or "", stderr or ""

    def kill(self) -> None:
        if self.process.poll() is None:
            _kill_group(self.process)

    def outcome(self):
        """The function's value or the script's stdout; raises on failure."""
        returncode = self.process.returncode
        if self.result_path is None:
            if returncode != 0:
                raise _failure(
                    self.name,
                    returncode,
                    self.stdout,
                    self.stderr,
                    _parse_error(self.stderr),
                )
            return self.stdout if self.capture else None
        try:
            with open(self.result_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
        if result is None or "error" in result:
            error = (result or {}).get("error")
            raise _failure(
                self.name, returncode, self.stdout, self.stderr, error
            )
        return result["value"]


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


def _target_path(target) -> str:
    if callable(target):
        module = getattr(target, "__module__", None)
        qualname = getattr(target, "__qualname__", "")
        if not module or "<" in qualname:
            raise ValueError(
                "`target` must be a module-level function, so that a new "
                f"process can import it. Received: target={target!r}"
            )
        if module == "__main__":
            module = _main_module_name()
        return f"{module}:{qualname}"
    if isinstance(target, str) and ":" in target:
        return target
    raise ValueError(
        "`target` must be a module-level function, a 'module:function' "
        f"string or the path of a .py script. Received: target={target!r}"
    )


def _main_module_name() -> str:
    path = getattr(sys.modules["__main__"], "__file__", None)
    if not path:
        raise ValueError(
            "`target` is defined in an interactive session; define it in "
            "a module so that a new process can import it."
        )
    return os.path.splitext(os.path.basename(path))[0]


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _failure(target, returncode, stdout, stderr, error) -> SubprocessError:
    tail = "\n".join(stderr.rstrip().splitlines()[-_STDERR_TAIL_LINES:])
    if error:
        what = (
            f"raised {error['name']}: {_messages.error_line(error['message'])}"
        )
    elif returncode < 0:
        what = f"was killed by signal {-returncode}"
    else:
        what = f"exited with code {returncode}"
    message = f"{target} {what}\n--- last lines of its stderr ---\n{tail}"
    exc = SubprocessError(message, returncode, tail, stdout)
    if error:
        exc.__cause__ = _rebuild(error)
    return exc


def _rebuild(error: dict) -> BaseException:
    """Rebuilds the child's exception, keeping TensorFlow error classes."""
    name, message = error["name"], error["message"]
    if error["module"].startswith("tensorflow"):
        import tensorflow as tf

        cls = getattr(tf.errors, name, None)
        if isinstance(cls, type) and issubclass(cls, tf.errors.OpError):
            return cls(None, None, message)
    # Classes of modules already imported here (builtins, tfmemsafe.errors)
    # are rebuilt as themselves; nothing new is imported for it.
    module = sys.modules.get(error["module"], builtins)
    cls = getattr(module, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:
            pass
    return RuntimeError(f"{error['module']}.{name}: {message}")


def _parse_error(stderr: str) -> dict | None:
    """Finds `module.Class: message` in a script's traceback."""
    for line in reversed(stderr.splitlines()):
        head, sep, message = line.partition(": ")
        if sep and head and " " not in head and head[0].isalpha():
            module, _, name = head.rpartition(".")
            if name.endswith(("Error", "Exception", "Exhausted")):
                return {
                    "module": module or "builtins",
                    "name": name,
                    "message": message,
                }
    return None
