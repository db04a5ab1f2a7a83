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
  A delete costs :data:`~cache_server.l2_writer.DELETE_ITEM_BYTES` of the queue per key;
  one that does not fit, or that the writer cannot make (L2 down, an error), is counted
  (``dropped_deletes``).
* **The writer's queue is bounded in bytes and in items.** A write counts its payload plus
  :data:`~cache_server.l2_writer.WRITE_ITEM_BYTES` (its own bookkeeping) against
  ``queue_mb``, and at most :data:`~cache_server.l2_writer.MAX_QUEUE_ITEMS` writes and
  deletes wait: a flood of tiny objects while Redis is slow is dropped (``queue_full``)
  like a flood of large ones, not queued without bound.
* Objects over ``max_value_bytes`` (Redis refuses values over 512 MB) are not written to L2
  (counted as dropped ``too_large``); the server's default largest object is 256 MiB.

The writer is :mod:`cache_server.l2_writer`; what the reader, the writer and routers'
probes share (clients, keys, counters, the back-off after an error) :mod:`cache_server.l2_link`;
the ``--l2`` URL and its parameters :mod:`cache_server.l2_config`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cache_server import protocol as p
from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.l2_config import L2Config
from cache_server.l2_link import L2Link, redis_key
from cache_server.l2_values import decode_value
from cache_server.l2_writer import L2Writer
from cache_server.layout import StoreKey, group_ranks, resume_depth
from cache_server.store import ObjectStore

logger = logging.getLogger("glm_cache_server.l2")

__all__ = ["L2Tier", "Promotion", "redis_key"]

GET_BATCH = 4  # objects per pipelined GET: a 40 MB state object is one of these

Fetched = tuple[StoreKey, memoryview, bytes, bytes | None, bytes | None]  # key, payload, checksum, prev, parent


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
    (write-through, deletes and clears: :class:`~cache_server.l2_writer.L2Writer`), each
    with its own client, both bounded by timeouts. ``observe(op, seconds, bytes moved)``
    is called per round trip (the latency histogram and L2 throughput)."""

    def __init__(self, config: L2Config, observe: Callable[[str, float, int], None] | None = None) -> None:
        self.link = L2Link(config, observe)  # clients, keys, counters, the back-off after errors
        self.config = config
        self.counters = self.link.counters
        self._lock = self.link.lock  # the counters' and the writer's too
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-l2-reader")
        self._reader_client: Any = None
        self._probe_client: Any = None  # routers' queries (probe): EXISTS only
        self._probe_lock = threading.Lock()
        self._abandoned: Future[Any] | None = None  # a promotion past its deadline still running
        self._promotions: set[Promotion] = set()  # begun, not yet finished
        self._refusal_logged: dict[str, float] = {}
        self.writer = L2Writer(self.link, on_delete=self._mark_deleted)  # write-through, deletes, clears

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

    # --- write-through (cache_server.l2_writer) ---------------------------------------------

    def write(self, key: StoreKey, payload: bytes | memoryview, checksum: bytes, prev: bytes | None,
              parent: bytes | None = UNKNOWN_PARENT) -> None:
        """Queue one stored object for L2 (:meth:`L2Writer.write`); never blocks."""
        self.writer.write(key, payload, checksum, prev, parent)

    def clear(self, namespace: str | None) -> None:
        """Delete a namespace's keys (all if None) in the background (:meth:`L2Writer.clear`)."""
        self.writer.clear(namespace)

    def delete(self, keys: Sequence[StoreKey]) -> None:
        """Delete ``keys`` from L2 in the background (:meth:`L2Writer.delete`); never blocks."""
        self.writer.delete(keys)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has handled everything queued so far (tests, shutdown)."""
        return self.writer.flush(timeout_s)

    def _mark_deleted(self, keys: Sequence[StoreKey]) -> None:
        """A client deleted ``keys`` (the writer calls this under the lock): a promotion
        under way must not put them back into L1."""
        for promotion in self._promotions:
            promotion.deleted.update(keys)

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
            skip = (self.link.down() or (self._abandoned is not None and not self._abandoned.done())
                    or self.writer.clearing_locked((namespace,)))
            if skip:
                self.counters.skipped += 1
                return Promotion(store, l1_depth)
            self.counters.lookups += 1
        absent, keep = [], []
        with self._lock:  # a key whose delete is still queued is not asked for: it would come back
            deleting = self.writer.deleting_locked()
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
            self.link.error("timeout", f"promotion past the {self.config.timeout_s:.1f}s deadline")
        elif not future.cancelled() and future.exception() is not None:  # the job reports store errors itself
            self.link.error(self.link.kind(future.exception()), future.exception())
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
            if self.link.down() or self.writer.clearing_locked({k.namespace for k in keys}):
                return None
            deleting = self.writer.deleting_locked()
        if not self._probe_lock.acquire(timeout=self.config.timeout_s):
            return None
        try:
            if self.link.down():  # the probe before ours timed out or failed
                return None
            if self._probe_client is None:
                self._probe_client = self.link.make_client()
            t0 = time.perf_counter()
            pipe = self._probe_client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.link.redis_key(k))
            found = {k for k, e in zip(keys, pipe.execute()) if e and k not in deleting}
            self.link.observe("exists", time.perf_counter() - t0, 0)
            return found
        except Exception as e:  # noqa: BLE001 - a store error: L2 unknown, never a failed query
            self._probe_client = None
            self.link.error(self.link.kind(e), e)
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
                self._reader_client = self.link.make_client()
            client = self._reader_client
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in absent:
                pipe.exists(self.link.redis_key(k))
            in_l2 = {k for k, e in zip(absent, pipe.execute()) if e}
            self.link.observe("exists", time.perf_counter() - t0, 0)
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
                    pipe.get(self.link.redis_key(k))
                values = pipe.execute()
                self.link.observe("get", time.perf_counter() - t0, sum(len(v) for v in values if v is not None))
                for k, value in zip(batch, values):
                    if value is None:  # evicted from L2 since EXISTS: the resume point is gone
                        return
                    decoded = decode_value(k, value, key_bytes=self.link.mac_key)
                    if isinstance(decoded, str):
                        self._refuse(decoded, self.link.redis_key(k))
                        client.delete(self.link.redis_key(k))
                        return
                    with self._lock:
                        results.append((k, *decoded))
        except Exception as e:  # noqa: BLE001 - a store error is a miss
            self._reader_client = None
            self.link.error(self.link.kind(e), e)

    # --- introspection -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            c = self.counters
            return {
                "url": self.config.redacted(), "cluster": self.config.cluster, "prefix": self.config.prefix,
                "timeout_s": self.config.timeout_s, "up": not self.link.down(),
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "skipped": c.skipped,
                "timeouts": c.timeouts, "promoted_objects": c.promoted_objects,
                "promoted_bytes": c.promoted_bytes, "written_objects": c.written_objects,
                "written_bytes": c.written_bytes, "deleted_objects": c.deleted_objects,
                "dropped_deletes": c.dropped_deletes, "dropped": dict(c.dropped), "errors": dict(c.errors),
                "queue_items": self.writer.queue_items, "queue_bytes": self.writer.queue_bytes,
                "queue_capacity_bytes": self.config.queue_bytes,
            }

    def close(self, flush_s: float = 5.0) -> None:
        """Write what is queued (up to ``flush_s``), then stop both threads."""
        self.writer.close(flush_s)
        self._reader.shutdown(wait=False, cancel_futures=True)
