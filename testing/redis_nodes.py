"""Start and stop real Redis (or Valkey) servers for the L2 tier: one node, or a cluster of
primaries on free loopback ports (for the tests, the benchmark and the multi-host demo).

Nothing here is used by ``glm-cache-server`` itself; operators run their own store. It
exists so that tests exercise a real store over real sockets, and kill real nodes.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from testing.server_process import free_port

SERVER_BINARIES = ("redis-server", "valkey-server")
CLI_BINARIES = ("redis-cli", "valkey-cli")


def store_binaries() -> tuple[str, str] | None:
    """(server, cli) executables of an installed Redis or Valkey, or None."""
    for server, cli in zip(SERVER_BINARIES, CLI_BINARIES):
        s, c = shutil.which(server), shutil.which(cli)
        if s and c:
            return s, c
    return None


def bus_port_free(port: int) -> bool:
    """Whether the cluster bus port of a node on ``port`` (port + 10000) can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port + 10000))
        except OSError:
            return False
    return True


class _PortTaken(RuntimeError):
    """redis-server exited at start-up (another process took the port since it was free)."""


class RedisNodes:
    """``n`` redis-server processes; with ``cluster`` they form one cluster (no replicas:
    each primary owns a third of the slots, so killing one loses its keys, which is what
    the fault tests want). Use as a context manager.

    ``maxmemory_mb`` with ``allkeys-lru`` makes each node a cache, as an operator would
    configure an L2 (never a store that refuses writes when full). Persistence is off.
    """

    def __init__(self, n: int = 3, *, cluster: bool = True, maxmemory_mb: int = 512) -> None:
        binaries = store_binaries()
        if binaries is None:
            raise FileNotFoundError("no redis-server/valkey-server on PATH (scripts/setup.sh installs "
                                    "redis-server with apt where it can)")
        self.server_bin, self.cli_bin = binaries
        self.n, self.cluster, self.maxmemory_mb = n, cluster, maxmemory_mb
        self.dir = Path(tempfile.mkdtemp(prefix="glm-l2-"))
        self.ports = [self._free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n

    def _free_port(self) -> int:
        """A free loopback port; for a cluster node, one whose cluster bus port (10000
        higher, where Redis puts it) exists and is free too: the kernel hands out ephemeral
        ports up to 60999, and Redis refuses a cluster port above 55535 at start-up."""
        while True:
            port = free_port()
            if not self.cluster:
                return port
            if port + 10000 <= 65535 and bus_port_free(port):
                return port

    @property
    def url(self) -> str:
        """The ``--l2`` URL of this store."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+cluster://{hosts}" if self.cluster else f"redis://127.0.0.1:{self.ports[0]}"

    def _start_node(self, i: int) -> None:
        port = self.ports[i]
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        cmd = [self.server_bin, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir),
               "--save", "", "--appendonly", "no", "--maxmemory", f"{self.maxmemory_mb}mb",
               "--maxmemory-policy", "allkeys-lru", "--protected-mode", "no", "--daemonize", "no"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                    "--cluster-node-timeout", "2000"]
        log = open(node_dir / "redis.log", "ab")
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ping(port, self.procs[i])

    def _cli(self, *args: str, timeout_s: float = 30.0) -> str:
        return subprocess.run([self.cli_bin, *args], capture_output=True, text=True, timeout=timeout_s,
                              check=True).stdout

    def _wait_ping(self, port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise _PortTaken(port)
            try:
                if self._cli("-p", str(port), "ping", timeout_s=2).strip() == "PONG":
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer PING in {timeout_s}s")

    def start(self) -> RedisNodes:
        atexit.register(self.stop)
        for i in range(self.n):
            for attempt in range(5):  # free_port() races with other processes on a shared machine
                try:
                    self._start_node(i)
                    break
                except _PortTaken:
                    if attempt == 4:
                        raise RuntimeError(f"redis-server exited at start-up 5 times; see {self.dir}") from None
                    self.ports[i] = self._free_port()
        if self.cluster:
            self._cli("--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", "0",
                      "--cluster-yes")
            deadline = time.monotonic() + 20
            while "cluster_state:ok" not in self._cli("-p", str(self.ports[0]), "cluster", "info"):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        return self

    def kill(self, i: int | None = None) -> None:
        """SIGKILL node ``i`` (every node if None): its keys are gone, its port refuses."""
        for j, proc in enumerate(self.procs):
            if proc is not None and (i is None or i == j) and proc.poll() is None:
                proc.kill()
                proc.wait()

    def restart(self, i: int, timeout_s: float = 30.0) -> None:
        """Start node ``i`` again on its port after :meth:`kill` (empty: persistence is off).
        A cluster node rejoins with its old identity and slots (its ``nodes.conf`` is kept);
        returns once every node reports ``cluster_state:ok``."""
        self._start_node(i)
        if not self.cluster:
            return
        deadline = time.monotonic() + timeout_s
        while not all("cluster_state:ok" in self._cli("-p", str(p), "cluster", "info") for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster not ok {timeout_s:.0f} s after restarting node {i}")
            time.sleep(0.1)

    def stop(self) -> None:
        atexit.unregister(self.stop)
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
