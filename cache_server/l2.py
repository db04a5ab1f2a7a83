"""The second tier (``glm-cache-server --l2 URL``): a Redis or Valkey store (one node or a
cluster) that many ``glm-cache-server`` instances share, so the cache spans hosts, outlives
a server, and a conversation started through host A resumes through host B.

Semantics, and why:

* **Write-through, asynchronous.** Every object a client stores (``put`` answered
  ``stored``) is queued for L2 when it is stored, not when L1 evicts it: a conversation
  must resume through another host while it is still resident on the first, and a
  SIGKILLed server must lose only what was still queued. L1 evictions then need no write
  (the object is in L2 already). One writer thread drains a byte-bounded queue; when it is
  full, the new write is dropped and counted (the request loop never waits on L2 to store).
* **Promotion at lookup.** A lookup that L1 cannot answer to the end of its strict prefix
  asks L2 (``EXISTS``, pipelined) which of the missing objects it holds, finds the deepest
  resume point of L1 and L2 together (attention for every chunk, the state at the last),
  fetches the missing objects, verifies each, puts them into L1, and only then answers the
  lookup from L1 (with the usual lease). Bytes never go from L2 to a client directly.
* **Bounded stall.** The L2 calls of a lookup run on one reader thread; the request loop
  waits for them at most ``timeout_s`` (default 1 s; keep it below the connector's
  ``timeout_s``, 2 s by default). A lookup that L1 answers in full never touches L2 nor
  waits for another lookup's promotion: promotions queue on the reader, each lookup that
  needs one is answered at most ``timeout_s`` after it arrived, and the request worker
  that holds it answers other requests meanwhile (:meth:`L2Tier.begin_promote`). Past
  that the lookup is answered from what L1 holds
  then (objects already verified are kept, so the next lookup fetches only the rest). While
  the reader is still busy with an abandoned promotion, lookups skip L2. After an L2 error,
  L2 is skipped for ``retry_after_s``. Every L2 error or timeout is a miss, never a stall
  past the timeout, never a wrong byte.
* **Authentication.** An L2 value carries a MAC (keyed blake3) over its full key, its
  metadata and its payload under a key derived from ``--l2-secret-file``, which only the
  servers sharing the store hold (:mod:`cache_server.l2_values`). Promotion verifies it and
  the object's checksum; a value that fails (forged, replayed from another key, altered,
  or of an older unauthenticated format) is counted (``errors{kind=auth}``, ``checksum``
  or ``format``), deleted from L2, and treated as absent. A refusal does not mark L2 down:
  whoever can write to the store must not be able to switch the tier off with it.
* **Keys carry the namespace**: ``{prefix}:{ns tag}:{hash hex}:{group}:{rank}``, the tag
  a short digest of the namespace (:func:`~cache_server.l2_values.namespace_tag`). One store serves many
  models and salts without collisions. ``clear`` (of a namespace or all) also deletes the
  keys in L2, in the background, in write order; until that is done, lookups of that
  namespace do not consult L2.
* **Deletes reach L2.** A client's ``delete`` (a loader found the object's bytes or size
  wrong) is queued for L2 too, after the writes queued before it, so the next lookup does
  not promote the deleted object back. Until the writer has made it, promotions treat those
  keys as absent in L2, and a promotion under way when it arrives does not put them into L1.
  A delete costs :data:`DELETE_ITEM_BYTES` of the queue per key; one that does not fit, or
  that the writer cannot make (L2 down, an error), is counted (``dropped_deletes``).
* **The writer's queue is bounded in bytes and in items.** A write counts its payload plus
  :data:`WRITE_ITEM_BYTES` (its own bookkeeping) against ``queue_mb``, and at most
  :data:`MAX_QUEUE_ITEMS` writes and deletes wait: a flood of tiny objects while Redis is
  slow is dropped (``queue_full``) like a flood of large ones, not queued without bound.
* Objects over ``max_value_bytes`` (Redis refuses values over 512 MB) are not written to L2
  (counted as dropped ``too_large``); the server's default largest object is 256 MiB.

The ``--l2`` URL and its parameters: :mod:`cache_server.l2_config`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cache_server import protocol as p
from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.l2_config import L2Config, L2ConfigError
from cache_server.l2_values import HEADER_BYTES, decode_value, encode_value, mac_key, namespace_tag
from cache_server.layout import StoreKey, group_ranks, resume_depth
from cache_server.store import ObjectStore

logger = logging.getLogger("glm_cache_server.l2")

MAX_VALUE_BYTES = 512 * (1 << 20) - 1024  # Redis' proto-max-bulk-len default is 512 MB
GET_BATCH = 4  # objects per pipelined GET: a 40 MB state object is one of these
WRITE_BATCH_BYTES = 64 << 20
DELETE_ITEM_BYTES = 256  # what one key of a queued delete counts against the queue's bytes
WRITE_ITEM_BYTES = 512  # what one queued write counts beyond its payload (its tuple, key and metadata)
MAX_QUEUE_ITEMS = 65536  # writes and deletes waiting for the writer, whatever their bytes

Fetched = tuple[StoreKey, memoryview, bytes, bytes | None, bytes | None]  # key, payload, checksum, prev, parent


def redis_key(prefix: str, key: StoreKey) -> str:
    """The store's key of an object: ``{prefix}:{ns tag}:{hash hex}:{group}:{rank}``."""
    ns, digest, group, rank = key
    return f"{prefix}:{namespace_tag(ns)}:{digest.hex()}:{group}:{rank}"


@dataclass
class L2Counters:
    """Monotonic counters for /status and /metrics."""

    lookups: int = 0  # lookups that consulted L2
    hits: int = 0  # ... whose answer went deeper thanks to L2
    misses: int = 0
    skipped: int = 0  # lookups that could not consult L2 (down, busy, namespace being cleared)
    timeouts: int = 0  # lookups answered at the deadline
    promoted_objects: int = 0
    promoted_bytes: int = 0
    written_objects: int = 0
    written_bytes: int = 0
    deleted_objects: int = 0  # values a client's delete removed from L2
    dropped_deletes: int = 0  # keys of client deletes not made (queue full, L2 down, an error)
    dropped: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))


@dataclass(eq=False)  # hashable by identity: the tier keeps the ones under way in a set
class Promotion:
    """One lookup's promotion (:meth:`L2Tier.begin_promote`)."""

    store: ObjectStore
    l1_depth: int  # the depth L1 alone had
    future: Future[Any] | None = None  # the reader's job; None: nothing to wait for
    deadline: float = 0.0  # time.monotonic() past which the lookup is answered from L1
    results: list[Fetched] = field(default_factory=list)  # verified objects, appended by the reader
    cancel: threading.Event = field(default_factory=threading.Event)
    keep: list[StoreKey] = field(default_factory=list)  # L1 objects the resume counts on: pinned while it puts
    deleted: set[StoreKey] = field(default_factory=set)  # keys a client deleted meanwhile: not put into L1


class L2Tier:
    """The L2 tier of one server: a reader thread (promotions) and a writer thread
    (write-through and clears), each with its own client, both bounded by timeouts."""

    def __init__(self, config: L2Config, observe: Callable[[str, float, int], None] | None = None) -> None:
        if config.secret is None:
            raise L2ConfigError("the L2 tier needs the servers' shared secret (--l2-secret-file)")
        self.config = config
        self._mac_key = mac_key(config.secret)
        self.counters = L2Counters()
        # (op, seconds, bytes moved) per round trip: the latency histogram and L2 throughput
        self._observe = observe or (lambda op, seconds, nbytes: None)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-l2-reader")
        self._reader_client: Any = None
        self._probe_client: Any = None  # routers' queries (probe): EXISTS only
        self._probe_lock = threading.Lock()
        self._abandoned: Future[Any] | None = None  # a promotion past its deadline still running
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self._queue_bytes = 0
        self._queue_cv = threading.Condition(self._lock)
        self._clearing: collections.Counter[str | None] = collections.Counter()  # ns tag (None: all) -> jobs
        self._deleting: collections.Counter[StoreKey] = collections.Counter()  # key -> queued deletes of it
        self._promotions: set[Promotion] = set()  # begun, not yet finished
        self._refusal_logged: dict[str, float] = {}
        self._closed = False
        self._writing = False  # the writer holds a batch it has taken off the queue
        self._writer = threading.Thread(target=self._write_loop, name="glm-l2-writer", daemon=True)
        self._writer.start()

    # --- clients ---------------------------------------------------------------------------

    def _make_client(self) -> Any:
        """A fresh client; connection attempts and replies bounded by ``timeout_s``; no
        retries (the caller decides what an error means: a miss, a dropped write)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        c = self.config
        common: dict[str, Any] = dict(password=c.password, username=c.username, socket_timeout=c.timeout_s,
                                      socket_connect_timeout=c.timeout_s, retry=Retry(NoBackoff(), 0),
                                      socket_read_size=1 << 20)  # multi-MB values: fewer, larger reads
        if c.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            return RedisCluster(startup_nodes=[ClusterNode(h, port) for h, port in c.nodes],
                                require_full_coverage=False, **common)
        (host, port), = c.nodes
        return redis.Redis(host=host, port=port, **common)

    def redis_key(self, key: StoreKey) -> str:
        return redis_key(self.config.prefix, key)

    def _error(self, kind: str, err: BaseException | str) -> None:
        with self._lock:
            self.counters.errors[kind] += 1
            first = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.config.retry_after_s
        if first:
            logger.warning("L2 %s error (%s); skipping L2 for %.1fs", kind, err, self.config.retry_after_s)

    def _refuse(self, reason: str, redis_key: str) -> None:
        """Count a value refused at promotion (``auth``, ``checksum``, ``format``); logged at
        most once a minute per reason (a planted batch must not flood the log)."""
        with self._lock:
            self.counters.errors[reason] += 1
            now = time.monotonic()
            first = now - self._refusal_logged.get(reason, -float("inf")) >= 60.0
            if first:
                self._refusal_logged[reason] = now
        if first:
            logger.warning("L2 value %s refused at promotion (%s); deleted, counted as errors{kind=%s}",
                           redis_key, {"auth": "its MAC is not this key's: forged, copied from another key, "
                                               "or written with another --l2-secret-file",
                                       "checksum": "its payload does not match its checksum",
                                       "format": "not a value of this format"}.get(reason, reason), reason)

    @staticmethod
    def _kind(err: BaseException) -> str:
        import redis

        if isinstance(err, (redis.TimeoutError, TimeoutError)):
            return "timeout"
        if isinstance(err, (redis.ConnectionError, ConnectionError, OSError)):
            return "connection"
        return "other"

    # --- write-through -----------------------------------------------------------------------

    def write(self, key: StoreKey, payload: bytes | memoryview, checksum: bytes, prev: bytes | None,
              parent: bytes | None = UNKNOWN_PARENT) -> None:
        """Queue one stored object (with its ``prev`` and chunk-tree ``parent``, as put) for
        L2. Never blocks: a full queue drops the write."""
        nbytes = memoryview(payload).nbytes
        if nbytes + HEADER_BYTES > MAX_VALUE_BYTES:
            with self._lock:
                self.counters.dropped["too_large"] += 1
            return
        with self._lock:
            if self._queue_bytes + nbytes + WRITE_ITEM_BYTES > self.config.queue_bytes \
                    or len(self._queue) >= MAX_QUEUE_ITEMS:
                self.counters.dropped["queue_full"] += 1
                return
            self._queue.append(("set", (key, payload, checksum, prev, parent)))
            self._queue_bytes += nbytes + WRITE_ITEM_BYTES
            self._queue_cv.notify()

    def clear(self, namespace: str | None) -> None:
        """Delete a namespace's keys (every key under the prefix if None) in the background,
        after the writes queued before it; lookups of it skip L2 until then."""
        tag = None if namespace is None else namespace_tag(namespace)
        with self._lock:
            self._clearing[tag] += 1
            self._queue.append(("clear", tag))
            self._queue_cv.notify()

    def delete(self, keys: Sequence[StoreKey]) -> None:
        """Delete ``keys`` from L2 in the background, after the writes queued before it;
        until then promotions treat them as absent. Never blocks."""
        if not keys:
            return
        with self._lock:
            for promotion in self._promotions:  # one under way must not put them back into L1
                promotion.deleted.update(keys)
            cost = len(keys) * DELETE_ITEM_BYTES
            if self._queue_bytes + cost > self.config.queue_bytes or len(self._queue) >= MAX_QUEUE_ITEMS:
                self.counters.dropped_deletes += len(keys)
                return
            self._deleting.update(keys)
            self._queue.append(("delete", list(keys)))
            self._queue_bytes += cost
            self._queue_cv.notify()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has handled everything queued so far (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue_cv.wait(min(left, 0.05))
        return True

    def _write_loop(self) -> None:
        client = None
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._queue_cv.wait()
                if self._closed and not self._queue:
                    return
                batch, nbytes = [], 0
                while self._queue and (not batch or (self._queue[0][0] == "set" and batch[0][0] == "set"
                                                     and nbytes < WRITE_BATCH_BYTES)):
                    item = self._queue.popleft()
                    batch.append(item)
                    if item[0] == "set":
                        nbytes += memoryview(item[1][1]).nbytes + WRITE_ITEM_BYTES
                self._writing = True
                down = time.monotonic() < self._down_until
            try:
                if batch[0][0] == "clear":
                    client = client or self._make_client()
                    self._clear_now(client, batch[0][1])
                elif batch[0][0] == "delete":
                    if down:
                        with self._lock:
                            self.counters.dropped_deletes += len(batch[0][1])
                    else:
                        client = client or self._make_client()
                        self._delete_now(client, batch[0][1])
                elif down:
                    with self._lock:
                        self.counters.dropped["down"] += len(batch)
                else:
                    client = client or self._make_client()
                    self._set_now(client, [item[1] for item in batch])
            except Exception as e:  # noqa: BLE001 - any failure of the store is a dropped write
                client = None  # a fresh client next time: topology may have changed
                kind = self._kind(e)
                self._error(kind, e)
                if batch[0][0] == "set":
                    with self._lock:
                        self.counters.dropped["error"] += len(batch)
                elif batch[0][0] == "delete":
                    with self._lock:
                        self.counters.dropped_deletes += len(batch[0][1])
            finally:
                with self._lock:
                    if batch[0][0] == "set":
                        self._queue_bytes -= nbytes
                    elif batch[0][0] == "delete":
                        self._queue_bytes -= len(batch[0][1]) * DELETE_ITEM_BYTES
                        self._deleting.subtract(batch[0][1])
                        for k in batch[0][1]:
                            if self._deleting[k] <= 0:
                                del self._deleting[k]
                    else:
                        self._clearing[batch[0][1]] -= 1
                        if not self._clearing[batch[0][1]]:
                            del self._clearing[batch[0][1]]
                    self._writing = False
                    self._queue_cv.notify_all()

    def _set_now(self, client: Any, items: list[tuple[StoreKey, Any, bytes, bytes | None, bytes | None]]) -> None:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        total = 0
        for key, payload, checksum, prev, parent in items:
            value = encode_value(key, payload, checksum, prev, parent, key_bytes=self._mac_key)
            total += len(value)
            pipe.set(self.redis_key(key), value, ex=self.config.ttl_s)
        pipe.execute()
        self._observe("set", time.perf_counter() - t0, total)
        with self._lock:
            self.counters.written_objects += len(items)
            self.counters.written_bytes += total

    def _delete_now(self, client: Any, keys: list[StoreKey]) -> None:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)  # one key a command: a cluster refuses cross-slot UNLINK
        for k in keys:
            pipe.unlink(self.redis_key(k))
        removed = sum(pipe.execute())
        self._observe("delete", time.perf_counter() - t0, 0)
        with self._lock:
            self.counters.deleted_objects += removed

    def _clear_now(self, client: Any, tag: str | None) -> None:
        pattern = f"{self.config.prefix}:{tag}:*" if tag else f"{self.config.prefix}:*"
        t0 = time.perf_counter()
        if self.config.cluster:
            from redis.cluster import RedisCluster

            nodes = client.get_nodes() if isinstance(client, RedisCluster) else []
            primaries = [n for n in nodes if n.server_type == "primary"]
            scanners = [(lambda n=n: client.get_redis_connection(n)) for n in primaries]
        else:
            scanners = [lambda: client]
        removed = 0

        def unlink(node: Any, batch: list[bytes]) -> int:
            pipe = node.pipeline(transaction=False)  # one key a command: a cluster refuses cross-slot UNLINK
            for k in batch:
                pipe.unlink(k)
            return sum(pipe.execute())

        for get in scanners:
            node = get()
            batch: list[bytes] = []
            for k in node.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    removed += unlink(node, batch)
                    batch = []
            if batch:
                removed += unlink(node, batch)
        self._observe("clear", time.perf_counter() - t0, 0)
        logger.info("L2: cleared %d keys matching %s", removed, pattern)

    # --- promotion ---------------------------------------------------------------------------

    def promote(self, store: ObjectStore, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
                state_groups: Sequence[int], world_size: int, start_chunk: int,
                replicated_groups: Sequence[int]) -> tuple[int, bool]:
        """:meth:`begin_promote`, wait for it (at most its deadline), :meth:`finish_promote`."""
        promotion = self.begin_promote(store, namespace, hashes, attn_groups, state_groups, world_size, start_chunk,
                                       replicated_groups)
        if promotion.future is not None:
            try:
                promotion.future.result(timeout=max(0.0, promotion.deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - FutureTimeout, or the job's failure: finish_promote tells
                pass
        return self.finish_promote(promotion)

    def begin_promote(self, store: ObjectStore, namespace: str, hashes: Sequence[bytes],
                      attn_groups: Sequence[int], state_groups: Sequence[int], world_size: int, start_chunk: int,
                      replicated_groups: Sequence[int]) -> Promotion:
        """Start making L1 hold the deepest resume point that L1 and L2 hold together; never
        blocks. The caller answers its lookup from L1 after :meth:`finish_promote`, which it
        calls once ``future`` is done or ``deadline`` (``timeout_s`` from now) has passed;
        ``future`` None: nothing to wait for (L1 answers in full, or L2 is skipped).

        A lookup L1 answers in full touches nothing of L2. Promotions queue on the one
        reader thread, each within its own deadline, so a lookup waits for L2 only when it
        needs L2, and never past ``timeout_s``."""
        replicated = frozenset(replicated_groups)
        attn_ranks = group_ranks(attn_groups, world_size, replicated)
        state_ranks = group_ranks(state_groups, world_size, replicated)
        n = len(hashes)
        attn = {i: [(namespace, hashes[i], g, r) for g, r in attn_ranks] for i in range(start_chunk, n)}
        state = {i: [(namespace, hashes[i], g, r) for g, r in state_ranks] for i in range(start_chunk, n)}
        l1_depth = resume_depth(start_chunk, n, lambda i: all(k in store for k in attn[i]),
                                (lambda i: all(k in store for k in state[i])) if state_groups else None)
        if l1_depth == n or n <= start_chunk:
            return Promotion(store, l1_depth)
        with self._lock:
            skip = (time.monotonic() < self._down_until or (self._abandoned is not None and not self._abandoned.done())
                    or self._clearing[None] or self._clearing[namespace_tag(namespace)])
            if skip:
                self.counters.skipped += 1
                return Promotion(store, l1_depth)
            self.counters.lookups += 1
        absent, keep = [], []
        with self._lock:  # a key whose delete is still queued is not asked for: it would come back
            deleting = set(self._deleting) if self._deleting else frozenset()
        for i in range(start_chunk, n):
            for k in (*attn[i], *state[i]):
                if k in store:
                    keep.append(k)
                elif k not in deleting:
                    absent.append(k)
        promotion = Promotion(store, l1_depth, deadline=time.monotonic() + self.config.timeout_s, keep=keep)
        with self._lock:
            self._promotions.add(promotion)
        promotion.future = self._reader.submit(self._fetch_prefix, absent, attn, state, start_chunk, n,
                                               bool(state_groups), store, promotion.results, promotion.cancel)
        return promotion

    def finish_promote(self, promotion: Promotion) -> tuple[int, bool]:
        """Put into L1 what ``promotion`` verified (all of it, or what it had at its deadline);
        returns the depth L1 alone had and whether L2 was consulted (see :meth:`count_answer`)."""
        future = promotion.future
        if future is None:
            return promotion.l1_depth, False
        deadline_hit = not future.done()
        if deadline_hit:
            promotion.cancel.set()
            if not future.cancel():  # running: lookups skip L2 until the reader is free again
                with self._lock:
                    self._abandoned = future
            self._error("timeout", f"promotion past the {self.config.timeout_s:.1f}s deadline")
        elif not future.cancelled() and future.exception() is not None:  # the job reports store errors itself
            self._error(self._kind(future.exception()), future.exception())
        with self._lock:
            self._promotions.discard(promotion)
            # what was verified before the deadline, less what a client deleted meanwhile
            got = [r for r in promotion.results if r[0] not in promotion.deleted]
            if deadline_hit:
                self.counters.timeouts += 1
        # The L1 objects the resume goes through stay while the fetched ones make room:
        # evicting them (worthless leftovers of this very prefix, first in line) to store
        # the rest of it would leave the lookup nothing to answer.
        keep = set(promotion.keep)
        for key, payload, checksum, prev, parent in got:
            if promotion.store.put(key, payload, prev, checksum, parent, keep=keep) == p.PutResult.STORED:
                with self._lock:
                    self.counters.promoted_objects += 1
                    self.counters.promoted_bytes += payload.nbytes
        return promotion.l1_depth, True

    def probe(self, keys: Sequence[StoreKey]) -> set[StoreKey] | None:
        """Which of ``keys`` L2 holds, for a router's query (:mod:`cache_server.prefix_query`):
        one pipelined ``EXISTS`` per key on a client of its own (never the reader's, so a
        router never waits behind a promotion, nor delays one), bounded by ``timeout_s``.
        None when L2 is skipped (down after an error, a clear under way, another probe
        holding the client past the deadline) or fails; it moves no byte and touches no
        value (``EXISTS`` leaves Redis' LRU clock alone). The caller waits (a request worker,
        for the protocol's ``query``) at most ``timeout_s`` for the client and ``timeout_s``
        for the answer; after a timeout L2 is skipped for ``retry_after_s``, so a hung store
        costs each waiting query one timeout at most, then none."""
        if not keys:
            return set()
        with self._lock:
            if time.monotonic() < self._down_until or self._clearing[None] or any(
                    self._clearing[namespace_tag(ns)] for ns in {k.namespace for k in keys}):
                return None
            deleting = set(self._deleting) if self._deleting else frozenset()
        if not self._probe_lock.acquire(timeout=self.config.timeout_s):
            return None
        try:
            if time.monotonic() < self._down_until:  # the probe before ours timed out or failed
                return None
            if self._probe_client is None:
                self._probe_client = self._make_client()
            t0 = time.perf_counter()
            pipe = self._probe_client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k))
            found = {k for k, e in zip(keys, pipe.execute()) if e and k not in deleting}
            self._observe("exists", time.perf_counter() - t0, 0)
            return found
        except Exception as e:  # noqa: BLE001 - a store error: L2 unknown, never a failed query
            self._probe_client = None
            self._error(self._kind(e), e)
            return None
        finally:
            self._probe_lock.release()

    def count_answer(self, l1_depth: int, answered: int, consulted: bool) -> None:
        """Count a lookup that consulted L2 as a hit (answered deeper than L1 alone) or a miss."""
        if not consulted:
            return
        with self._lock:
            if answered > l1_depth:
                self.counters.hits += 1
            else:
                self.counters.misses += 1

    def _fetch_prefix(self, absent: list[StoreKey], attn: dict[int, list[StoreKey]],
                      state: dict[int, list[StoreKey]], start: int, n: int, with_state: bool,
                      store: ObjectStore, results: list[Fetched], cancel: threading.Event) -> None:
        """Reader thread: which absent objects L2 has, the deepest resume point, then fetch
        and verify the objects it needs, appending each verified one to ``results``."""
        try:
            if self._reader_client is None:
                self._reader_client = self._make_client()
            client = self._reader_client
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in absent:
                pipe.exists(self.redis_key(k))
            in_l2 = {k for k, e in zip(absent, pipe.execute()) if e}
            self._observe("exists", time.perf_counter() - t0, 0)
            depth = resume_depth(start, n, lambda i: all(k in store or k in in_l2 for k in attn[i]),
                                 (lambda i: all(k in store or k in in_l2 for k in state[i])) if with_state else None)
            if depth <= start:
                return
            need = [k for i in range(start, depth) for k in attn[i] if k in in_l2]
            need += [k for k in state[depth - 1] if k in in_l2] if with_state else []
            if self.config.debug_promote_delay_s:  # tests only: a window to kill the store in
                time.sleep(self.config.debug_promote_delay_s)
            for at in range(0, len(need), GET_BATCH):
                if cancel.is_set():
                    return
                batch = need[at:at + GET_BATCH]
                t0 = time.perf_counter()
                pipe = client.pipeline(transaction=False)
                for k in batch:
                    pipe.get(self.redis_key(k))
                values = pipe.execute()
                self._observe("get", time.perf_counter() - t0, sum(len(v) for v in values if v is not None))
                for k, value in zip(batch, values):
                    if value is None:  # evicted from L2 since EXISTS: the resume point is gone
                        return
                    decoded = decode_value(k, value, key_bytes=self._mac_key)
                    if isinstance(decoded, str):
                        self._refuse(decoded, self.redis_key(k))
                        client.delete(self.redis_key(k))
                        return
                    with self._lock:
                        results.append((k, *decoded))
        except Exception as e:  # noqa: BLE001 - a store error is a miss
            self._reader_client = None
            self._error(self._kind(e), e)

    # --- introspection -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                "url": self.config.redacted(), "cluster": self.config.cluster, "prefix": self.config.prefix,
                "timeout_s": self.config.timeout_s, "up": time.monotonic() >= self._down_until,
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "skipped": c.skipped,
                "timeouts": c.timeouts, "promoted_objects": c.promoted_objects,
                "promoted_bytes": c.promoted_bytes, "written_objects": c.written_objects,
                "written_bytes": c.written_bytes, "deleted_objects": c.deleted_objects,
                "dropped_deletes": c.dropped_deletes, "dropped": dict(c.dropped), "errors": dict(c.errors),
                "queue_items": len(self._queue), "queue_bytes": self._queue_bytes,
                "queue_capacity_bytes": self.config.queue_bytes,
            }

    def close(self, flush_s: float = 5.0) -> None:
        """Write what is queued (up to ``flush_s``), then stop both threads."""
        self.flush(flush_s)
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queue_cv.notify_all()
        self._reader.shutdown(wait=False, cancel_futures=True)
