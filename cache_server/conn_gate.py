"""The server's connections, bounded before they cost anything.

libzmq accepts every TCP connection on the ROUTER's port and keeps each until its handshake
completes or ``ZMQ_HANDSHAKE_IVL`` passes (30 s by default), and it has no cap on
connections per peer or in all: a peer that opens connections and never sends a greeting
held every descriptor of the server (300 of them under ``RLIMIT_NOFILE`` 256: engines'
requests failed, and libzmq's I/O thread spun on the failing ``accept``). So:

* **A handshake window.** ``ZMQ_HANDSHAKE_IVL`` is :data:`HANDSHAKE_S`: a connection that
  has not completed its handshake by then (with ``--auth-token-file``, presented the token)
  is closed by libzmq. It stays libzmq's 30 s: with 5 s, a vLLM worker on a loaded 2-core
  machine (its OpenMP threads and a busy loop beside it) went 60 s without completing a
  connection and failed a load (fresh-clone CI at ``bb27406``, MultiConnector module); the
  caps below, not the window, are what bound a flood.
* **A greeting deadline.** A connection whose peer has not sent a whole ZMTP greeting
  (:data:`GREETING_BYTES`) :data:`SILENT_S` after it was accepted is shut by the gate and
  counted (``reason="silent"``), whatever the caps: the greeting is 64 bytes that a peer's
  I/O thread sends as soon as TCP connects, before its application does anything, so 10 s
  of silence is no engine (and a client shut by mistake reconnects, as ZeroMQ does). The
  rest of the handshake keeps libzmq's window.
* **An accept gate.** A monitor of the ROUTER reports each accepted connection with its
  descriptor; the gate looks at it (a duplicate of the descriptor, closed at once: the
  socket must be a TCP connection to the server's port, and its peer's address is read)
  and counts it as *pending* while it is younger than :data:`SILENT_S` and its peer has
  sent less than a ZMTP greeting (:data:`GREETING_BYTES`, read from ``TCP_INFO``): a peer
  that speaks leaves the count within milliseconds, one that never does stays until the
  greeting deadline shuts it. Past the caps (a pending connection per :data:`PER_PEER_SHARE`-th of
  the open-descriptor limit for one address, per :data:`TOTAL_SHARE`-th in all, at least
  :data:`MIN_PENDING_PER_PEER` and :data:`MIN_PENDING`), the *oldest* silent connections
  past :data:`GRACE_S` are shut down (``shutdown(2)`` on the duplicate: libzmq sees the peer
  leave and closes its own descriptor), counted
  (``glm_cache_refused_connections_total{reason="pending_cap"}``). Engines already
  connected are never touched, and a new one, which greets within its grace, is never
  counted as silent: it gets through during a flood from its own address too.
* **Descriptors.** The server raises its soft ``RLIMIT_NOFILE`` to the hard limit at start
  (:func:`raise_nofile_limit`).

The gate also reports handshakes that failed on the mechanism to ``on_handshake_failed``
(a peer without the token, for :class:`cache_server.token_gate.TokenGate`): libzmq allows
one monitor per socket, and this is it.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

logger = logging.getLogger("glm_cache_server")

HANDSHAKE_S = 30.0
GREETING_BYTES = 64  # ZMTP 3's greeting: a peer that sent this much is speaking the protocol
GRACE_S = 1.0  # a new connection's time to greet before the caps may shut it
SILENT_S = 10.0  # a connection's time to greet at all
PER_PEER_SHARE = 8  # one address's pending connections: at most the descriptor limit / 8
TOTAL_SHARE = 2  # everyone's: at most half of it
MIN_PENDING_PER_PEER = 32
MIN_PENDING = 128
_UNLIMITED = 1 << 20  # what an unlimited RLIMIT_NOFILE counts as
_TCP_INFO_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received (u64) in struct tcp_info (Linux 4.1+)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def raise_nofile_limit() -> int:
    """Raise the soft limit on open descriptors to the hard one (2**20 if that is unlimited);
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _UNLIMITED
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            pass
    return soft


def _peer_of(fd: int, port: int) -> tuple[str, int] | None:
    """The peer (address, port) of the accepted connection behind ``fd`` (a duplicate is
    looked at), None when ``fd`` is no longer a TCP connection to ``port``."""
    try:
        with _look(fd) as s:
            if s.type != socket.SOCK_STREAM or s.getsockname()[1] != port:
                return None
            name = s.getpeername()
            return str(name[0]), int(name[1])
    except OSError:
        return None


def _bytes_received(fd: int) -> int | None:
    """What the peer of ``fd`` has sent so far (``TCP_INFO``), None if unknown."""
    try:
        with _look(fd) as s:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
        return None
    return int.from_bytes(info[_TCP_INFO_BYTES_RECEIVED:_TCP_INFO_BYTES_RECEIVED + 8], sys.byteorder)


def _look(fd: int) -> socket.socket:
    """A socket object over a duplicate of ``fd`` (closing it leaves libzmq's descriptor)."""
    return socket.socket(fileno=os.dup(fd))


def pending_caps() -> tuple[int, int]:
    """``(per address, in all)``: pending connections the gate lets in, from the open-
    descriptor limit in force now."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = _UNLIMITED if soft == resource.RLIM_INFINITY else soft
    return max(MIN_PENDING_PER_PEER, soft // PER_PEER_SHARE), max(MIN_PENDING, soft // TOTAL_SHARE)


def _shut(fd: int) -> None:
    """End the connection behind ``fd`` without closing libzmq's descriptor."""
    try:
        with _look(fd) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RefusalLog:
    """The gate's ``on_refused``: a connection of ``peer`` it shut (``reason``: over the
    pending-handshake caps, or silent past the greeting deadline) is counted in ``counter``
    (a metric labelled by reason), and logged at most once a minute with the addresses."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._since_log: dict[str, int] = {}
        self._logged_at = -float("inf")

    def __call__(self, peer: str, reason: str) -> None:
        self._counter.labels(reason=reason).inc()
        self._since_log[peer] = self._since_log.get(peer, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= 60.0:
            counts, self._since_log, self._logged_at = self._since_log, {}, now
            logger.warning("shut %d connection(s) that sent no greeting: over the caps on handshakes under way "
                           "(%d per address, %d in all) or silent for %.0f s: %s", sum(counts.values()),
                           *pending_caps(), SILENT_S, ", ".join(f"{a} x{n}" for a, n in sorted(counts.items())[:10]))


class ConnectionGate:
    """The accept gate of one ROUTER socket (the module docstring says what it does).
    :meth:`watch` it after it is bound; :meth:`close` before the context terminates."""

    def __init__(self, ctx: zmq.Context[Any], on_refused: Callable[[str, str], None],
                 on_handshake_failed: Callable[[], None] | None = None) -> None:
        self._ctx = ctx
        self._on_refused = on_refused
        self.on_handshake_failed = on_handshake_failed
        # (accepted at, fd, peer address, peer port), oldest first
        self._pending: deque[tuple[float, int, str, int]] = deque()
        self._by_peer: Counter[str] = Counter()
        self._monitor: Any = None
        self._port = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glm-accept-gate", daemon=True)

    @staticmethod
    def configure(sock: zmq.Socket[Any]) -> None:
        """Before ``sock`` binds: its handshake window."""
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))

    def watch(self, sock: zmq.Socket[Any], port: int) -> None:
        where = f"inproc://glm-accept-gate-{id(self)}"
        sock.monitor(where, _EVENTS)
        self._monitor = self._ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(where)
        self._port = port
        self._thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while not self._stop.is_set():
            try:
                if not self._monitor.poll(100):
                    self._age(time.monotonic())
                    continue
                event = parse_monitor_message(self._monitor.recv_multipart())
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                raise
            kind, fd = event["event"], event["value"]
            now = time.monotonic()
            self._age(now)
            if kind == zmq.EVENT_ACCEPTED:
                self._admit(now, fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._disconnected(fd)
            elif self.on_handshake_failed is not None:
                self.on_handshake_failed()

    def _age(self, now: float) -> None:
        """Connections past the greeting deadline leave the count: shut if their peer is
        still silent; then the caps are enforced again (a newcomer's grace may have ended)."""
        while self._pending and now - self._pending[0][0] > SILENT_S:
            _, fd, peer, _ = self._pending.popleft()
            self._drop_peer(peer)
            if (_bytes_received(fd) or 0) < GREETING_BYTES and _peer_of(fd, self._port) is not None:
                self._on_refused(peer, "silent")  # counted before the peer can see the close
                _shut(fd)
        if self._over_cap():
            self._enforce(now)

    def _admit(self, now: float, fd: int) -> None:
        peer = _peer_of(fd, self._port)
        if peer is None:
            return
        self._forget(fd)  # a descriptor number reused: its old connection is gone, whatever its event says
        self._pending.append((now, fd, *peer))
        self._by_peer[peer[0]] += 1
        if self._over_cap():
            self._enforce(now)

    def _over_cap(self) -> bool:
        per_peer, total = pending_caps()
        return len(self._pending) > total or any(n > per_peer for n in self._by_peer.values())

    def _enforce(self, now: float) -> None:
        """Over a cap: forget the pending connections whose peers have greeted, then shut the
        oldest silent ones past their grace (:data:`GRACE_S`) of the address over its cap
        (or of anyone, over the total) until within the caps. A newcomer is never judged
        before its grace: an engine greets within it and so outlives a flood's silent
        connections, which are older and go first."""
        self._spoken()
        per_peer, total = pending_caps()
        while True:
            over = [peer for peer, n in self._by_peer.items() if n > per_peer]
            if not over and len(self._pending) <= total:
                return
            victim = next((e for e in self._pending if now - e[0] >= GRACE_S and (not over or e[2] in over)), None)
            if victim is None:
                return  # only newcomers in their grace: judged at the next tick
            self._pending.remove(victim)
            self._drop_peer(victim[2])
            self._on_refused(victim[2], "pending_cap")  # counted before the peer can see the close
            _shut(victim[1])

    def _spoken(self) -> None:
        """No longer count the pending connections whose peer has sent a greeting."""
        for entry in [e for e in self._pending if (_bytes_received(e[1]) or 0) >= GREETING_BYTES]:
            self._pending.remove(entry)
            self._drop_peer(entry[2])

    def _disconnected(self, fd: int) -> None:
        """libzmq closed the connection on ``fd``, unless that number already belongs to a
        newer connection (its event came after the number was reused): then it stays."""
        now = _peer_of(fd, self._port)
        if now is None or not any(e[1] == fd and (e[2], e[3]) == now for e in self._pending):
            self._forget(fd)

    def _forget(self, fd: int) -> None:
        for i, (_, f, peer, _port) in enumerate(self._pending):
            if f == fd:
                del self._pending[i]
                self._drop_peer(peer)
                return

    def _drop_peer(self, peer: str) -> None:
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if self._monitor is not None:
            self._monitor.close(linger=0)
