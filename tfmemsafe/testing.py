"""Run code in a fresh Python process, optionally under a real memory cap.

TensorFlow reads its allocator settings once, when it is imported, and
keeps global state (the dtype policy, logical devices) for the life of the
process. Tests of that state, and tests that need a genuine
`ResourceExhaustedError` on a machine without a GPU, therefore run in a
child process. `run_with_memory_cap` starts one whose CPU allocator is
capped, so TensorFlow really runs out of memory, and raises the error
back in the parent where `tfmemsafe.is_oom_error` recognises it.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

DEFAULT_TIMEOUT = 600
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


def memory_cap_environment(cap_mb: int) -> dict[str, str]:
    """Returns the environment that caps TensorFlow's CPU allocator.

    `TF_CPU_ALLOCATOR_USE_BFC=true` and `TF_CPU_BFC_MEM_LIMIT_IN_MB` make
    the allocator refuse allocations past the cap with a real
    `ResourceExhaustedError`; `TF_ENABLE_ONEDNN_OPTS=0` because TF 2.21's
    oneDNN kernels crash after such an error; `CUDA_VISIBLE_DEVICES=""`
    so the work runs on the capped CPU. These must be set before
    TensorFlow is imported.
    """
    if isinstance(cap_mb, bool) or not isinstance(cap_mb, int) or cap_mb < 1:
        raise ValueError(
            f"`cap_mb` must be an integer >= 1. Received: cap_mb={cap_mb!r}"
        )
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
    timeout: float = DEFAULT_TIMEOUT,
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
    timeout: float = DEFAULT_TIMEOUT,
    capture_output: bool = True,
) -> Any:
    """Runs a function or script in a fresh Python process.

    For work that changes process-wide state (environment variables read
    at import, the Keras dtype policy, logical devices). The child sees
    this process's `sys.path`, so anything importable here is there too.
    Arguments and returns are as for `run_with_memory_cap`.
    """
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p and os.path.isdir(p)]
    )
    child_env.update(env or {})
    if isinstance(target, str) and target.endswith(".py"):
        return _run_script(target, args, child_env, timeout, capture_output)
    with tempfile.TemporaryDirectory(prefix="tfmemsafe-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        payload = {
            "target": _target_path(target),
            "args": list(args),
            "kwargs": dict(kwargs or {}),
            "result_path": result_path,
        }
        command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(payload)]
        returncode, stdout, stderr = _communicate(
            command, child_env, timeout, capture_output
        )
        try:
            with open(result_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = None
    if result is None or "error" in result:
        error = (result or {}).get("error")
        raise _failure(payload["target"], returncode, stdout, stderr, error)
    return result["value"]


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


def _run_script(path, args, env, timeout, capture_output) -> str | None:
    if not os.path.isfile(path):
        raise ValueError(
            f"`target` script not found. Received: target={path!r}"
        )
    command = [sys.executable, path, *map(str, args)]
    returncode, stdout, stderr = _communicate(
        command, env, timeout, capture_output
    )
    if returncode != 0:
        raise _failure(path, returncode, stdout, stderr, _parse_error(stderr))
    return stdout if capture_output else None


def _communicate(command, env, timeout, capture) -> tuple[int, str, str]:
    pipe = subprocess.PIPE if capture else None
    process = subprocess.Popen(
        command,
        env=env,
        stdout=pipe,
        stderr=pipe,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = process.communicate()
        stderr = (stderr or "") + f"\n[killed: still running after {timeout} s]"
        return -signal.SIGKILL, stdout or "", stderr
    except BaseException:
        # Ctrl-C in the parent: leave no orphans behind.
        _kill_group(process)
        raise
    return process.returncode, stdout or "", stderr or ""


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _failure(target, returncode, stdout, stderr, error) -> SubprocessError:
    tail = "\n".join(stderr.rstrip().splitlines()[-_STDERR_TAIL_LINES:])
    if error:
        what = f"raised {error['name']}: {_headline(error['message'])}"
    elif returncode < 0:
        what = f"was killed by signal {-returncode}"
    else:
        what = f"exited with code {returncode}"
    message = f"{target} {what}\n--- last lines of its stderr ---\n{tail}"
    exc = SubprocessError(message, returncode, tail, stdout)
    if error:
        exc.__cause__ = _rebuild(error)
    return exc


def _headline(message: str) -> str:
    """The line of an error message worth showing (TF's first is generic)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "OOM" in line or "RESOURCE_EXHAUSTED" in line:
            return line
    return lines[0] if lines else ""


def _rebuild(error: dict) -> BaseException:
    """Rebuilds the child's exception, keeping TensorFlow error classes."""
    name, message = error["name"], error["message"]
    if error["module"].startswith("tensorflow"):
        import tensorflow as tf

        cls = getattr(tf.errors, name, None)
        if isinstance(cls, type) and issubclass(cls, tf.errors.OpError):
            return cls(None, None, message)
    cls = getattr(builtins, name, None)
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
