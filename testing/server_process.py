"""Start and stop a real glm-cache-server process (for the demo, benchmarks and tests)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from testing.children import popen_tied


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(RuntimeError):
    """The server could not bind a port picked for it."""


class ServerProcess:
    """``glm-cache-server`` as a child process on free loopback ports.

    Use as a context manager; the log is kept in :attr:`log_path` and readable with
    :meth:`log`. With ``auth_token`` the server requires it (written to a 0600 file next to
    the log and passed as ``--auth-token-file``); loopback needs none.
    """

    def __init__(self, *extra_args: str, port: int | None = None, http_port: int | None = None,
                 log_path: str | Path | None = None, auth_token: str | None = None) -> None:
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self._ports_picked = (port is None, http_port is None)  # ours to pick again if taken meanwhile
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="glm-cache-")) / "server.log"
        self.auth_token = auth_token
        if auth_token is not None:
            fd, token_path = tempfile.mkstemp(prefix="token-", dir=self.log_path.parent)  # created 0600
            with os.fdopen(fd, "w") as f:
                f.write(auth_token + "\n")
            self.auth_token_file = Path(token_path)
            self.extra_args += ["--auth-token-file", token_path]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        """Start the server and wait until it answers (generous: a server that exits is seen
        at once; a loaded machine has taken over 30 s to start one, the soak's restart in a
        fresh-clone run beside a busy loop at cad13c3). A port picked by :func:`free_port` can
        be taken before the server binds it (another process's outgoing connection takes
        ephemeral ports from the same range): then new ports are picked, up to three times."""
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except _PortTaken:
                if attempt == 2 or not any(self._ports_picked):
                    raise
                self.proc = None
                self.port = free_port() if self._ports_picked[0] else self.port
                self.http_port = free_port() if self._ports_picked[1] else self.http_port
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> ServerProcess:
        cmd = [sys.executable, "-m", "cache_server.cli", "--port", str(self.port),
               "--http-port", str(self.http_port), *self.extra_args]
        self._log_file = open(self.log_path, "ab")
        self.proc = popen_tied(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        atexit.register(self.stop)  # a notebook kernel or script that dies early leaves no server behind
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                atexit.unregister(self.stop)
                self._log_file.close()
                log = self.log()
                kind = _PortTaken if "Address already in use" in log else RuntimeError
                raise kind(f"glm-cache-server exited with {self.proc.returncode}:\n{log}")
            try:
                with urllib.request.urlopen(self.http_url + "/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"glm-cache-server did not become healthy in {timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return None
        atexit.unregister(self.stop)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log_file.closed:
            self._log_file.close()
        return self.proc.returncode

    def pause(self, timeout_s: float = 60.0) -> None:
        """SIGSTOP, and return once every thread of the server has stopped: the signal is
        asynchronous, and a worker thread already running can answer one more request in
        between (a few ms on busy cores). A paused server is alive but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(_thread_stopped(stat) for stat in Path(f"/proc/{self.proc.pid}/task").glob("*/stat")):
                return
            time.sleep(0.001)
        raise RuntimeError(f"glm-cache-server did not stop within {timeout_s}s of SIGSTOP")

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies without any chance to answer."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pin(self, cpus: set[int]) -> set[int]:
        """Keep every thread of the server on ``cpus`` (threads it starts later inherit it from
        theirs), as an operator keeps it off the engine's model cores (``taskset -a``); the
        CPUs its main thread is then allowed."""
        assert self.proc is not None
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
        return os.sched_getaffinity(self.proc.pid)

    def status(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The server's /status document. The timeout is generous: on a 2-core machine
        running an engine beside it, a reply has been seen to take over 10 s to arrive."""
        headers = {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else {}
        req = urllib.request.Request(self.http_url + "/status", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> ServerProcess:
        # ``with ServerProcess(...).start() as s`` must not start a second process on the
        # same ports: the first would answer the health check and be left running.
        if self.proc is not None and self.proc.poll() is None:
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _thread_stopped(stat: Path) -> bool:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return True  # the thread is gone
