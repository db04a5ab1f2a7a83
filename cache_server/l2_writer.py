"""The L2 tier's writer (:mod:`cache_server.l2` says why it writes through, and how deletes
and clears relate to promotions): one thread that drains a queue of writes, deletes and
clears, in order, bounded in bytes and in items, so the request loop never waits on L2 to
store.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.l2_link import L2Link
from cache_server.l2_values import HEADER_BYTES, encode_value, namespace_tag
from cache_server.layout import StoreKey

logger = logging.getLogger("glm_cache_server.l2")

MAX_VALUE_BYTES = 512 * (1 << 20) - 1024  # Redis' proto-max-bulk-len default is 512 MB
WRITE_BATCH_BYTES = 64 << 20
DELETE_ITEM_BYTES = 256  # what one key of a queued delete counts against the queue's bytes
WRITE_ITEM_BYTES = 512  # what one queued write counts beyond its payload (its tuple, key and metadata)
MAX_QUEUE_ITEMS = 65536  # writes and deletes waiting for the writer, whatever their bytes


class L2Writer:
    """The writer thread and its queue (``queue_mb`` of the ``--l2`` URL, and at most
    :data:`MAX_QUEUE_ITEMS` items), under the tier's lock (``link.lock``). ``on_delete(keys)``
    is called under that lock for each client delete, before it is queued (the tier keeps
    promotions under way from putting those keys into L1)."""

    def __init__(self, link: L2Link, on_delete: Callable[[Sequence[StoreKey]], None]) -> None:
        self._link = link
        self.config = link.config
        self.counters = link.counters
        self._lock = link.lock
        self._on_delete = on_delete
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()
        self.queue_bytes = 0
        self._queue_cv = threading.Condition(self._lock)
        self._clearing: collections.Counter[str | None] = collections.Counter()  # ns tag (None: all) -> jobs
        self._deleting: collections.Counter[StoreKey] = collections.Counter()  # key -> queued deletes of it
        self._closed = False
        self._writing = False  # the writer holds a batch it has taken off the queue
        self._thread = threading.Thread(target=self._write_loop, name="glm-l2-writer", daemon=True)
        self._thread.start()

    @property
    def queue_items(self) -> int:
        """Writes, deletes and clears waiting (the caller holds the lock)."""
        return len(self._queue)

    def clearing_locked(self, namespaces: Iterable[str]) -> bool:
        """Whether a clear of every namespace, or of one of ``namespaces``, is queued or under
        way (the caller holds the lock)."""
        return bool(self._clearing[None] or any(self._clearing[namespace_tag(ns)] for ns in namespaces))

    def deleting_locked(self) -> Collection[StoreKey]:
        """The keys of client deletes not made yet (the caller holds the lock)."""
        return set(self._deleting) if self._deleting else frozenset()

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
            if self.queue_bytes + nbytes + WRITE_ITEM_BYTES > self.config.queue_bytes \
                    or len(self._queue) >= MAX_QUEUE_ITEMS:
                self.counters.dropped["queue_full"] += 1
                return
            self._queue.append(("set", (key, payload, checksum, prev, parent)))
            self.queue_bytes += nbytes + WRITE_ITEM_BYTES
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
            self._on_delete(keys)
            cost = len(keys) * DELETE_ITEM_BYTES
            if self.queue_bytes + cost > self.config.queue_bytes or len(self._queue) >= MAX_QUEUE_ITEMS:
                self.counters.dropped_deletes += len(keys)
                return
            self._deleting.update(keys)
            self._queue.append(("delete", list(keys)))
            self.queue_bytes += cost
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

    def close(self, flush_s: float = 5.0) -> None:
        """Write what is queued (up to ``flush_s``), then stop the thread."""
        self.flush(flush_s)
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queue_cv.notify_all()

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
                down = self._link.down()
            try:
                if batch[0][0] == "clear":
                    client = client or self._link.make_client()
                    self._clear_now(client, batch[0][1])
                elif batch[0][0] == "delete":
                    if down:
                        with self._lock:
                            self.counters.dropped_deletes += len(batch[0][1])
                    else:
                        client = client or self._link.make_client()
                        self._delete_now(client, batch[0][1])
                elif down:
                    with self._lock:
                        self.counters.dropped["down"] += len(batch)
                else:
                    client = client or self._link.make_client()
                    self._set_now(client, [item[1] for item in batch])
            except Exception as e:  # noqa: BLE001 - any failure of the store is a dropped write
                client = None  # a fresh client next time: topology may have changed
                kind = self._link.kind(e)
                self._link.error(kind, e)
                if batch[0][0] == "set":
                    with self._lock:
                        self.counters.dropped["error"] += len(batch)
                elif batch[0][0] == "delete":
                    with self._lock:
                        self.counters.dropped_deletes += len(batch[0][1])
            finally:
                with self._lock:
                    if batch[0][0] == "set":
                        self.queue_bytes -= nbytes
                    elif batch[0][0] == "delete":
                        self.queue_bytes -= len(batch[0][1]) * DELETE_ITEM_BYTES
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
            value = encode_value(key, payload, checksum, prev, parent, key_bytes=self._link.mac_key)
            total += len(value)
            pipe.set(self._link.redis_key(key), value, ex=self.config.ttl_s)
        pipe.execute()
        self._link.observe("set", time.perf_counter() - t0, total)
        with self._lock:
            self.counters.written_objects += len(items)
            self.counters.written_bytes += total

    def _delete_now(self, client: Any, keys: list[StoreKey]) -> None:
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)  # one key a command: a cluster refuses cross-slot UNLINK
        for k in keys:
            pipe.unlink(self._link.redis_key(k))
        removed = sum(pipe.execute())
        self._link.observe("delete", time.perf_counter() - t0, 0)
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
        self._link.observe("clear", time.perf_counter() - t0, 0)
        logger.info("L2: cleared %d keys matching %s", removed, pattern)
