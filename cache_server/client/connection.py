"""The connection under :class:`~cache_server.client.CacheClient`: one ZeroMQ DEALER
socket to a glm-cache-server, its handshake (the token at connection, the mechanism the
server speaks), one deadline per call that every request of the call ends by, and the
requests that timed out: kept pending for their late replies (counted, a lease they carry
handed back), or the socket closed and reopened where shared memory is in use.

What each request is, and the shared-memory segments, are the client's other modules
(:mod:`cache_server.client.operations`, :mod:`cache_server.client.segments`)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self

import zmq

from cache_server import protocol as p
from cache_server.auth import AUTH_FIELD, PLAIN_USERNAME
from cache_server.client.errors import CacheServerError, CacheServerUnavailable
from cache_server.client.segments import MIB, ClientShm
from cache_server.shm import ClientSegment

Payload = bytes | bytearray | memoryview

# A request that timed out stays pending this long (or until the socket is closed) for its
# late reply; then it counts as never answered.
PENDING_HORIZON_S = 60.0
MAX_PENDING = 1024  # pending requests kept; the oldest past this counts as never answered
# The outcomes :attr:`CacheClient.outcomes` counts per op: requests sent, answered within
# their deadline (error replies included), answered after it (the reply came on the kept
# socket after the call gave up), never answered (no reply by the horizon, or the socket
# was closed first).
OUTCOMES = ("sent", "in_time", "late", "unanswered")


# After a connection that had been up dropped, a request waits this long (at most its own
# deadline) for ZeroMQ to connect again (it tries every 100 ms) before it gives up: a server
# that restarts is back within it, and one that died costs each request this, not its deadline.
RECONNECT_WAIT_S = 1.0

# Handshakes that failed without a reason after which a client without a token takes the
# server for one that wants a token: on a mechanism mismatch the side that sees it first
# closes, and the other often learns no reason (libzmq retries every 100 ms).
HANDSHAKES_FAILED = 3


class Connection:
    """One DEALER connection to a glm-cache-server; thread-safe (requests are serialised).
    :class:`~cache_server.client.CacheClient` is this plus the operations, and says what
    the arguments mean."""

    def __init__(self, url: str = "tcp://127.0.0.1:5555", timeout_s: float = 5.0,
                 context: zmq.Context | None = None, auth_token: str | None = None, *,
                 shm: bool = True, shm_bytes: int = 64 * MIB, shm_max_bytes: int = 1024 * MIB) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._shm = ClientShm(url, shm, shm_bytes, shm_max_bytes)
        self.url = url
        self.timeout_s = timeout_s
        self._auth_token = auth_token
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # the handshake and disconnection events of _sock
        self._replies = zmq.Poller()  # _sock and _monitor, for a request's wait
        self._handshake_outcome: str | None = None  # the last one the monitor reported, not yet asked for
        self._plain = auth_token is not None  # present the token at connection (flipped by a NULL server)
        self.corrupt_objects = 0  # payloads that failed their checksum (deleted on the server)
        self._unpins: list[int] = []  # read pins handed back, sent with the next get (or unpin())
        # One deadline per call (:meth:`_within`): every request and wait of the call ends by it.
        self._call_deadline: float | None = None
        # (op, outcome) -> count, outcome one of OUTCOMES; read with :meth:`counts`
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        # requests that timed out on a socket kept open: id -> (op, monotonic time they gave up)
        self._pending: dict[int, tuple[str, float]] = {}
        self._late_leases: list[int] = []  # leases that came in late replies: the caller releases them
        self.disconnects = 0  # times the connection to the server dropped (the socket monitor's count)
        self._up = False  # a handshake succeeded since the last drop (the monitor's events)
        self._dropped = False  # a connection that had been up dropped, and none is up since

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if "[" in self.url:  # an IPv6 literal, tcp://[::1]:port (a hostname keeps IPv4:
                sock.setsockopt(zmq.IPV6, 1)  # with IPv6 on, localhost could resolve to ::1)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # don't queue for a peer that is not connected
            if self._plain and self._auth_token is not None:
                sock.plain_username = PLAIN_USERNAME
                sock.plain_password = self._auth_token.encode("utf-8")
            self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                                    | zmq.EVENT_DISCONNECTED)
            self._handshake_outcome = None
            self._replies = zmq.Poller()  # a reply, or an event (a dropped connection) of the monitor
            self._replies.register(sock, zmq.POLLIN)
            self._replies.register(self._monitor, zmq.POLLIN)
            sock.connect(self.url)
            self._sock = sock
        return self._sock

    def _handshake_refusal_locked(self) -> str | None:
        """The last handshake outcome the monitor reported since the previous call: ``auth``
        (the server refused our token), ``mechanism`` (it wants PLAIN and we have no
        token, or it speaks NULL and we offered PLAIN), ``closed`` (the handshake ended
        without a reason: on a mechanism mismatch the side that sees it first closes, and
        the other often gets only this), or None (succeeded, or nothing happened)."""
        self._monitor_events_locked()
        outcome, self._handshake_outcome = self._handshake_outcome, None
        return outcome

    def _monitor_events_locked(self) -> None:
        """Read the socket's events so far: handshake outcomes (for
        :meth:`_handshake_refusal_locked`), and disconnections, after which the requests
        still pending can never be answered (ZeroMQ does not resend them): they count as
        unanswered."""
        from zmq.utils.monitor import parse_monitor_message

        while self._monitor is not None:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.disconnects += 1
                self._dropped, self._up = self._dropped or self._up, False
                self._settle_pending_locked(float("inf"))
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_outcome = None
                self._up, self._dropped = True, False
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._handshake_outcome = "auth"
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
                    and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self._handshake_outcome = "mechanism"
            elif event["event"] in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self._handshake_outcome = "closed"

    def _writable_socket_locked(self, timeout: float) -> zmq.Socket:
        """The socket once its handshake with the server is done (it can send), within
        ``timeout``. A refused handshake raises ``unauthorized``; a failed one makes a
        client with a token reconnect with the other mechanism (a NULL server: without
        PLAIN; and back, should it restart with a token), which converges on the one that
        works; a client without a token gives up when the server said it wants another
        mechanism, or after :data:`HANDSHAKES_FAILED` handshakes failed without a reason (a
        server that is down fails the connection, not the handshake). After a connection
        that had been up dropped, it waits at most :data:`RECONNECT_WAIT_S` for the next."""
        dropped = self._dropped
        if dropped:
            timeout = min(timeout, RECONNECT_WAIT_S)
        deadline = time.monotonic() + timeout
        closed = 0
        while True:
            sock = self._socket()
            if sock.poll(0, zmq.POLLOUT):
                return sock
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLOUT)
            poller.register(self._monitor, zmq.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CacheServerUnavailable(f"glm-cache-server at {self.url} is not reachable "
                                                 f"(no connection within {timeout:.1f}s"
                                                 + (" since the last one dropped)" if dropped else ")"))
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if sock in ready:
                    return sock
                refusal = self._handshake_refusal_locked() if self._monitor in ready else None
                closed += refusal == "closed"
                if refusal in ("auth", "mechanism") or (refusal == "closed" and (
                        self._auth_token is not None or closed >= HANDSHAKES_FAILED)):
                    break
            self._reset()
            if refusal == "auth":
                raise CacheServerError(p.ErrorCode.UNAUTHORIZED.value,
                                       f"glm-cache-server at {self.url} refused this client's token at connection")
            if self._auth_token is None:
                raise CacheServerError(p.ErrorCode.UNAUTHORIZED.value,
                                       f"glm-cache-server at {self.url} wants a token at connection "
                                       "(--auth-token-file) and this client has none"
                                       + ("" if refusal == "mechanism" else
                                          f", or something in front of it (a proxy, a load balancer) closed the "
                                          f"connection during the handshake {closed} times, or its accept gate "
                                          "did (too many handshakes under way from this address: "
                                          "glm_cache_refused_connections_total{reason=\"pending_cap\"})"))
            self._plain = not self._plain

    @property
    def transport(self) -> str:
        """``"shm"`` once the server agreed to shared memory, else ``"tcp"``."""
        return "shm" if self._shm.agreed else "tcp"

    @property
    def reads_in_place(self) -> bool:
        """Whether this client has the server's arena mapped (:meth:`get_in_place` then
        answers arena objects as views of it, copying nothing)."""
        return self._shm.arena is not None

    @property
    def shm_refusal(self) -> str | None:
        """Why payloads do not go through shared memory (None: they do, or not yet asked)."""
        return self._shm.refusal

    @property
    def _segments(self) -> list[ClientSegment]:
        """The attached segments, newest last."""
        return self._shm.segments

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._shm.detach_all(self._send_header_locked, min(self.timeout_s, 0.25))
            self._reset()
            self._shm.agreed = False

    def _reset(self) -> None:
        self._forget_pending_locked(float("inf"))  # their replies can no longer arrive
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        # After a timeout the server may still be writing into our segments: never reuse them
        # (they are detached at the next request that reaches the server).
        self._shm.drop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, header: dict[str, Any], payloads: Sequence[Payload] = (),
                timeout_s: float | None = None) -> tuple[dict[str, Any], list[memoryview]]:
        """Send one request and wait for its reply; raises on error replies and timeouts.
        ``timeout_s`` overrides :attr:`timeout_s` for this request."""
        with self._lock, self._within(timeout_s):
            return self._request_locked(header, payloads, None)

    @contextlib.contextmanager
    def _within(self, timeout_s: float | None) -> Iterator[None]:
        """One deadline for the whole call (lock held): its requests (a segment's attach
        and the request itself, a retry through frames) and their waits all end by it."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        outer = self._call_deadline
        if outer is None:
            self._call_deadline = time.monotonic() + timeout
        try:
            yield
        finally:
            self._call_deadline = outer

    def counts(self, op: str) -> dict[str, int]:
        """How ``op``'s requests ended on this client: ``sent``, ``in_time``, ``late``,
        ``unanswered`` (:data:`OUTCOMES`); those still pending are in none but ``sent``
        (they count as unanswered once the connection drops, or at the horizon). Never
        waits for a request in flight (then those are counted at the next call)."""
        if self._lock.acquire(blocking=False):
            try:
                self._settle_pending_locked(time.monotonic() - PENDING_HORIZON_S)
                if self._pending:
                    self._monitor_events_locked()
            finally:
                self._lock.release()
        return {o: self.outcomes[op, o] for o in OUTCOMES}

    def take_late_leases(self) -> list[int]:
        """Leases granted in replies that came after their lookup gave up: the caller
        releases them (through this client: a lease is its connection's)."""
        with self._lock:
            out, self._late_leases = self._late_leases, []
            return out

    def _settle_pending_locked(self, before: float) -> None:
        """Take the late replies already received, then count as unanswered the requests
        still pending since before ``before``. In that order: a reply that came while nobody
        read the socket (no request for minutes: a CPU stood still) was answered, late (the
        soak at f1f6f95 counted one such lookup lost: its reply came 31 s after it gave up,
        and the next request, 120 s after, forgot it before reading the reply)."""
        self._drain_late_locked()
        self._forget_pending_locked(before)

    def _forget_pending_locked(self, before: float) -> None:
        """Requests pending since before ``before`` will not be answered: count them."""
        for request_id, (op, since) in list(self._pending.items()):
            if since < before:
                del self._pending[request_id]
                self.outcomes[op, "unanswered"] += 1

    def _late_reply_locked(self, reply: dict[str, Any]) -> None:
        """A reply to a request that had timed out (dropped otherwise): count it, and keep
        a lease it granted for :meth:`take_late_leases`."""
        pending = self._pending.pop(reply.get("id"), None) if isinstance(reply.get("id"), int) else None
        if pending is None:
            return
        self.outcomes[pending[0], "late"] += 1
        lease_id = reply.get("lease_id")
        if reply.get("ok") and type(lease_id) is int and lease_id > 0:
            self._late_leases.append(lease_id)

    def _drain_late_locked(self) -> None:
        """Take the late replies already on the socket (before a new request is sent)."""
        while self._sock is not None and self._pending:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._late_reply_locked(p.unpack_header(frames[0].buffer))

    def _request_locked(self, header: dict[str, Any], payloads: Sequence[Payload],
                        timeout_s: float | None) -> tuple[dict[str, Any], list[memoryview]]:
        """One request within the call's deadline (or, outside :meth:`_within`, within
        ``timeout_s``). The header says when it was sent (wall clock) and how long its
        sender waits (``sent``, ``budget``), so the server can count a late answer and skip
        work nobody waits for. A request that times out on a client without shared memory
        keeps its socket: its late reply is counted (and a lease it carries handed to
        :meth:`take_late_leases`) when it comes; on a client with shared memory the socket
        is closed, as the server may still write into its segments."""
        now, wall = time.monotonic(), time.time()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if self._call_deadline is None and not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        deadline = self._call_deadline if self._call_deadline is not None else now + timeout
        budget = deadline - now
        if budget <= 0:
            raise CacheServerUnavailable(f"glm-cache-server at {self.url}: no time left for {header.get('op')!r} "
                                         "(the call's deadline passed)")
        request_id = next(self._ids)
        op = str(header.get("op"))
        # the server refuses a budget outside (0, MAX_BUDGET_S]: a longer wait is said as the most it takes
        header = {**header, "id": request_id, "sent": wall, "budget": min(p.MAX_BUDGET_S, max(0.001, round(budget, 3)))}
        if self._auth_token is not None:
            header[AUTH_FIELD] = self._auth_token
        sent = dropped = False
        try:
            self._settle_pending_locked(now - PENDING_HORIZON_S)
            self._monitor_events_locked()
            # With IMMEDIATE set, a send finds no peer while the server is down (or the
            # handshake is not done): wait for writability so that case also ends at the deadline.
            sock = self._writable_socket_locked(budget)
            sock.send_multipart([p.pack_header(header), *payloads], copy=False, flags=zmq.NOBLOCK)
            sent = True
            self.outcomes[op, "sent"] += 1
            drops = self.disconnects
            while True:
                left = deadline - time.monotonic()
                ready = dict(self._replies.poll(max(1, int(left * 1000)))) if left > 0 else {}
                if sock not in ready:
                    self._monitor_events_locked()
                    # ZeroMQ does not resend what was in flight on a connection that dropped:
                    # no answer can come, so the call ends now, not at its deadline
                    dropped = self.disconnects > drops
                    if not dropped and time.monotonic() < deadline:
                        continue
                    raise CacheServerUnavailable(
                        f"glm-cache-server at {self.url} did not answer {op!r} (request {request_id}) within "
                        f"{budget:.1f}s (" + (f"the connection dropped {time.monotonic() - now:.1f}s after it was sent"
                                              if dropped else "connected throughout") + ")")
                frames = sock.recv_multipart(copy=False)
                reply = p.unpack_header(frames[0].buffer)
                if reply.get("id") == request_id:
                    break
                self._late_reply_locked(reply)  # a reply to an earlier request that timed out
        except CacheServerUnavailable:
            if dropped:
                self.outcomes[op, "unanswered"] += 1  # ZeroMQ reconnects by itself
                if self._shm.agreed or self._shm.segments:
                    self._reset()
            elif sent and not self._shm.agreed and not self._shm.segments:
                self._pending[request_id] = (op, time.monotonic())  # its reply may still come
                while len(self._pending) > MAX_PENDING:
                    oldest = next(iter(self._pending))
                    self.outcomes[self._pending.pop(oldest)[0], "unanswered"] += 1
            else:
                self._reset()
            raise
        except zmq.ZMQError as e:
            self._reset()
            raise CacheServerUnavailable(f"glm-cache-server at {self.url}: {e}") from e
        self.outcomes[op, "in_time"] += 1
        if not reply.get("ok"):
            raise CacheServerError(str(reply.get("code")), str(reply.get("message")))
        return reply, [f.buffer for f in frames[1:]]

    def _send_header_locked(self, header: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        """The reply header to a request without payloads (what the segments' requests are)."""
        return self._request_locked(header, (), timeout_s)[0]
