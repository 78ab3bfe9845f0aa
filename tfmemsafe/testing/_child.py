"""The child process behind `tfmemsafe.testing`'s runners.

A target (a module-level function, its `"module:function"` path, or a
script) runs in a fresh Python process (or one forked from a process with
TensorFlow imported: `_preloaded`) that sees this process's `sys.path`;
its return value comes back as JSON, and its exception is rebuilt here,
keeping TensorFlow's error classes so that `is_oom_error` works on it.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys

from tfmemsafe import _messages
from tfmemsafe.testing import _preloaded

_STDERR_TAIL_LINES = 30
# A child ended by a signal leaves the Python stack of every thread
# (`faulthandler`), where the crash is found.
_STDERR_TAIL_LINES_AFTER_A_SIGNAL = 120

# The child's entry point. It imports nothing from TensorFlow or tfmemsafe
# itself, so the target decides what is imported and when.
_BOOTSTRAP = r"""
import faulthandler, importlib, json, sys, traceback
faulthandler.enable(all_threads=True)
payload = json.loads(sys.argv[1])
module_name, _, qualname = payload["target"].partition(":")
try:
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if payload["setup"]:
        setup_module, _, setup_name = payload["setup"].partition(":")
        getattr(importlib.import_module(setup_module), setup_name)()
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


class _Child:
    """One child process running a function or a script.

    A function target's child calls `setup` (`"module:function"`), if
    given, after importing the target's module and before the target.
    """

    def __init__(
        self, target, args, kwargs, env, capture, directory, setup=None
    ):
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
                "setup": setup,
            }
            command = [sys.executable, "-c", _BOOTSTRAP, json.dumps(payload)]
        self.capture = capture
        self.process = None
        if self.result_path and capture and _preloaded.wanted(child_env):
            self.process = _preloaded.fork(
                _BOOTSTRAP, [json.dumps(payload)], child_env, directory
            )
        if self.process is None:
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
    lines = _STDERR_TAIL_LINES
    if returncode is not None and returncode < 0:
        lines = _STDERR_TAIL_LINES_AFTER_A_SIGNAL
    tail = "\n".join(stderr.rstrip().splitlines()[-lines:])
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
