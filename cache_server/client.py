"""Client of glm-cache-server, with timeouts: a dead or absent server raises within the
timeout, never hangs the caller.

On the server's host, payloads move through shared memory (:mod:`cache_server.shm`):
offered at ``hello``, used by ``get`` and ``put`` once the server agrees, frames over the
socket otherwise (another host, no /dev/shm, ``--no-shm``, or ``shm=False`` here)."""

from __future__ import annotations

import array
import collections
import contextlib
import hashlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from cache_server import protocol as p
from cache_server.arena import DEFAULT_PIN_S, MAX_UNPIN, pack_pins
from cache_server.arena import HEAD_BYTES as ARENA_HEAD
from cache_server.auth import AUTH_FIELD, PLAIN_USERNAME

# The errors are part of this module's API too: callers import them from here.
from cache_server.client_errors import CacheServerError, CacheServerUnavailable
from cache_server.client_shm import MIB, ClientShm, get_region, write_payloads
from cache_server.shm import ClientSegment, align_up

_U32 = next(t for t in ("I", "L") if array.array(t).itemsize == 4)

Payload = bytes | bytearray | memoryview
# Where a get's payload is (CacheClient._get_locked): copied to us (verified on arrival), a view
# of the server's arena the reader verifies as it copies, or one the server verified when it
# placed it there (the arena's bytes cannot change under a read pin: the reader copies it as is).
BY_COPY, IN_ARENA, IN_ARENA_CHECKED = 0, 1, 2
PIN_MARGIN_S = 1.0  # a copy under a read pin must end this long (or a tenth of the pin) before it ends


@dataclass
class InPlace:
    """What :meth:`CacheClient.get_in_place` answers: per key, its payload (None: absent,
    or it failed its checksum here), and for a view of the server's arena the key prefix
    and stored checksum the caller must verify it against (:func:`~cache_server.protocol.checksum`
    is XXH3-128 over the prefix, then the payload); the monotonic time by which those copies
    must be done, and the read pin to hand back."""

    payloads: list[memoryview | None]
    unverified: list[tuple[bytes, bytes] | None]
    deadline: float
    pin: int | None

logger = logging.getLogger("vllm.glm_cache_client")


# A request that timed out stays pending this long (or until the socket is closed) for its
# late reply; then it counts as never answered.
PENDING_HORIZON_S = 60.0
MAX_PENDING = 1024  # pending requests kept; the oldest past this counts as never answered
# The outcomes :attr:`CacheClient.outcomes` counts per op: requests sent, answered within
# their deadline (error replies included), answered after it (the reply came on the kept
# socket after the call gave up), never answered (no reply by the horizon, or the socket
# was closed first).
OUTCOMES = ("sent", "in_time", "late", "unanswered")


# Handshakes that failed without a reason after which a client without a token takes the
# server for one that wants a token: on a mechanism mismatch the side that sees it first
# closes, and the other often learns no reason (libzmq retries every 100 ms).
HANDSHAKES_FAILED = 3


def label_salt(salt: str) -> str:
    """A request's cache salt as sent for the lookup counters' label: itself when it is
    short and plain UTF-8, else its SHA-256 in hex (a client's salt never makes the
    lookup itself fail; distinct salts keep distinct labels)."""
    if isinstance(salt, str) and len(salt) <= p.MAX_NAMESPACE_CHARS:
        try:
            salt.encode("utf-8")
            return salt
        except UnicodeEncodeError:
            pass
    return "sha256:" + hashlib.sha256(str(salt).encode("utf-8", "surrogatepass")).hexdigest()


class CacheClient:
    """One DEALER connection to a glm-cache-server; thread-safe (requests are serialised).

    After a timeout the socket is closed and reopened, so a late reply can never be taken
    for the answer to a later request, and nothing queued for a dead server piles up.

    ``auth_token`` is the server's shared secret (``--auth-token-file``), presented at
    connection (ZMQ's PLAIN mechanism, which such a server requires) and sent with every
    request (the server checks both). A server that refuses it at connection, or that
    wants a token from a client without one, makes the call raise
    :class:`CacheServerError` ``unauthorized`` at once. A server without a token speaks
    only ZMQ's NULL mechanism: a client with a token then connects without PLAIN (the
    token still travels in each header, which such a server ignores).

    ``shm`` (default on) offers the server shared memory at :meth:`hello` (or at the first
    ``get`` or ``put`` of a client that never says hello): segments of at
    least ``shm_bytes``, together at most ``shm_max_bytes``: sealed memfds, which the
    server maps (no one can shrink them under it). :attr:`transport` says what was agreed
    (``"shm"`` or ``"tcp"``), :attr:`shm_refusal` why not. A payload ``get`` returns from
    shared memory is a view of a segment that no later request writes into while any view
    of that get is alive (the client uses another segment, or frames); checksums are
    verified exactly as over TCP. The segments are :mod:`cache_server.client_shm`'s. A
    client that moves no payload (lookups only) should say ``shm=False``: its hello would
    offer a segment it never uses.
    """

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
                self._forget_pending_locked(float("inf"))
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_outcome = None
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
        server that is down fails the connection, not the handshake)."""
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
                                                 f"(no connection within {timeout:.1f}s)")
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

    def __enter__(self) -> CacheClient:
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
                self._forget_pending_locked(time.monotonic() - PENDING_HORIZON_S)
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
        sent = False
        try:
            self._forget_pending_locked(now - PENDING_HORIZON_S)
            self._drain_late_locked()
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
                if left <= 0 or not sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    self._monitor_events_locked()
                    raise CacheServerUnavailable(
                        f"glm-cache-server at {self.url} did not answer {op!r} (request {request_id}) within "
                        f"{budget:.1f}s (" + ("the connection dropped meanwhile" if self.disconnects > drops else
                                              "connected throughout") + ")")
                frames = sock.recv_multipart(copy=False)
                reply = p.unpack_header(frames[0].buffer)
                if reply.get("id") == request_id:
                    break
                self._late_reply_locked(reply)  # a reply to an earlier request that timed out
        except CacheServerUnavailable:
            if sent and not self._shm.agreed and not self._shm.segments:
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

    def _place_shm_locked(self, seg: ClientSegment, reply: dict[str, Any],
                          frames: list[memoryview]) -> list[memoryview]:
        """The payloads of a get answered through ``seg`` (:meth:`ClientShm.place`); a method
        of the client so that a test can corrupt the segment between placement and checksum."""
        return self._shm.place(seg, reply, frames)

    # --- operations ----------------------------------------------------------------------

    def hello(self, namespace: str, alignment: int, world_size: int = 1,
              replicated_groups: Sequence[int] = (), attn_groups: Sequence[int] | None = None,
              state_groups: Sequence[int] | None = None,
              group_names: dict[int, str] | None = None,
              chunk_keys: dict[str, Any] | None = None) -> dict[str, Any]:
        """Handshake: returns chunk_size, min_chunk_size, separate_object_groups, max_object_bytes, v.
        With ``attn_groups`` and ``state_groups`` the server tracks which prefixes are
        resumable and evicts objects nothing can resume through first; ``group_names``
        says what each holds (``/status`` and metrics report bytes by name); ``chunk_keys``
        how the engine names chunks ({``scheme``, ``span``, ``lookahead``}), for routers'
        queries (:mod:`cache_server.prefix_query`)."""
        header: dict[str, Any] = {"op": "hello", "v": p.PROTOCOL_VERSION, "ns": namespace, "alignment": alignment,
                                  "world_size": world_size, "replicated_groups": list(replicated_groups)}
        if state_groups is not None:
            header["attn_groups"] = list(attn_groups or ())
            header["state_groups"] = list(state_groups)
            if group_names:
                header["group_names"] = {str(g): n for g, n in group_names.items()}
        if chunk_keys is not None:
            header["chunk_keys"] = dict(chunk_keys)
        with self._lock, self._within(None):
            self._shm.flush(self._send_header_locked, None)
            offer = self._shm.offer_at_hello()
            if offer is not None:
                header["shm"] = self._shm.describe(offer)
            try:
                reply, _ = self._request_locked(header, (), None)
            except CacheServerError:  # answered: nothing was attached
                if offer is not None:
                    offer.close()
                raise
            except BaseException:  # no answer in time: the server may have attached it
                if offer is not None:
                    self._shm.abandon(offer)
                raise
            if offer is not None:
                self._shm.settle(offer, reply.get("shm"))
        return {k: reply[k] for k in ("v", "chunk_size", "min_chunk_size", "separate_object_groups",
                                      "max_object_bytes")}

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
               lease: bool = True, replicated_groups: Sequence[int] = (),
               cache_salt: str | None = None, timeout_s: float | None = None) -> tuple[int, int | None]:
        """Deepest resumable chunk count of the prefix ``hashes`` and the lease on it;
        ``replicated_groups`` need their rank-0 copy only. ``cache_salt`` (the request's,
        already in the hashes) only labels the lookup counters (as a keyed hash)."""
        reply = self._lookup(namespace, hashes, attn_groups, state_groups, world_size, start_chunk,
                             lease, replicated_groups, held=False, cache_salt=cache_salt, timeout_s=timeout_s)
        return reply["chunks"], reply["lease_id"]

    def lookup_held(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                    state_groups: Sequence[int], world_size: int = 1, start_chunk: int = 0,
                    lease: bool = True, replicated_groups: Sequence[int] = (),
                    cache_salt: str | None = None,
                    timeout_s: float | None = None) -> tuple[int, int | None, int | None, bool]:
        """:meth:`lookup`, plus what need not be sent again: how many chunks from chunk 0
        the server holds all attention objects of (every group and rank; None from a
        server that does not report it), and whether it holds every state object at
        chunk ``start_chunk - 1``."""
        reply = self._lookup(namespace, hashes, attn_groups, state_groups, world_size, start_chunk,
                             lease, replicated_groups, held=True, cache_salt=cache_salt, timeout_s=timeout_s)
        held = reply.get("held")
        return (reply["chunks"], reply["lease_id"], held if isinstance(held, int) else None,
                reply.get("start_state") is True)

    def _lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                state_groups: Sequence[int], world_size: int, start_chunk: int, lease: bool,
                replicated_groups: Sequence[int], held: bool, cache_salt: str | None = None,
                timeout_s: float | None = None) -> dict[str, Any]:
        header = {"op": "lookup", "ns": namespace, "hashes": list(hashes), "attn_groups": list(attn_groups),
                  "state_groups": list(state_groups), "world_size": world_size, "start_chunk": start_chunk,
                  "lease": lease, "replicated_groups": list(replicated_groups)}
        if held:
            header["held"] = True
        if cache_salt:
            header["cache_salt"] = label_salt(cache_salt)
        return self.request(header, timeout_s=timeout_s)[0]

    def query(self, model: str, token_ids: Sequence[int] | None = None, *, cache_salt: str | None = None,
              block_hashes: Sequence[bytes] | None = None, instance_id: str | None = None,
              lora_name: str | None = None, tenant_id: str | None = None,
              block_size: int | None = None) -> dict[str, Any]:
        """A router's question (:mod:`cache_server.prefix_query`): the resumable prefix of
        ``token_ids`` (or of vLLM's ``block_hashes``) under ``cache_salt``, in tokens, for
        each namespace of ``model`` on this server: ``{tenant: {namespace:
        {"longest_matched", "CPU", "STORAGE"}}}`` (the Mooncake KV Indexer RFC's answer). Token
        ids travel packed (4 bytes each); nothing is leased."""
        header: dict[str, Any] = {"op": "query", "model": model}
        if token_ids is not None:
            packed = array.array(_U32, token_ids)
            if sys.byteorder == "big":
                packed.byteswap()
            header["token_ids"] = packed.tobytes()
        if block_hashes is not None:
            header["seq_hashes"] = [bytes(h) for h in block_hashes]
        for name, value in (("cache_salt", cache_salt), ("instance_id", instance_id), ("lora_name", lora_name),
                            ("tenant_id", tenant_id), ("block_size", block_size)):
            if value is not None:
                header[name] = value
        return self.request(header)[0]["result"]

    def put(self, namespace: str, items: Sequence[tuple[bytes, int, int, Payload]],
            prev: Sequence[bytes | None] | None = None,
            parent: Sequence[bytes | None] | None = None, *, timeout_s: float | None = None) -> list[str]:
        """Store objects ``(hash, group, rank, payload)``; one :class:`~cache_server.protocol.PutResult`
        value per item. ``prev`` gives, per item, the hash of the previous state stored on the
        same conversation path (state objects only), so the server evicts superseded
        snapshots first. ``parent`` gives, per item, the hash of the chunk before its chunk
        (None: the first chunk; ``b""``: unknown), which places it in the server's chunk
        tree. Payloads must not change until this returns. ``timeout_s`` overrides
        :attr:`timeout_s` for this call."""
        payloads = [_bytes_view(item[3]) for item in items]
        keys = [(h, g, r) for h, g, r, _ in items]
        header: dict[str, Any] = {"op": "put", "ns": namespace, "keys": [list(k) for k in keys],
                                  "sums": [p.checksum(v, namespace, k) for k, v in zip(keys, payloads)]}
        if prev is not None:
            header["prev"] = list(prev)
        if parent is not None:
            header["parent"] = list(parent)
        with self._lock, self._within(timeout_s):
            for _attempt in range(2):
                seg = (self._shm.segment(sum(align_up(v.nbytes) for v in payloads), self._send_header_locked,
                                         timeout_s) if payloads else None)
                if seg is None:
                    reply, _ = self._request_locked(header, payloads, timeout_s)
                    return reply["results"]
                seg.busy = True
                try:
                    reply, _ = self._request_locked({**header, "shm": write_payloads(seg, payloads)}, (), timeout_s)
                    return reply["results"]
                except CacheServerError as e:
                    if not self._shm.retry(e):
                        raise
                finally:
                    seg.busy = False
            reply, _ = self._request_locked(header, payloads, timeout_s)  # a second unknown segment: frames
            return reply["results"]

    def get(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], *,
            timeout_s: float | None = None) -> list[memoryview | None]:
        """Payloads of ``(hash, group, rank)`` keys, None where absent.

        Every payload is checked against the checksum its writer stored with it, which
        covers the key it was stored for (:func:`~cache_server.protocol.checksum`); one that
        does not match (flipped bits, or another key's object) is deleted on the server (``delete`` with reason ``checksum``, counted
        there) and answered as absent, so no corrupt byte ever reaches the caller.
        ``timeout_s`` overrides :attr:`timeout_s` for this call."""
        header = {"op": "get", "ns": namespace, "keys": [list(k) for k in keys]}
        with self._lock, self._within(timeout_s):
            reply, frames, _ = self._get_locked(header, bool(keys), timeout_s)
        return self._verified(namespace, keys, reply, frames, [BY_COPY] * len(frames)).payloads

    def get_in_place(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], *,
                     timeout_s: float | None = None, pin_s: float = DEFAULT_PIN_S) -> InPlace:
        """:meth:`get`, except that objects the server holds in its arena
        (:mod:`cache_server.arena`) come as read-only views of it: those the server verified
        when it placed them are ready to copy; for each other one :attr:`InPlace.unverified`
        gives the key prefix and stored checksum the caller verifies while it copies the bytes, before :attr:`InPlace.deadline` (the
        server may reuse the range after its pin; a copy that ends later must be taken as
        failed), then reports failures with :meth:`delete_corrupt` and hands the pin back
        with :meth:`release_pin`. Without an arena (another host, an old server) this is
        :meth:`get`, every payload verified."""
        header: dict[str, Any] = {"op": "get", "ns": namespace, "keys": [list(k) for k in keys],
                                  "arena": True, "pin_s": pin_s}
        with self._lock, self._within(timeout_s):
            reply, frames, in_arena = self._get_locked(header, bool(keys), timeout_s)
        return self._verified(namespace, keys, reply, frames, in_arena)

    def register_arena_cuda(self) -> str | None:
        """Page-lock the mapped arena for CUDA (:meth:`~cache_server.arena.ClientArena.register_cuda`);
        None when done, else why not (no arena mapped: nothing to do)."""
        arena = self._shm.arena
        return "no arena mapped" if arena is None else arena.register_cuda()

    def _get_locked(self, header: dict[str, Any], any_keys: bool, timeout_s: float | None
                    ) -> tuple[dict[str, Any], list[memoryview], list[int]]:
        """Send a get, through a segment where one is agreed; the reply, the found objects'
        payloads in order, and where each is (:data:`BY_COPY`, :data:`IN_ARENA`,
        :data:`IN_ARENA_CHECKED`)."""
        plain = {k: v for k, v in header.items() if k not in ("arena", "pin_s")}
        for _attempt in range(2):
            seg = self._shm.segment(0, self._send_header_locked, timeout_s) if any_keys else None
            if seg is None:
                break
            arena = self._shm.arena if header.get("arena") else None
            h = {**(header if arena is not None else plain), "shm": get_region(seg)}
            if arena is not None and self._unpins:
                h["unpin"], self._unpins = pack_pins(self._unpins[:MAX_UNPIN]), self._unpins[MAX_UNPIN:]
            seg.busy = True
            try:
                sent = time.monotonic()
                reply, frames = self._request_locked(h, (), timeout_s)
            except CacheServerError as e:
                seg.busy = False
                if not self._shm.retry(e):
                    raise
                continue
            except BaseException:
                seg.busy = False
                raise
            try:
                spans = self._arena_spans(reply, arena) if arena is not None else None
                if spans is None:
                    placed = self._place_shm_locked(seg, reply, frames)
                    return reply, placed, [BY_COPY] * len(placed)
                copied = self._place_shm_locked(seg, {"shm": reply.get("shm"), "found": [x is None for x in spans]},
                                                frames)
            except BaseException:
                seg.busy = False
                raise
            pin, granted = reply.get("pin"), reply.get("pin_s")
            if isinstance(pin, int) and not isinstance(pin, bool) and pin > 0:
                reply["deadline"] = sent + float(granted) - max(PIN_MARGIN_S, 0.1 * float(granted))
            it = iter(copied)
            checked = self._arena_checked(reply, spans)
            return reply, [arena.view(*x) if x is not None else next(it) for x in spans], \
                [BY_COPY if x is None else IN_ARENA_CHECKED if c else IN_ARENA for x, c in zip(spans, checked)]
        reply, frames = self._request_locked(plain, (), timeout_s)  # no segment, or a second unknown one
        return reply, frames, [BY_COPY] * len(frames)

    @staticmethod
    def _arena_checked(reply: dict[str, Any], spans: list[tuple[int, int] | None]) -> list[bool]:
        """Which arena placements the server verified when it placed them (its
        ``arena_checked``; a server that does not say: none)."""
        checked = reply.get("arena_checked")
        if checked is None:
            return [False] * len(spans)
        if not isinstance(checked, list) or len(checked) != len(spans) or not all(c is True or c is False
                                                                                 for c in checked):
            raise CacheServerError("bad_reply", "get answered a malformed arena_checked")
        return checked

    def _arena_spans(self, reply: dict[str, Any], arena: Any) -> list[tuple[int, int] | None] | None:
        """Where a get's reply placed found objects in the arena (None: it placed nothing
        there, e.g. a server without one); a placement outside the arena, or another
        arena's, is a bad reply."""
        spans = reply.get("arena")
        if spans is None:
            return None
        found = reply.get("found")
        granted = reply.get("pin_s")
        if not isinstance(spans, list) or not isinstance(found, list) or len(spans) != sum(map(bool, found)) \
                or reply.get("arena_nonce") != self._shm.arena_nonce \
                or not isinstance(granted, (int, float)) or isinstance(granted, bool) or not 0 <= granted <= 3600:
            raise CacheServerError("bad_reply", "get answered a malformed arena placement")
        out: list[tuple[int, int] | None] = []
        for x in spans:
            if x is None:
                out.append(None)
                continue
            if not (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
                    and ARENA_HEAD <= x[0] and 0 <= x[1] and x[0] + x[1] <= arena.size):
                raise CacheServerError("bad_reply", "get placed an object outside the server's arena")
            out.append((x[0], x[1]))
        return out

    def _verified(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], reply: dict[str, Any],
                  frames: list[memoryview], in_arena: list[int]) -> InPlace:
        """Check every payload not in the arena (a corrupt one is deleted and answered as
        absent); the arena ones are the caller's to check, but those the server verified
        when it placed them (:data:`IN_ARENA_CHECKED`)."""
        found, sums = reply["found"], reply.get("sums")
        if len(found) != len(keys) or sum(found) != len(frames) or not isinstance(sums, list) \
                or len(sums) != len(frames):
            raise CacheServerError("bad_reply", f"get answered {len(frames)} payloads for {found}")
        it = iter(zip(frames, sums, in_arena))
        out: list[memoryview | None] = []
        unverified: list[tuple[bytes, bytes] | None] = []
        corrupt: list[tuple[bytes, int, int]] = []
        for key, f in zip(keys, found):
            unverified.append(None)
            if not f:
                out.append(None)
                continue
            frame, stored, arena = next(it)
            key = (key[0], key[1], key[2])
            if arena:
                out.append(frame)
                if arena != IN_ARENA_CHECKED:
                    unverified[-1] = (p.key_prefix(namespace, key), stored)
            elif stored != p.checksum(frame, namespace, key):
                corrupt.append(key)
                out.append(None)
            else:
                out.append(frame)
        if corrupt:
            self.delete_corrupt(namespace, corrupt)
        pin = reply.get("pin") if any(in_arena) else None
        return InPlace(out, unverified, reply.get("deadline", float("inf")) if pin else float("inf"), pin)

    def delete_corrupt(self, namespace: str, keys: Sequence[tuple[bytes, int, int]]) -> None:
        """Count and delete objects whose bytes failed their checksum (``reason``
        ``checksum``); a failed delete is logged, never raised."""
        self.corrupt_objects += len(keys)
        logger.warning("glm-cache-server at %s: %d object(s) failed their checksum; deleting them",
                       self.url, len(keys))
        try:
            self.delete(namespace, keys, reason="checksum")
        except (CacheServerError, CacheServerUnavailable) as e:
            logger.warning("delete of corrupt objects failed: %s", e)

    def release_pin(self, pin: int | None) -> None:
        """Hand back a read pin of :meth:`get_in_place` (sent with the next such get, or by
        :meth:`unpin`); the server drops it at its deadline anyway."""
        if pin:
            with self._lock:
                self._unpins.append(pin)
                del self._unpins[:-4 * MAX_UNPIN]  # a server gone for long: they expire there

    def unpin(self) -> int:
        """Release the pins handed back now (one ``unpin`` request); how many the server
        released (0 when it could not be asked)."""
        with self._lock, self._within(None):
            ids, self._unpins = self._unpins[:MAX_UNPIN], self._unpins[MAX_UNPIN:]
            if not ids:
                return 0
            try:
                return int(self._request_locked({"op": "unpin", "pins": pack_pins(ids)}, (), None)[0].get("unpinned", 0))
            except (CacheServerError, CacheServerUnavailable):
                return 0

    def delete(self, namespace: str, keys: Sequence[tuple[bytes, int, int]], reason: str = "client") -> int:
        """Remove objects now; ``reason`` ``checksum`` reports them as corrupt."""
        reply, _ = self.request({"op": "delete", "ns": namespace, "keys": [list(k) for k in keys],
                                 "reason": reason})
        return reply["removed"]

    def release(self, lease_id: int, timeout_s: float | None = None) -> bool:
        reply, _ = self.request({"op": "release", "lease_id": lease_id}, timeout_s=timeout_s)
        return reply["released"]

    def clear(self, namespace: str | None = None, tier: str = "all", force: bool = True) -> int:
        """Clear ``namespace`` (None: all), from every tier and leased objects too unless
        told otherwise (the op's own defaults are HTTP's: ``l1``, leased objects kept)."""
        reply, _ = self.request({"op": "clear", "ns": namespace, "tier": tier, "force": force})
        return reply["removed"]

    def stats(self) -> dict[str, Any]:
        reply, _ = self.request({"op": "stats"})
        return reply["stats"]

    def ping(self, timeout_s: float | None = None) -> None:
        self.request({"op": "ping"}, timeout_s=timeout_s)


def _bytes_view(payload: Payload) -> memoryview:
    """``payload`` as a flat byte view (a torch or numpy buffer of any element type)."""
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
