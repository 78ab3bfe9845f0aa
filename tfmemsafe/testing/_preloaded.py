"""Child processes forked from a server that has TensorFlow imported.

Importing TensorFlow and Keras costs every child process several seconds
of CPU before it runs anything, and a test suite of real out-of-memory
tests starts many. With `TFMEMSAFE_TESTING_PRELOAD=1` in a child's
environment, `tfmemsafe.testing`'s runners fork function targets from a
server process that has imported both and done nothing else: no device,
no allocator, no TensorFlow context exists when it forks, so the
variables TensorFlow reads when it makes its first device (the memory
cap's, `TF_CONFIG`) still take effect in the child.

A server is started with the child's environment, less the variables
read after import (`_READ_AFTER_IMPORT`, `TFMEMSAFE_*`) and pytest's
(which change from test to test), so every variable TensorFlow or Keras
reads at import is as the child asked; a child whose environment differs
there gets its own server. What is not as in a fresh process: TensorFlow
and Keras are imported before the target runs (a target that sets their
import-time variables itself, or reads what they print at import, needs
a fresh process; without `TF_CPP_MIN_LOG_LEVEL` set, tfmemsafe's import
finds TensorFlow imported first and leaves its INFO logs shown), and
every child of one server starts from the same Python hash seed and
NumPy random state.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl import logging

_SWITCH = "TFMEMSAFE_TESTING_PRELOAD"
# Read when TensorFlow makes its first device, or a strategy its cluster.
_READ_AFTER_IMPORT = frozenset(
    {"TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "TF_CONFIG"}
)
_MOST_SERVERS = 4
_START_TIMEOUT_S = 300
_POLL_S = 0.05

# The server. It reads one JSON request per line and answers with the
# forked child's pid; the child's exit code goes into the file the request
# names once the server has reaped it. It ends when its standard input
# closes (the process that started it asked, or ended), once its children
# have. Only registered children are reaped, and once more after each
# registration, so no exit is missed whichever thread takes the signal.
_SERVER = r"""
import json, os, signal, sys
import keras, tensorflow

children = {}


def record(pid, status):
    path = children.pop(pid, None)
    if path is None:
        return
    try:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # The caller has gone, with the child's directory.


def reap(*_):
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # Reaped by a call this signal interrupted.
        if done:
            record(pid, status)


def serve():
    signal.signal(signal.SIGCHLD, reap)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return request
        children[pid] = request["returncode_path"]
        reap()
        print(json.dumps({"pid": pid}), flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid in list(children):
        record(*os.waitpid(pid, 0))
    sys.exit(0)


request = serve()
os.setsid()
for fd, path, flags in (
    (0, os.devnull, os.O_RDONLY),
    (1, request["stdout_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    (2, request["stderr_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
):
    opened = os.open(path, flags)
    os.dup2(opened, fd)
    os.close(opened)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.argv = ["-c", *request["argv"]]
exec(compile(request["bootstrap"], "<string>", "exec"))
"""


def wanted(env: dict) -> bool:
    """Whether a child with this environment is forked from a server:
    asked for, where processes fork (not on Windows)."""
    return env.get(_SWITCH, "") == "1" and hasattr(os, "fork")


class ForkedProcess:
    """A child forked by a server, behind the part of `subprocess.Popen`'s
    interface that `tfmemsafe.testing` uses; its output goes to files."""

    def __init__(self, pid: int, directory: str, server: subprocess.Popen):
        self.pid = pid
        self.returncode = None
        self._directory = directory
        self._server = server

    def poll(self) -> int | None:
        """The exit code once the server has reaped the child, else `None`."""
        if self.returncode is None:
            path = os.path.join(self._directory, "returncode")
            if os.path.exists(path):
                with open(path) as f:
                    self.returncode = int(f.read())
            elif self._server.poll() is not None and not os.path.exists(path):
                # The server died and cannot report: the child goes too.
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.returncode = -signal.SIGKILL
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the child's end; returns its stdout and stderr."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forked child", timeout)
            time.sleep(_POLL_S)
        return self._read("stdout"), self._read("stderr")

    def _read(self, name: str) -> str:
        try:
            with open(
                os.path.join(self._directory, name), errors="replace"
            ) as f:
                return f.read()
        except FileNotFoundError:  # The child ended before it opened it.
            return ""


def fork(bootstrap: str, argv: list, env: dict, directory: str):
    """Forks a child running `bootstrap` with `argv` and `env`, from the
    server for `env`; `None` if there is none (the caller then starts a
    fresh process)."""
    request = {
        "bootstrap": bootstrap,
        "argv": argv,
        "env": env,
        "cwd": os.getcwd(),
        "stdout_path": os.path.join(directory, "stdout"),
        "stderr_path": os.path.join(directory, "stderr"),
        "returncode_path": os.path.join(directory, "returncode"),
    }
    key = _key(env)
    with _lock:
        server = _server_for(key)
        if server is None:
            return None
        reply = server.ask(request)
        if reply is None:
            del _servers[key]
            _give_up(key, server, "could not fork a child")
            return None
    return ForkedProcess(reply["pid"], directory, server.process)


class _Server:
    """A running server: its process and where its stderr goes."""

    def __init__(self, process: subprocess.Popen, stderr_path: str):
        self.process = process
        self.stderr_path = stderr_path

    def ask(self, request: dict) -> dict | None:
        """Forks a child; its pid, or `None` if the server is gone."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:
            return None
        return _reply(self.process, None)

    def close(self) -> None:
        """Asks the server to end once its running children have."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            os.remove(self.stderr_path)
        except OSError:
            pass


def _start(key: tuple) -> _Server | None:
    """A server started with the environment `key`, or `None` if it does
    not start."""
    fd, stderr_path = tempfile.mkstemp(prefix="tfmemsafe-server-")
    with os.fdopen(fd, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            env=dict(key),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
    server = _Server(process, stderr_path)
    if _reply(process, _START_TIMEOUT_S) is not None:
        return server
    process.kill()
    process.wait()
    _give_up(key, server, "could not start")
    return None


def _give_up(key: tuple, server: _Server, what: str) -> None:
    """Children of this environment start fresh from now on; says why."""
    with open(server.stderr_path, errors="replace") as f:
        tail = "\n".join(f.read().rstrip().splitlines()[-10:])
    server.close()
    _failed.add(key)
    logging.warning(
        "A process with TensorFlow imported to fork children from (%s=1) "
        "%s; they start afresh. Its stderr ended:\n%s",
        _SWITCH,
        what,
        tail,
    )


def _reply(process: subprocess.Popen, timeout: float | None) -> dict | None:
    """The server's next line, read as JSON; `None` if it ended, wrote
    something else or took longer than `timeout` seconds."""
    if timeout is not None:
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        if not ready:
            return None
    try:
        return json.loads(process.stdout.readline())
    except ValueError:
        return None


_lock = threading.Lock()
_servers: dict[tuple, _Server] = {}
# Environments a server could not start with: their children start fresh.
_failed: set[tuple] = set()


def _key(env: dict) -> tuple:
    """What of `env` a server must be started with."""
    return tuple(
        sorted(
            (name, value)
            for name, value in env.items()
            if name not in _READ_AFTER_IMPORT
            and not name.startswith(("TFMEMSAFE_", "PYTEST_"))
        )
    )


def _server_for(key: tuple) -> _Server | None:
    """The running server for `key`, started if need be; `None` if none
    can start."""
    if key in _failed:
        return None
    server = _servers.pop(key, None)
    if server is not None and server.process.poll() is not None:
        server.close()
        server = None
    if server is None:
        server = _start(key)
        if server is None:
            return None
        if len(_servers) >= _MOST_SERVERS:
            _servers.pop(next(iter(_servers))).close()
    _servers[key] = server  # The most recently used last.
    return server


@atexit.register
def _close_all() -> None:
    with _lock:
        while _servers:
            _servers.popitem()[1].close()
