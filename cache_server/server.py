"""glm-cache-server: the ZMQ request loop over an :class:`ObjectStore`.

The ROUTER socket faces the clients; a proxy thread (libzmq's, no Python on the path, no
byte copied: inproc hands messages over by reference) passes requests round-robin to
``--workers`` worker threads over an inproc DEALER, and their replies back. Each worker
answers every request it gets, errors included, with exactly one reply. So one engine's
40 MB transfer does not hold the others behind it: the byte work (ZMQ's I/O threads,
``--io-threads``; copies to and from shared memory; checksums on the client) runs without
the GIL, and the store's lock covers only its bookkeeping, never a copy. A client sends
one request at a time, so its requests are still answered in order. The main thread does
the housekeeping (lease expiry, dropping idle shared-memory segments). The HTTP side
(``cache_server.http``) runs in another thread and only reads the store, or clears it.

Same-host clients may move payloads through shared memory instead of frames
(:mod:`cache_server.shm`, ``--no-shm`` turns it off).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from cache_server import protocol as p
from cache_server.auth import AUTH_FIELD, ZapHandler, token_matches
from cache_server.config import ServerConfig
from cache_server.metrics import ServerMetrics
from cache_server.shm import GetRegion, SegmentTable, SizedSpan, owned_copy, put_spans
from cache_server.store import UNKNOWN_PARENT, Layout, ObjectStore

if TYPE_CHECKING:
    from cache_server.l2 import Promotion

logger = logging.getLogger("glm_cache_server")

class CacheServer:
    """Serves the protocol of :mod:`cache_server.protocol` on a ZMQ ROUTER socket."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = ObjectStore(config.l1_size_bytes, config.max_object_bytes, config.lease_ttl_s,
                                 max_leased_bytes=max(1, int(config.l1_size_bytes * config.max_leased_fraction)),
                                 max_leases_per_owner=config.max_leases_per_client,
                                 eviction=config.eviction_policy.lower(), state_share=config.l1_state_share)
        self.metrics = ServerMetrics(self.store, (config.auth_token or "").encode())
        self.l2 = _make_l2(config, self.metrics)  # None without --l2
        # ns -> (alignment, chunk), or None for one only put to; least recently admitted first.
        self._chunk_by_namespace: OrderedDict[str, tuple[int, int] | None] = OrderedDict()
        self._namespace_lock = threading.Lock()  # the HTTP thread reads the table for /status
        # ns -> (world size, groups stored once for every TP rank), as the engine said at hello
        self._layout_by_namespace: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._local = threading.local()  # per worker: the ZMQ identity of the request being handled
        self.segments = SegmentTable(config.shm)
        if config.auth_token is not None:
            self.metrics.errors.labels(code=p.ErrorCode.UNAUTHORIZED.value)  # exported as 0 from the start
            for reason in ("token", "mechanism"):
                self.metrics.refused_connections.labels(reason=reason)
        self._refused_since_log = 0
        self._refusal_logged_at = -float("inf")
        self._refusal_lock = threading.Lock()  # refusals are noted by workers and the ZAP thread
        self._stop = threading.Event()
        self._die_on: str | None = None  # debug fault hook: SIGKILL ourselves on this op
        self._ctx = zmq.Context(io_threads=max(1, config.io_threads))
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        # libzmq checks MAXMSGSIZE per frame, before buffering it: a bigger frame is dropped
        # and its peer disconnected, unanswered. handle() checks the frames' total.
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.message_limit_bytes)
        # With a token, a peer must present it at connection too (PLAIN, checked by a ZAP
        # handler): one without it is disconnected before any of its frames is read.
        self._zap: ZapHandler | None = None
        if config.auth_token is not None:
            self._zap = ZapHandler(self._ctx, config.auth_token, self._note_connection_refusal)
            ZapHandler.configure(self._sock)
            self._zap.watch(self._sock)
        self.port = self._bind(config.host, config.port)
        self._handlers = {
            "hello": self._hello, "lookup": self._lookup, "get": self._get, "put": self._put,
            "delete": self._delete, "debug_corrupt": self._debug_corrupt, "debug_die_on": self._debug_die_on,
            "release": self._release, "clear": self._clear, "stats": self._stats, "ping": self._ping,
            "shm_attach": self._shm_attach, "shm_detach": self._shm_detach,
        }
        assert set(self._handlers) == set(p.OPS)

    def _bind(self, host: str, port: int) -> int:
        h = host.strip("[]")
        if ":" in h:  # an IPv6 literal (``::1``, ``::``): ZMQ wants it bracketed, IPv6 on
            self._sock.setsockopt(zmq.IPV6, 1)
            h = f"[{h}]"
        if port == 0:
            return self._sock.bind_to_random_port(f"tcp://{h}")
        self._sock.bind(f"tcp://{h}:{port}")
        return port

    # --- loop ----------------------------------------------------------------------------

    @property
    def _client(self) -> bytes | None:
        return getattr(self._local, "client", None)

    def serve_forever(self) -> None:
        """Answer requests until :meth:`stop`; then close the sockets."""
        where = f"inproc://glm-workers-{id(self)}"
        backend = self._ctx.socket(zmq.DEALER)
        backend.setsockopt(zmq.LINGER, 0)
        backend.bind(where)
        control, control_peer = self._ctx.socket(zmq.PAIR), self._ctx.socket(zmq.PAIR)
        control.bind(where + "-control")
        control_peer.connect(where + "-control")
        workers = [threading.Thread(target=self._work, args=(where,), name=f"glm-worker-{i}", daemon=True)
                   for i in range(max(1, self.config.workers))]
        proxy = threading.Thread(target=self._proxy, args=(backend, control_peer), name="glm-proxy", daemon=True)
        for t in workers:
            t.start()
        proxy.start()
        try:
            last_shm_check = time.monotonic()
            while not self._stop.wait(0.1):
                self.store.expire_leases()
                if time.monotonic() - last_shm_check > 1.0:
                    self.segments.expire()
                    last_shm_check = time.monotonic()
        finally:
            control.send(b"TERMINATE")
            proxy.join(5)
            for t in workers:
                t.join(5)
            for sock in (control, control_peer, backend, self._sock):
                sock.close(linger=0)
            if self._zap is not None:
                self._zap.close()
            self._ctx.term()
            self.segments.close()
            if self.l2 is not None:
                self.l2.close()

    def _proxy(self, backend: zmq.Socket, control: zmq.Socket) -> None:
        try:
            zmq.proxy_steerable(self._sock, backend, None, control)
        except zmq.ZMQError as e:
            if e.errno != zmq.ETERM:
                logger.exception("proxy stopped")

    def _work(self, where: str) -> None:
        """One worker: take a request from the proxy, answer it, until :meth:`stop`.

        The proxy hands requests to the workers round-robin, whether they are busy or not,
        so a worker must never sit on one request: a lookup waiting for an L2 promotion is
        put aside (its promotion's completion wakes the worker through a pipe) and answered
        when the promotion is done or at its deadline, while the worker answers the
        requests that come after it."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(where)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_r, zmq.POLLIN)
        waiting: list[tuple[zmq.Frame, _Waiting]] = []

        def wake(_future: Any) -> None:
            try:
                os.write(wake_w, b"\0")
            except OSError:  # the worker has stopped
                pass

        def send(identity: zmq.Frame, reply: list[Any]) -> None:
            try:
                sock.send_multipart([identity, *reply], copy=False)
            except zmq.ZMQError as e:  # the peer vanished; nothing to answer
                logger.debug("reply dropped: %s", e)

        try:
            while not self._stop.is_set():
                timeout_ms = 100
                if waiting:
                    first = min(w.deadline for _, w in waiting)
                    timeout_ms = max(0, min(100, int((first - time.monotonic()) * 1000) + 1))
                ready = dict(poller.poll(timeout_ms))
                if wake_r in ready:
                    while True:
                        try:
                            if not os.read(wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                if sock in ready:
                    frames = sock.recv_multipart(copy=False)
                    identity, request = frames[0], frames[1:]
                    out = self._handle(request, client=identity.bytes)
                    if isinstance(out, _Waiting):
                        waiting.append((identity, out))
                        out.future.add_done_callback(wake)
                    else:
                        send(identity, out)
                for item in [x for x in waiting if x[1].ready()]:
                    waiting.remove(item)
                    send(item[0], item[1].answer())
        finally:
            sock.close(linger=0)
            os.close(wake_r)
            os.close(wake_w)

    def stop(self) -> None:
        self._stop.set()

    def handle(self, frames: list[Any], client: bytes | None = None) -> list[Any]:
        """Turn one request (header frame + payload frames) into reply frames. Never raises.
        ``client`` is the sender's ZMQ identity, which the per-client lease cap counts by.
        A lookup that waits for L2 is waited for here (the worker loop does not wait: it
        uses :meth:`_handle`)."""
        out = self._handle(frames, client)
        if isinstance(out, _Waiting):
            out.wait()
            out = out.answer()
        return out

    def _handle(self, frames: list[Any], client: bytes | None = None) -> list[Any] | _Waiting:
        """:meth:`handle`, except that a lookup waiting for an L2 promotion comes back as a
        :class:`_Waiting`, to be answered once it is ready."""
        request = _Request(time.perf_counter())
        self._local.client = client

        def run() -> tuple[dict[str, Any], list[Any]] | _Later:
            if not frames:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "empty message")
            refusal = self._size_refusal(frames)
            if refusal is not None:
                request.id = p.peek_request_id(_buffer(frames[0]))
                raise refusal
            header = p.unpack_header(_buffer(frames[0]), self.config.max_header_bytes)
            request.id = header.get("id")
            self._authenticate(header)
            op_field = p.field(header, "op", str)
            handler = self._handlers.get(op_field)
            if handler is None:
                raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP,
                                      f"unknown op {op_field[:64]!r}; expected one of {', '.join(p.OPS)}")
            request.op = op_field
            if request.op == self._die_on:  # debug fault hook: die mid-request, as kill -9 would
                os.kill(os.getpid(), signal.SIGKILL)
            return handler(header, [_buffer(f) for f in frames[1:]])

        out = self._answer(request, frames, run)
        return _Waiting(self, request, frames, out) if isinstance(out, _Later) else out

    def _answer(self, request: _Request, frames: list[Any],
                produce: Callable[[], tuple[dict[str, Any], list[Any]] | _Later]) -> list[Any] | _Later:
        """The reply frames of what ``produce`` answers (an error reply for what it raises),
        or the :class:`_Later` it returns."""
        try:
            result = produce()
            if isinstance(result, _Later):
                return result
            reply_header, payloads = result
            reply_header.update(ok=True, id=request.id if isinstance(request.id, int) else None)
            out = [p.pack_header(reply_header), *payloads]
        except p.ProtocolError as e:
            if request.id is None and frames:  # refused unparsed: still answer the client's id
                request.id = p.peek_request_id(_buffer(frames[0]))
            self.metrics.errors.labels(code=e.code.value).inc()
            out = [p.pack_header(p.error_reply(request.id, e.code, e.message))]
        except Exception as e:  # a bug must cost one request, never the server
            logger.exception("internal error handling %s", request.op)
            self.metrics.errors.labels(code=p.ErrorCode.INTERNAL.value).inc()
            out = [p.pack_header(p.error_reply(request.id, p.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))]
        self.metrics.requests.labels(op=request.op).observe(time.perf_counter() - request.start)
        return out

    def _authenticate(self, header: dict[str, Any]) -> None:
        """Refuse a request without the shared token, before it can read or change anything.

        Checked per request, not per connection: ROUTER_HANDOVER lets any peer take over a
        routing identity, so an identity that once authenticated proves nothing."""
        token = self.config.auth_token
        if token is not None and not token_matches(header.get(AUTH_FIELD), token):
            self._note_refusal()
            raise p.ProtocolError(p.ErrorCode.UNAUTHORIZED,
                                  f"missing or wrong {AUTH_FIELD!r} token (server started with --auth-token-file)")

    def _note_connection_refusal(self, reason: str) -> None:
        """A handshake refused (ZAP thread): ``token`` (a wrong one) or ``mechanism`` (none)."""
        self.metrics.refused_connections.labels(reason=reason).inc()
        self._note_refusal()

    def _note_refusal(self) -> None:
        """Say in the log that requests are being refused, at most once a minute (a
        misconfigured client retries often; the exact count is the errors metric)."""
        with self._refusal_lock:
            self._refused_since_log += 1
            now = time.monotonic()
            if now - self._refusal_logged_at < 60.0:
                return
            count, self._refused_since_log, self._refusal_logged_at = self._refused_since_log, 0, now
        logger.warning("refused %d unauthenticated connection(s) or request(s) (missing or wrong token)", count)

    def _size_refusal(self, frames: list[Any]) -> p.ProtocolError | None:
        """The error for an oversize request, found before parsing anything in it."""
        total = sum(_buffer(f).nbytes for f in frames)
        if total > self.config.message_limit_bytes:
            return self._message_refusal(total)
        header_bytes = _buffer(frames[0]).nbytes
        if header_bytes > self.config.max_header_bytes:
            self.metrics.limit_refusals.labels(limit="header_bytes").inc()
            return p.ProtocolError(p.ErrorCode.TOO_LARGE, f"header is {header_bytes} bytes; the maximum is "
                                                          f"{self.config.max_header_bytes} (--max-header-kb)")
        return None

    def _message_refusal(self, total: int) -> p.ProtocolError:
        self.metrics.limit_refusals.labels(limit="message_bytes").inc()
        return p.ProtocolError(p.ErrorCode.TOO_LARGE, f"request is {total} bytes; the maximum is "
                                                      f"{self.config.message_limit_bytes} (--max-message-mb)")

    def _admit_namespace(self, ns: str) -> tuple[int, int] | None:
        """Enter ``ns`` in the namespace table (or refresh it) and return its negotiation.
        At ``--max-namespaces`` the least recently admitted namespace without objects is
        forgotten; when every one holds objects the request is refused."""
        with self._namespace_lock:
            table = self._chunk_by_namespace
            if ns in table:
                table.move_to_end(ns)
                return table[ns]
            if len(table) >= self.config.max_namespaces:
                idle = next((n for n in table if not self.store.namespace_objects(n)), None)
                if idle is None:
                    self.metrics.limit_refusals.labels(limit="namespaces").inc()
                    raise p.ProtocolError(p.ErrorCode.TOO_MANY_NAMESPACES,
                                          f"{len(table)} namespaces hold objects, the maximum (--max-namespaces); "
                                          f"clear one to use {ns[:64]!r}")
                del table[idle]
                logger.info("forgot namespace %r (no objects) to admit %r", idle, ns)
            table[ns] = None
            return None

    # --- operations ----------------------------------------------------------------------

    def _hello(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        version = p.int_field(h, "v", minimum=0)
        if version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(p.ErrorCode.VERSION_MISMATCH,
                                  f"client speaks protocol v{version}, server v{p.PROTOCOL_VERSION}")
        ns = p.field(h, "ns", str)
        alignment = p.int_field(h, "alignment", minimum=1)
        chunk = p.negotiate_chunk_size(self.config.min_chunk_size, alignment)
        known = self._admit_namespace(ns)
        world_size = p.int_field(h, "world_size", minimum=1, default=1)
        replicated = p.group_list(h, "replicated_groups") if "replicated_groups" in h else []
        with self._namespace_lock:
            self._layout_by_namespace[ns] = (world_size, tuple(replicated))
        if known is None:
            with self._namespace_lock:
                self._chunk_by_namespace[ns] = (alignment, chunk)
            logger.info("Negotiated chunk size to %d (configured_min=%d, required_alignment=%d)",
                        chunk, self.config.min_chunk_size, alignment)
        elif known[0] != alignment:
            raise p.ProtocolError(p.ErrorCode.CONFLICT,
                                  f"namespace {ns!r} negotiated alignment {known[0]} before, now {alignment}")
        if "state_groups" in h:  # the engine says which groups are which: track usable prefixes
            attn, state = p.group_list(h, "attn_groups"), p.group_list(h, "state_groups")
            if set(attn) & set(state) or not set(replicated) <= {*attn, *state}:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "attn_groups and state_groups must be disjoint "
                                                               "and hold the replicated_groups")
            self._check_groups([*attn, *state])
            self.store.set_layout(ns, Layout(frozenset(attn), frozenset(state), world_size, frozenset(replicated),
                                             known[1] if known is not None else chunk))
        reply = {"v": p.PROTOCOL_VERSION, "chunk_size": chunk, "min_chunk_size": self.config.min_chunk_size,
                 "separate_object_groups": self.config.separate_object_groups,
                 "max_object_bytes": self.config.max_object_bytes}
        if "shm" in h:  # a same-host offer: agree or say why not (the client then uses frames)
            reply["shm"] = self.segments.attach(h["shm"])
        return reply, []

    def _lookup(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        ns = p.field(h, "ns", str)
        hashes = p.hash_list(h, "hashes")
        attn = p.group_list(h, "attn_groups")
        state = p.group_list(h, "state_groups")
        if not attn and not state:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a lookup needs attn_groups or state_groups")
        if set(attn) & set(state):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a group cannot be both attention and state")
        self._check_groups([*attn, *state])
        world_size = p.int_field(h, "world_size", minimum=1)
        start = p.int_field(h, "start_chunk", minimum=0, default=0)
        lease = p.field(h, "lease", bool, default=True)
        replicated = p.group_list(h, "replicated_groups") if "replicated_groups" in h else []
        if not set(replicated) <= {*attn, *state}:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "replicated_groups must be among attn_groups and state_groups")
        held = p.field(h, "held", bool, default=False)
        owner = self._client

        def answer(l1_depth: int = 0, consulted: bool = False) -> tuple[dict[str, Any], list[Any]]:
            chunks, lease_id = self.store.lookup(ns, hashes, attn, state, world_size, start, lease, owner=owner,
                                                 replicated_groups=replicated)
            if self.l2 is not None:
                self.l2.count_answer(l1_depth, chunks, consulted)
            if lease and chunks and lease_id is None:  # its objects alone are over the leased-bytes cap
                self.metrics.limit_refusals.labels(limit="leased_bytes").inc()
            reply: dict[str, Any] = {"chunks": chunks, "lease_id": lease_id}
            if held:  # only when asked: a client that does not ask never sees it
                reply["held"], reply["start_state"] = self.store.held(ns, hashes, attn, state, world_size, start,
                                                                      replicated)
            return reply, []

        if self.l2 is None:
            return answer()
        # Promote what L2 adds to L1's answer, within the L2 deadline. A lookup that L1 answers
        # in full gets no promotion and is answered now; one that needs L2 is answered when its
        # promotion is done, and its worker serves other requests meanwhile (_work).
        promotion = self.l2.begin_promote(self.store, ns, hashes, attn, state, world_size, start, replicated)
        tier = self.l2
        if promotion.future is None:
            return answer(*tier.finish_promote(promotion))
        return _Later(promotion, lambda: answer(*tier.finish_promote(promotion)))

    def _get(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        ns = p.field(h, "ns", str)
        keys = p.key_list(h)
        # Copy what fits into the client's region; the rest goes as frames.
        region = GetRegion(self.segments, h["shm"]) if "shm" in h else None
        found, sums, payloads, places = [], [], [], []
        for digest, group, rank in keys:
            hit = self.store.get_with_checksum((ns, digest, group, rank))  # the store's lock ends here
            found.append(hit is not None)
            if hit is None:
                continue
            sums.append(hit[1])
            place = None if region is None else region.place(hit[0])
            places.append(place)
            if place is None:
                payloads.append(hit[0])
        reply: dict[str, Any] = {"found": found, "sums": sums}
        if region is not None:
            reply["shm"] = places
            self.segments.count(get_bytes=region.copied)
        return reply, payloads

    def _put(self, h: dict[str, Any], frames: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        ns = p.field(h, "ns", str)
        keys = p.key_list(h)
        spans: list[tuple[int, int]] | None = None
        if "shm" in h:  # payloads lie in the client's segment, not in frames
            if frames:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a put through shared memory carries no payload frames")
            view = self.segments.request_view(h["shm"])
            spans = put_spans(view, h["shm"].get("at"), len(keys))
            total = sum(n for _, n in spans)
            if total > self.config.message_limit_bytes:  # the same bound on what one put makes us copy
                raise self._message_refusal(total)
            frames = [SizedSpan(n) for _, n in spans]  # sizes only, for the checks below
        if len(keys) != len(frames):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"put has {len(keys)} keys but {len(frames)} payload frames")
        self._check_groups([k[1] for k in keys])
        # One chunk's objects travel together: an oversize one rejects the whole put.
        for (_, group, rank), frame in zip(keys, frames):
            if frame.nbytes > self.config.max_object_bytes:
                raise p.ProtocolError(p.ErrorCode.TOO_LARGE,
                                      f"object (group {group}, rank {rank}) is {frame.nbytes} bytes; "
                                      f"the maximum is {self.config.max_object_bytes}")
        sums = p.checksum_list(h, len(keys))
        prevs = p.field(h, "prev", list, default=[None] * len(keys))
        if len(prevs) != len(keys) or not all(x is None or (isinstance(x, bytes) and len(x) == p.HASH_BYTES)
                                              for x in prevs):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"prev must list one {p.HASH_BYTES}-byte hash or nil per key")
        parents = p.field(h, "parent", list, default=[UNKNOWN_PARENT] * len(keys))
        if len(parents) != len(keys) or not all(
                x is None or (isinstance(x, bytes) and len(x) in (0, p.HASH_BYTES)) for x in parents):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"parent must list one {p.HASH_BYTES}-byte hash, nil or empty bytes per key")
        self._admit_namespace(ns)
        if spans is not None:  # the store keeps its own copy: the client reuses its segment
            frames = [owned_copy(view[off:off + n]) for off, n in spans]
            self.segments.count(put_bytes=sum(n for _, n in spans))
        results = [self.store.put((ns, *key), frame, prev, s, parent).value
                   for key, frame, prev, s, parent in zip(keys, frames, prevs, sums, parents)]
        if self.l2 is not None:  # write-through, asynchronous (cache_server.l2 says why)
            for key, frame, prev, s, parent, result in zip(keys, frames, prevs, sums, parents, results):
                if result == p.PutResult.STORED.value:
                    self.l2.write((ns, *key), frame, s, prev, parent)
        return {"results": results}, []

    def _delete(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        ns = p.field(h, "ns", str)
        keys = p.key_list(h)
        reason = p.field(h, "reason", str, default="client")
        if reason not in p.DELETE_REASONS:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"reason must be one of {', '.join(p.DELETE_REASONS)}")
        removed = sum(self.store.delete((ns, *key)) for key in keys)
        self.metrics.deleted.labels(reason=reason).inc(removed)
        if reason == "checksum" and removed:
            logger.warning("deleted %d object(s) of namespace %r whose bytes failed their checksum at a loader",
                           removed, ns)
        return {"removed": removed}, []

    def _debug_corrupt(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        """Flip one byte of a stored object, keeping its checksum: bit rot on demand."""
        if not self.config.debug_fault_hooks:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP, "debug_corrupt needs --debug-fault-hooks")
        ns = p.field(h, "ns", str)
        (key,) = p.key_list(h)
        offset = p.int_field(h, "offset", minimum=0, default=0)
        found = self.store.get_with_checksum((ns, *key))
        if found is None:
            return {"corrupted": False}, []
        data = bytearray(found[0])
        data[offset % len(data)] ^= 0xFF
        self.store.delete((ns, *key))
        self.store.put((ns, *key), bytes(data), None, found[1])
        logger.warning("debug fault hook: flipped byte %d of an object in namespace %r", offset % len(data), ns)
        return {"corrupted": True}, []

    def _debug_die_on(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        """Arm a SIGKILL of this process when the next request of ``op`` arrives (before it is
        answered): a crash during a load (``get``) or a save (``put``), on demand."""
        if not self.config.debug_fault_hooks:
            raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP, "debug_die_on needs --debug-fault-hooks")
        op = p.field(h, "on", str)
        if op not in ("get", "put", "lookup"):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "on must be get, put or lookup")
        self._die_on = op
        logger.warning("debug fault hook: this server will SIGKILL itself on the next %s", op)
        return {"armed": op}, []

    def _release(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        return {"released": self.store.release(p.int_field(h, "lease_id", minimum=1))}, []

    def _clear(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        ns = p.field(h, "ns", (str, type(None)), default=None)
        removed = self.store.clear(ns)
        if self.l2 is not None:
            self.l2.clear(ns)
        logger.info("cleared %d objects%s", removed, f" of namespace {ns!r}" if ns else "")
        return {"removed": removed}, []

    def _stats(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        return {"stats": self.status()}, []

    def _ping(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        return {}, []

    def _shm_attach(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        return {"shm": self.segments.attach(p.field(h, "shm", dict))}, []

    def _shm_detach(self, h: dict[str, Any], _: list[memoryview]) -> tuple[dict[str, Any], list[Any]]:
        return {"detached": self.segments.detach(p.int_field(h, "seg", minimum=1))}, []

    def _check_groups(self, groups: list[int]) -> None:
        if not self.config.separate_object_groups and any(g != 0 for g in groups):
            raise p.ProtocolError(p.ErrorCode.GROUPS_NOT_SEPARATE,
                                  "group ids other than 0 need the server started with --separate-object-groups "
                                  "(required for hybrid KDA/Mamba models)")

    def _replication_status(self, ns: str, layout: tuple[int, tuple[int, ...]] | None) -> dict[str, Any]:
        """What storing the TP-replicated groups once saves in ``ns``: per-rank storage
        would hold ``world_size`` copies of each of their objects."""
        world_size, replicated = layout or (1, ())
        resident = sum(self.store.namespace_group_bytes(ns, g) for g in replicated)
        return {"world_size": world_size, "replicated_groups": list(replicated), "replicated_bytes": resident,
                "bytes_saved_by_storing_once": resident * (world_size - 1)}

    def status(self) -> dict[str, Any]:
        """The /status document."""
        status = self.store.snapshot()
        with self._namespace_lock:
            table = list(self._chunk_by_namespace.items())
            layouts = dict(self._layout_by_namespace)
        status["namespaces"] = {ns: {"alignment": ac[0] if ac else None, "chunk_size": ac[1] if ac else None,
                                     "metrics_id": self.metrics.namespace_id(ns),
                                     "objects": self.store.namespace_objects(ns),
                                     **self._replication_status(ns, layouts.get(ns)),
                                     "usable_prefixes": self.store.usable_prefixes(ns)} for ns, ac in table}
        status["bytes_saved_by_storing_replicated_groups_once"] = sum(
            n["bytes_saved_by_storing_once"] for n in status["namespaces"].values())
        status["config"] = {
            "min_chunk_size": self.config.min_chunk_size, "l1_size_bytes": self.config.l1_size_bytes,
            "max_object_bytes": self.config.max_object_bytes, "eviction_policy": self.config.eviction_policy,
            "l1_state_share": self.config.l1_state_share,
            "separate_object_groups": self.config.separate_object_groups, "lease_ttl_s": self.config.lease_ttl_s,
            "max_message_bytes": self.config.message_limit_bytes, "max_header_bytes": self.config.max_header_bytes,
            "max_leases_per_client": self.config.max_leases_per_client,
            "max_leased_bytes": self.store.max_leased_bytes, "max_namespaces": self.config.max_namespaces,
            "shm": self.config.shm, "workers": self.config.workers, "io_threads": self.config.io_threads,
        }
        status["shm"] = self.segments.snapshot()
        if self.l2 is not None:
            status["l2"] = self.l2.snapshot()
        return status


@dataclass
class _Request:
    """What the reply to a request needs of it while it is being answered."""

    start: float  # time.perf_counter() at arrival
    id: Any = None
    op: str = "invalid"


@dataclass
class _Later:
    """A handler's answer that waits for an L2 promotion: ``finish`` answers once it is ready."""

    promotion: Promotion
    finish: Callable[[], tuple[dict[str, Any], list[Any]]]


class _Waiting:
    """A request whose reply waits for an L2 promotion (the promotion's future, done or not
    by its deadline)."""

    def __init__(self, server: CacheServer, request: _Request, frames: list[Any], later: _Later) -> None:
        self._server, self._request, self._frames, self._later = server, request, frames, later
        assert later.promotion.future is not None
        self.future = later.promotion.future
        self.deadline = later.promotion.deadline

    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline

    def wait(self) -> None:
        """Block until :meth:`ready`."""
        try:
            self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - a timeout, or the job's failure: the tier counts it at finish
            pass

    def answer(self) -> list[Any]:
        """The reply frames, now."""
        out = self._server._answer(self._request, self._frames, self._later.finish)
        assert not isinstance(out, _Later)
        return out


def _make_l2(config: ServerConfig, metrics: ServerMetrics) -> Any:
    """The L2 tier of ``--l2`` with its metrics, or None."""
    if config.l2_url is None:
        return None
    from cache_server.l2 import L2Config, L2Tier

    cfg = L2Config.from_url(config.l2_url, allow_debug=config.debug_fault_hooks, secret=config.l2_secret)
    tier = L2Tier(cfg, observe=metrics.observe_l2())
    metrics.watch_l2(tier)
    return tier


def _buffer(frame: Any) -> memoryview:
    """The bytes of a received frame without copying them."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
