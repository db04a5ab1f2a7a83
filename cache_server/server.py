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
(:mod:`cache_server.shm`, ``--no-shm`` turns it off; the server's side of it, with the
arena, is :mod:`cache_server.same_host`). The worker loop is :mod:`cache_server.workers`,
the namespace table :mod:`cache_server.namespaces`, the token check of
``--auth-token-file`` :mod:`cache_server.token_gate`, a request's deadline
:mod:`cache_server.deadlines`, routers' queries' thread :mod:`cache_server.query_thread`,
the fault hooks :mod:`cache_server.fault_hooks`; this module dispatches the operations and
answers each with exactly one reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from cache_server import protocol as p
from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.config import ServerConfig
from cache_server.conn_gate import ConnectionGate, RefusalLog
from cache_server.deadlines import Request, account_late, note_deadline
from cache_server.fault_hooks import FaultHooks
from cache_server.layout import Layout, copy_count
from cache_server.leases import Release
from cache_server.metrics import ServerMetrics
from cache_server.namespaces import NamespaceTable
from cache_server.prefix_query import PrefixQuery, chunk_key_scheme
from cache_server.query_thread import QueryThread
from cache_server.same_host import SameHost
from cache_server.shm_payloads import SizedSpan
from cache_server.store import ObjectStore
from cache_server.store_accounts import OBJECT_OVERHEAD_BYTES
from cache_server.token_gate import TokenGate
from cache_server.workers import Later, Reply, Waiting, Watchdog, work

logger = logging.getLogger("glm_cache_server")

# The smallest object a put may hold. An object is at least one row of its group; each is also
# charged the store's OBJECT_OVERHEAD_BYTES, so a flood of small ones fills the budget and is
# evicted like any other (a minimum per group would need a row size the hello does not carry).
MIN_OBJECT_BYTES = 1


class CacheServer:
    """Serves the protocol of :mod:`cache_server.protocol` on a ZMQ ROUTER socket."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = ObjectStore(config.l1_size_bytes, config.max_object_bytes, config.lease_ttl_s,
                                 max_leased_bytes=max(1, int(config.l1_size_bytes * config.max_leased_fraction)),
                                 max_leases_per_owner=config.max_leases_per_client,
                                 eviction=config.eviction_policy.lower(), state_share=config.l1_state_share,
                                 object_overhead_bytes=OBJECT_OVERHEAD_BYTES)
        self.metrics = ServerMetrics(self.store, (config.auth_token or "").encode())
        self.l2 = _make_l2(config, self.metrics)  # None without --l2
        self.namespaces = NamespaceTable(self.store, self.metrics, config.max_namespaces)
        self.queries = PrefixQuery(self.store, self.namespaces, self.l2, config.max_namespaces)  # routers' questions
        self._query_thread = QueryThread(self.queries)
        self._local = threading.local()  # per worker: the ZMQ identity of the request being handled
        self.same_host = SameHost(config, lambda: self._client)  # segments, the arena, its read pins
        self._faults = FaultHooks(config.debug_fault_hooks, self.store, self.same_host.arena)
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=max(1, config.io_threads))
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        # libzmq checks MAXMSGSIZE per frame, before buffering it: a bigger frame is dropped
        # and its peer disconnected, unanswered. handle() checks the frames' total.
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.message_limit_bytes)
        self._gate = (TokenGate(config.auth_token, self.metrics, self._ctx, self._sock)
                      if config.auth_token is not None else None)
        ConnectionGate.configure(self._sock)
        self._accept_gate = ConnectionGate(self._ctx, RefusalLog(self.metrics.refused_connections),
                                           self._gate.note_handshake_failed if self._gate is not None else None)
        self.port = self._bind(config.host, config.port)
        self._accept_gate.watch(self._sock, self.port)
        self._handlers = {
            "hello": self._hello, "lookup": self._lookup, "get": self._get, "put": self._put,
            "delete": self._delete, "debug_corrupt": self._faults.corrupt, "debug_die_on": self._faults.die_on,
            "release": self._release, "clear": self._clear, "stats": self._stats, "ping": self._ping,
            "shm_attach": self.same_host.shm_attach, "shm_detach": self.same_host.shm_detach,
            "query": self._query_thread.query, "unpin": self.same_host.unpin,
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
        watchdog = Watchdog(self.metrics.stuck_requests.inc)
        workers = [threading.Thread(target=work, args=(self._ctx, where, self._stop, self._handle, p.MAX_FRAMES,
                                                       watchdog.busy),
                                    name=f"glm-worker-{i}", daemon=True) for i in range(max(1, self.config.workers))]
        proxy = threading.Thread(target=self._proxy, args=(backend, control_peer), name="glm-proxy", daemon=True)
        for t in workers:
            t.start()
        proxy.start()
        try:
            last_shm_check = time.monotonic()
            while not self._stop.wait(0.1):
                self.store.expire_leases()
                if time.monotonic() - last_shm_check > 1.0:
                    watchdog.check()
                    self.same_host.housekeep()
                    last_shm_check = time.monotonic()
        finally:
            control.send(b"TERMINATE")
            proxy.join(5)
            for t in workers:
                t.join(5)
            for sock in (control, control_peer, backend, self._sock):
                sock.close(linger=0)
            if self._gate is not None:
                self._gate.close()
            self._accept_gate.close()
            self._ctx.term()
            self.same_host.close()
            if self.l2 is not None:
                self.l2.close()
            self._query_thread.shutdown()

    def _proxy(self, backend: zmq.Socket, control: zmq.Socket) -> None:
        try:
            zmq.proxy_steerable(self._sock, backend, None, control)
        except zmq.ZMQError as e:
            if e.errno != zmq.ETERM:
                logger.exception("proxy stopped")

    def stop(self) -> None:
        self._stop.set()

    def handle(self, frames: list[Any], client: bytes | None = None) -> list[Any]:
        """Turn one request (header frame + payload frames) into reply frames. Never raises.
        ``client`` is the sender's ZMQ identity, which the per-client lease cap counts by.
        A lookup that waits for L2 is waited for here (the worker loop does not wait: it
        uses :meth:`_handle`)."""
        out = self._handle(frames, client)
        if isinstance(out, Waiting):
            out.wait()
            out = out.answer()
        return out

    def _handle(self, frames: list[Any], client: bytes | None = None) -> list[Any] | Waiting:
        """:meth:`handle`, except that a lookup waiting for an L2 promotion comes back as a
        :class:`Waiting`, to be answered once it is ready."""
        request = Request(time.perf_counter(), time.time(), client)
        self._local.client = client

        def run() -> Reply | Later:
            if not frames:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "empty message")
            refusal = self._size_refusal(frames)
            if refusal is not None:
                request.id = p.peek_request_id(_buffer(frames[0]))
                raise refusal
            header = p.unpack_header(_buffer(frames[0]), self.config.max_header_bytes)
            request.id = header.get("id")
            if self._gate is not None:
                self._gate.check(header)
            op_field = p.field(header, "op", str)
            handler = self._handlers.get(op_field)
            if handler is None:
                raise p.ProtocolError(p.ErrorCode.UNKNOWN_OP,
                                      f"unknown op {op_field[:64]!r}; expected one of {', '.join(p.OPS)}")
            request.op = op_field
            note_deadline(request, header, self.metrics)
            if request.expired and op_field in p.SKIPPED_WHEN_EXPIRED:
                raise p.ProtocolError(p.ErrorCode.EXPIRED, f"the client's deadline passed {-request.left():.1f}s "
                                                           "before a worker took this request: not done")
            self._faults.die_if_armed(request.op)  # a debug fault hook: mid-request, as kill -9 would
            return handler(header, [_buffer(f) for f in frames[1:]])

        out = self._answer(request, frames, run)
        if isinstance(out, Later):
            later = out
            return Waiting(later, lambda: self._answer(request, frames, later.finish))
        return out

    def _answer(self, request: Request, frames: list[Any],
                produce: Callable[[], Reply | Later]) -> list[Any] | Later:
        """The reply frames of what ``produce`` answers (an error reply for what it raises),
        or the :class:`Later` it returns."""
        reply_header: dict[str, Any] | None = None
        try:
            result = produce()
            if isinstance(result, Later):
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
        took = time.perf_counter() - request.start
        self.metrics.requests.labels(op=request.op).observe(took)
        account_late(request, took, reply_header, self.store, self.metrics)
        return out

    def _size_refusal(self, frames: list[Any]) -> p.ProtocolError | None:
        """The error for an oversize request, found before parsing anything in it."""
        # The worker loop keeps at most one frame more than this (cache_server.workers).
        most = min(p.MAX_FRAMES - 1, p.max_payload_frames(_buffer(frames[0]).nbytes))
        if len(frames) - 1 > most:
            return p.ProtocolError(p.ErrorCode.TOO_LARGE,
                                   f"request has more than {most} payload frames: one per key, at most "
                                   f"{p.MAX_KEYS}, each key taking {p.KEY_WIRE_BYTES} bytes of the header")
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

    # --- operations ----------------------------------------------------------------------

    def _hello(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        version = p.int_field(h, "v", minimum=0)
        if version != p.PROTOCOL_VERSION:
            raise p.ProtocolError(p.ErrorCode.VERSION_MISMATCH,
                                  f"client speaks protocol v{version}, server v{p.PROTOCOL_VERSION}")
        ns = p.namespace_field(h)
        alignment = p.int_field(h, "alignment", minimum=1, maximum=p.MAX_ALIGNMENT)
        chunk = p.negotiate_chunk_size(self.config.min_chunk_size, alignment)
        world_size = p.int_field(h, "world_size", minimum=1, default=1, maximum=p.MAX_WORLD_SIZE)
        replicated = p.group_list(h, "replicated_groups") if "replicated_groups" in h else []
        layout = "state_groups" in h  # the engine says which groups are which: track usable prefixes
        if layout:  # checked whole before the namespace is admitted: a refused hello changes nothing
            attn, state = p.group_list(h, "attn_groups"), p.group_list(h, "state_groups")
            if set(attn) & set(state) or not set(replicated) <= {*attn, *state}:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "attn_groups and state_groups must be disjoint "
                                                               "and hold the replicated_groups")
            self._check_groups([*attn, *state])
            self._check_copies([*attn, *state], world_size, replicated)
            names = p.group_names(h) if "group_names" in h else {}
            if not set(names) <= {*attn, *state}:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "group_names must name attn_groups or state_groups")
        scheme = chunk_key_scheme(h["chunk_keys"]) if "chunk_keys" in h else None
        known = self.namespaces.admit(ns)
        self.metrics.saw_namespace(ns)  # LMCache's failure counters of its model, at 0 from now
        self.queries.record_hello(ns, scheme)
        self.namespaces.record_hello(ns, known, alignment, chunk, self.config.min_chunk_size, world_size, replicated)
        if layout:
            self.store.set_layout(ns, Layout(frozenset(attn), frozenset(state), world_size, frozenset(replicated),
                                             known[1] if known is not None else chunk, tuple(sorted(names.items()))))
        reply = {"v": p.PROTOCOL_VERSION, "chunk_size": chunk, "min_chunk_size": self.config.min_chunk_size,
                 "separate_object_groups": self.config.separate_object_groups,
                 "max_object_bytes": self.config.max_object_bytes}
        if "shm" in h:  # a same-host offer: agree or say why not (the client then uses frames)
            reply["shm"] = self.same_host.agree(h["shm"])
        return reply, []

    def _lookup(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        ns = p.namespace_field(h)
        hashes = p.hash_list(h, "hashes")
        attn = p.group_list(h, "attn_groups")
        state = p.group_list(h, "state_groups")
        if not attn and not state:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a lookup needs attn_groups or state_groups")
        if set(attn) & set(state):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "a group cannot be both attention and state")
        self._check_groups([*attn, *state])
        world_size = p.int_field(h, "world_size", minimum=1, maximum=p.MAX_WORLD_SIZE)
        start = p.int_field(h, "start_chunk", minimum=0, default=0, maximum=p.MAX_HASHES)
        lease = p.field(h, "lease", bool, default=True)
        replicated = p.group_list(h, "replicated_groups") if "replicated_groups" in h else []
        if not set(replicated) <= {*attn, *state}:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "replicated_groups must be among attn_groups and state_groups")
        copies = self._check_copies([*attn, *state], world_size, replicated)
        if len(hashes) * copies > p.MAX_LOOKUP_OBJECTS:
            raise p.ProtocolError(p.ErrorCode.TOO_LARGE,
                                  f"a lookup of {len(hashes)} chunks x {copies} objects per chunk asks about "
                                  f"{len(hashes) * copies} objects; the maximum is {p.MAX_LOOKUP_OBJECTS}")
        held = p.field(h, "held", bool, default=False)
        # optional: the request's cache salt, only for the cache_salt label (a keyed hash, capped)
        salt = p.field(h, "cache_salt", (str, type(None)), default=None)
        if salt is not None and len(salt) > p.MAX_NAMESPACE_CHARS:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"cache_salt is over {p.MAX_NAMESPACE_CHARS} characters")
        owner = self._client

        def answer(l1_depth: int = 0, consulted: bool = False) -> Reply:
            chunks, lease_id = self.store.lookup(ns, hashes, attn, state, world_size, start, lease, owner=owner,
                                                 replicated_groups=replicated)
            if self.l2 is not None:
                self.l2.count_answer(l1_depth, chunks, consulted)
            self.metrics.count_lookup(self.namespaces.chunk_size(ns), len(hashes), start, chunks,
                                      l1_depth if consulted else None, namespace=ns, salt=salt)
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
        # promotion is done, and its worker serves other requests meanwhile (cache_server.workers).
        promotion = self.l2.begin_promote(self.store, ns, hashes, attn, state, world_size, start, replicated)
        tier = self.l2
        if promotion.future is None:
            return answer(*tier.finish_promote(promotion))
        return Later(promotion, lambda: answer(*tier.finish_promote(promotion)))

    def _get(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        ns = p.namespace_field(h)
        keys = p.key_list(h)
        plan = self.same_host.begin_get(h)  # the arena, the client's region, or frames
        found, sums, hits = [], [], []
        for digest, group, rank in keys:
            hit = self.store.get_with_checksum((ns, digest, group, rank))  # the store's lock ends here
            found.append(hit is not None)
            if hit is not None:
                sums.append(hit[1])
                hits.append(hit[0])  # holds an arena object's bytes while this get uses them
        reply: dict[str, Any] = {"found": found, "sums": sums}
        payloads = self.same_host.deliver(plan, hits, reply)
        self.metrics.count_get_misses(ns, found.count(False))
        return reply, payloads

    def _put(self, h: dict[str, Any], frames: list[memoryview]) -> Reply:
        ns = p.namespace_field(h)
        keys = p.key_list(h)
        source = self.same_host.put_source(h, frames, len(keys))
        if source is not None:  # payloads lie in the client's segment, not in frames
            if source.total > self.config.message_limit_bytes:  # the same bound on what one put makes us copy
                raise self._message_refusal(source.total)
            frames = [SizedSpan(n) for _, n in source.spans]  # sizes only, for the checks below
        if len(keys) != len(frames):
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                  f"put has {len(keys)} keys but {len(frames)} payload frames")
        self._check_groups([k[1] for k in keys])
        # One chunk's objects travel together: an oversize or empty one rejects the whole put.
        for (_, group, rank), frame in zip(keys, frames):
            if frame.nbytes < MIN_OBJECT_BYTES:
                raise p.ProtocolError(p.ErrorCode.BAD_REQUEST,
                                      f"object (group {group}, rank {rank}) is empty: every group's object holds at "
                                      "least one row (a PD hand-off's tail at least one token)")
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
        self.namespaces.admit(ns)
        if source is not None:  # the store keeps its own copy: the client reuses its segment
            frames = self.same_host.take(source, ns, keys, sums)
        results = [self.store.put((ns, *key), frame, prev, s, parent).value
                   for key, frame, prev, s, parent in zip(keys, frames, prevs, sums, parents)]
        self.metrics.count_put_no_space(ns, results.count(p.PutResult.NO_SPACE.value))
        if self.l2 is not None:  # write-through, asynchronous (cache_server.l2 says why)
            for key, frame, prev, s, parent, result in zip(keys, frames, prevs, sums, parents, results):
                if result == p.PutResult.STORED.value:
                    self.l2.write((ns, *key), frame, s, prev, parent)
        return {"results": results}, []

    def _delete(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        ns = p.namespace_field(h)
        keys = p.key_list(h)
        reason = p.field(h, "reason", str, default="client")
        if reason not in p.DELETE_REASONS:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"reason must be one of {', '.join(p.DELETE_REASONS)}")
        removed = sum(self.store.delete((ns, *key)) for key in keys)
        if self.l2 is not None:  # else the next lookup promotes the deleted object back from L2
            self.l2.delete([(ns, *key) for key in dict.fromkeys(keys)])
        self.metrics.deleted.labels(reason=reason).inc(removed)
        if reason == "checksum" and removed:
            logger.warning("deleted %d object(s) of namespace %r whose bytes failed their checksum at a loader",
                           removed, ns)
        return {"removed": removed}, []

    def _release(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        lease_id = p.int_field(h, "lease_id", minimum=1, maximum=p.MAX_LEASE_ID)
        outcome = self.store.release_from(lease_id, self._client)  # only the connection that took it
        if outcome is Release.RELEASED:
            return {"released": True}, []
        return {"released": False, "reason": outcome.value}, []

    def _clear(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        """``clear`` with HTTP's (and LMCache's) meaning: ``tier`` ``l1`` (default), ``l2`` or
        ``all``; without ``force``, objects a lookup leased stay (``kept_leased``)."""
        ns = p.field(h, "ns", (str, type(None)), default=None)
        if ns is not None:
            ns = p.namespace_field(h)
        tier, force = p.field(h, "tier", str, default="l1"), p.field(h, "force", bool, default=False)
        if tier not in p.CLEAR_TIERS:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, f"tier must be one of {', '.join(p.CLEAR_TIERS)}")
        if tier == "l2" and self.l2 is None:
            raise p.ProtocolError(p.ErrorCode.BAD_REQUEST, "this server has no L2 tier (--l2)")
        removed, kept = self.clear(ns, tier, force)
        return {"removed": removed, **({"kept_leased": kept} if kept else {})}, []

    def clear(self, ns: str | None, tier: str, force: bool) -> tuple[int, int]:
        """Clear namespace ``ns`` (None: every one) from ``tier`` (``l1``, ``l2``, ``all``);
        without ``force`` leased objects stay in L1. ``(removed, kept leased)``; L2's keys
        go in the background, after the writes queued before it. Both the protocol's
        ``clear`` and HTTP's ``POST /cache/clear`` come here."""
        removed = kept = 0
        if tier != "l2":
            removed, kept = (self.store.clear(ns), 0) if force else self.store.clear_unleased(ns)
        if self.l2 is not None and tier != "l1":
            self.l2.clear(ns)
        logger.info("cleared %s%s: removed %d objects, kept %d leased%s", tier, ", force" if force else "", removed,
                    kept, f" (namespace {ns!r})" if ns else "")
        return removed, kept

    def _stats(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        return {"stats": self.status()}, []

    def _ping(self, h: dict[str, Any], _: list[memoryview]) -> Reply:
        return {}, []

    def _check_copies(self, groups: list[int], world_size: int, replicated: list[int]) -> int:
        """The objects one chunk of ``groups`` has on ``world_size`` ranks, counted without
        building them; refused over :data:`~cache_server.protocol.MAX_COPIES`."""
        copies = copy_count(groups, world_size, set(replicated))
        if copies > p.MAX_COPIES:
            raise p.ProtocolError(p.ErrorCode.TOO_LARGE,
                                  f"{len(groups)} groups on {world_size} ranks make {copies} objects per chunk; "
                                  f"the maximum is {p.MAX_COPIES}")
        return copies

    def _check_groups(self, groups: list[int]) -> None:
        if not self.config.separate_object_groups and any(g != 0 for g in groups):
            raise p.ProtocolError(p.ErrorCode.GROUPS_NOT_SEPARATE,
                                  "group ids other than 0 need the server started with --separate-object-groups "
                                  "(required for hybrid KDA/Mamba models)")

    def status(self) -> dict[str, Any]:
        """The /status document."""
        status = self.store.snapshot()
        status["namespaces"] = self.namespaces.status()
        for ns, entry in status["namespaces"].items():  # what a router's query needs to know of it
            scheme = self.queries.schemes.get(ns)
            entry["chunk_keys"] = None if scheme is None else scheme.describe()
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
        status["queries"] = self._query_thread.status()
        status["shm"] = self.same_host.status()
        if self.l2 is not None:
            status["l2"] = self.l2.snapshot()
        return status


def _make_l2(config: ServerConfig, metrics: ServerMetrics) -> Any:
    """The L2 tier of ``--l2`` with its metrics, or None."""
    if config.l2_url is None:
        return None
    from cache_server.l2 import L2Tier
    from cache_server.l2_config import L2Config

    cfg = L2Config.from_url(config.l2_url, allow_debug=config.debug_fault_hooks, secret=config.l2_secret)
    tier = L2Tier(cfg, observe=metrics.observe_l2(cfg.cluster))
    metrics.watch_l2(tier)
    return tier


def _buffer(frame: Any) -> memoryview:
    """The bytes of a received frame without copying them."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
