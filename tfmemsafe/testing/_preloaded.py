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
there gets its own server. What is not
as in a fresh process: TensorFlow and Keras are imported before the
target runs (a target that sets their import-time variables itself, or
reads what they print at import, needs a fresh process), and every child
of one server starts from the same Python hash seed.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time

from absl import logging

_SWITCH = "TFMEMSAFE_TESTING_PRELOAD"
# Read when TensorFlow makes its first device or strategy, not at import.
_READ_AFTER_IMPORT = frozenset(
    {"TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB", "TF_CONFIG"}
)
_MOST_SERVERS = 4
_POLL_S = 0.05

# The server. It reads one JSON request per line and answers with the
# forked child's pid; the child's exit code goes into the file the request
# names once the server has reaped it. It ends when its standard input
# closes, that is when the process that started it ends.
_SERVER = r"""
import json, os, signal, sys
import keras, tensorflow

children = {}


def record(pid, status):
    path = children.pop(pid, None)
    if path:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(path + ".tmp", path)


def reap(*_):
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        record(pid, status)


def serve():
    signal.signal(signal.SIGCHLD, reap)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        # A child that ends before it is registered is reaped after.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            return request
        children[pid] = request["returncode_path"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(json.dumps({"pid": pid}), flush=True)
    # Asked to stop: the children still running are waited for.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while children:
        record(*os.waitpid(-1, 0))
    sys.exit(0)


request = serve()
os.setsid()
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
for fd, path, flags in (
    (0, os.devnull, os.O_RDONLY),
    (1, request["stdout_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    (2, request["stderr_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
):
    os.dup2(os.open(path, flags), fd)
sys.argv = ["-c", *request["argv"]]
exec(compile(__bootstrap__, "<string>", "exec"))
"""


def wanted(env: dict) -> bool:
    """Whether a child with this environment is forked from a server."""
    return env.get(_SWITCH, "") == "1"


class ForkedProcess:
    """A child forked by a server, behind the part of `subprocess.Popen`'s
    interface that `tfmemsafe.testing` uses; its output goes to files."""

    def __init__(self, pid: int, directory: str, server):
        self.pid = pid
        self.returncode = None
        self._directory = directory
        self._server = server

    def poll(self):
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

    def communicate(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("forked child", timeout)
            time.sleep(_POLL_S)
        return self._read("stdout"), self._read("stderr")

    def _read(self, name: str) -> str:
        with open(os.path.join(self._directory, name), errors="replace") as f:
            return f.read()


def fork(bootstrap: str, argv: list, env: dict, directory: str):
    """Forks a child running `bootstrap` with `argv` and `env`, from the
    server for `env`; `None` if no server could start (the caller then
    starts a fresh process)."""
    request = {
        "argv": argv,
        "env": env,
        "cwd": os.getcwd(),
        "stdout_path": os.path.join(directory, "stdout"),
        "stderr_path": os.path.join(directory, "stderr"),
        "returncode_path": os.path.join(directory, "returncode"),
    }
    with _lock:
        server = _server_for(env, bootstrap)
        reply = None if server is None else server.ask(request)
    if reply is None:
        logging.warning(
            "No process with TensorFlow imported could fork this child "
            "(%s=1); it starts afresh.",
            _SWITCH,
        )
        return None
    return ForkedProcess(reply["pid"], directory, server.process)


class _Server:
    def __init__(self, env: dict, bootstrap: str):
        source = _SERVER.replace("__bootstrap__", repr(bootstrap))
        self.process = subprocess.Popen(
            [sys.executable, "-c", source],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.ready = self._reply() is not None

    def ask(self, request: dict) -> dict | None:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:
            return None
        return self._reply()

    def close(self) -> None:
        """Asks the server to end once its running children have."""
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def _reply(self) -> dict | None:
        line = self.process.stdout.readline()
        return json.loads(line) if line else None


_lock = threading.Lock()
_servers: dict[tuple, _Server] = {}


def _server_for(env: dict, bootstrap: str) -> _Server | None:
    key = tuple(
        sorted(
            (name, value)
            for name, value in env.items()
            if name not in _READ_AFTER_IMPORT
            and not name.startswith(("TFMEMSAFE_", "PYTEST_"))
        )
    )
    server = _servers.pop(key, None)
    if server is not None and server.process.poll() is not None:
        server = None
    if server is None:
        if len(_servers) >= _MOST_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = _Server(dict(key), bootstrap)
        if not server.ready:
            server.close()
            return None
    _servers[key] = server  # the most recently used last
    return server


@atexit.register
def _close_all() -> None:
    with _lock:
        while _servers:
            _servers.popitem()[1].close()
