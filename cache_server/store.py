"""The object store: exact byte accounting, LRU eviction of whole objects, leases.

An object is addressed by ``(namespace, chunk hash, group, rank)``. Attention groups need an
object for every chunk of a prefix; a recurrent-state group only at the chunk where the
prefix is resumed. The store does not know which group is which: a lookup says.

Snapshot-aware retention (seed 000: one long prompt's snapshots evicted everyone else's).
A state object may be stored with a link to the previous state of the same conversation
path (``prev``). A state with exactly one newer state after it on its path is *superseded*:
the newer one resumes everything it could, and more. One with two or more is a fork point
and is kept like any other. Under memory pressure superseded objects go first, oldest
first; only then does plain LRU order apply. Nothing is dropped before it must be.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache_server.protocol import PutResult

Payload = bytes | memoryview
StoreKey = tuple[str, bytes, int, int]  # (namespace, chunk hash, group, rank)


@dataclass
class _Entry:
    payload: Payload
    nbytes: int
    checksum: bytes = b""  # written by the storing client, returned to loaders as is
    leases: int = 0  # active leases holding this object; > 0 means not evictable
    children: set[bytes] | None = None  # hashes of newer states linked to this one by ``prev``

    @property
    def superseded(self) -> bool:
        return self.children is not None and len(self.children) == 1


@dataclass
class _Lease:
    expires_at: float
    keys: list[StoreKey]


@dataclass
class StoreCounters:
    """Monotonic counters, read by /status and /metrics."""

    lookups: int = 0
    lookup_hits: int = 0  # lookups that found a resume point past start_chunk
    lookup_misses: int = 0
    lookup_hit_chunks: int = 0
    get_hits: int = 0
    get_misses: int = 0
    puts_stored: int = 0
    puts_existing: int = 0
    puts_no_space: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    stored_bytes_total: int = 0
    served_bytes_total: int = 0


class ObjectStore:
    """Bounded in-memory store of opaque objects with LRU eviction and leases.

    Thread-safe: the ZMQ loop mutates it while the HTTP thread reads stats.
    """

    def __init__(self, capacity_bytes: int, max_object_bytes: int, lease_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_bytes <= 0 or max_object_bytes <= 0 or lease_ttl_s <= 0:
            raise ValueError("capacity, maximum object size and lease TTL must be positive")
        self.capacity_bytes = capacity_bytes
        self.max_object_bytes = max_object_bytes
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: OrderedDict[StoreKey, _Entry] = OrderedDict()  # oldest use first
        self._leases: dict[int, _Lease] = {}
        self._next_lease_id = 1
        self._used_bytes = 0
        self._bytes_by_group: dict[int, int] = defaultdict(int)
        self._objects_by_group: dict[int, int] = defaultdict(int)
        self.counters = StoreCounters()

    # --- writes --------------------------------------------------------------------------

    def put(self, key: StoreKey, payload: Payload, prev: bytes | None = None,
            checksum: bytes = b"") -> PutResult:
        """Store one object. Makes room by evicting whole unleased objects (superseded states
        first, then least recently used); if that cannot make room, evicts nothing and
        answers ``NO_SPACE``. ``prev`` links a state object to the previous state of the
        same path (same namespace, group and rank)."""
        nbytes = memoryview(payload).nbytes
        if nbytes > self.max_object_bytes or nbytes > self.capacity_bytes:
            return PutResult.TOO_LARGE
        with self._lock:
            self._expire_leases_locked()
            entry = self._objects.get(key)
            if entry is not None:
                self._objects.move_to_end(key)
                self.counters.puts_existing += 1
                return PutResult.EXISTS
            victims = self._pick_victims_locked(nbytes)
            if victims is None:
                self.counters.puts_no_space += 1
                return PutResult.NO_SPACE
            for victim in victims:
                self.counters.evicted_bytes += self._remove_locked(victim)
                self.counters.evictions += 1
            self._objects[key] = _Entry(payload, nbytes, checksum)
            if prev is not None and prev != key[1]:
                parent = self._objects.get((key[0], prev, key[2], key[3]))
                if parent is not None:
                    parent.children = (parent.children or set()) | {key[1]}
            self._used_bytes += nbytes
            self._bytes_by_group[key[2]] += nbytes
            self._objects_by_group[key[2]] += 1
            self.counters.puts_stored += 1
            self.counters.stored_bytes_total += nbytes
            return PutResult.STORED

    def _pick_victims_locked(self, nbytes: int) -> list[StoreKey] | None:
        need = self._used_bytes + nbytes - self.capacity_bytes
        victims: list[StoreKey] = []
        if need <= 0:
            return victims
        for superseded_pass in (True, False):
            for key, entry in self._objects.items():  # oldest first
                if entry.leases == 0 and entry.superseded == superseded_pass:
                    victims.append(key)
                    need -= entry.nbytes
                    if need <= 0:
                        return victims
        return None

    def _remove_locked(self, key: StoreKey) -> int:
        entry = self._objects.pop(key)
        self._used_bytes -= entry.nbytes
        self._bytes_by_group[key[2]] -= entry.nbytes
        self._objects_by_group[key[2]] -= 1
        return entry.nbytes

    def delete(self, key: StoreKey) -> bool:
        """Remove one object now, leased or not (a loader found it corrupt)."""
        with self._lock:
            if key not in self._objects:
                return False
            self._remove_locked(key)
            return True

    def clear(self, namespace: str | None = None) -> int:
        """Remove every object (of one namespace, if given), leased ones included, and drop
        the leases on them. Returns the number of objects removed."""
        with self._lock:
            keys = [k for k in self._objects if namespace is None or k[0] == namespace]
            for key in keys:
                self._remove_locked(key)
            gone = set(keys)
            for lease_id in [i for i, lease in self._leases.items() if any(k in gone for k in lease.keys)]:
                self._drop_lease_locked(lease_id)
            return len(keys)

    # --- reads ---------------------------------------------------------------------------

    def get(self, key: StoreKey) -> Payload | None:
        """The object's payload, or None. A hit makes the object the most recently used."""
        found = self.get_with_checksum(key)
        return None if found is None else found[0]

    def get_with_checksum(self, key: StoreKey) -> tuple[Payload, bytes] | None:
        """The object's payload and stored checksum, or None (see :meth:`get`)."""
        with self._lock:
            entry = self._objects.get(key)
            if entry is None:
                self.counters.get_misses += 1
                return None
            self._objects.move_to_end(key)
            self.counters.get_hits += 1
            self.counters.served_bytes_total += entry.nbytes
            return entry.payload, entry.checksum

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int, start_chunk: int = 0,
               lease: bool = True) -> tuple[int, int | None]:
        """Deepest resume point of a prefix, in chunks.

        Returns ``(j, lease_id)``: the largest ``j`` with ``start_chunk < j <= len(hashes)``
        such that every attention group has objects for chunks ``start_chunk .. j-1`` and
        every state group an object at chunk ``j-1``, for every rank below ``world_size``;
        ``(0, None)`` if there is none. The objects that resume needs are leased (not
        evictable) until :meth:`release` or the lease TTL.
        """
        if world_size < 1 or start_chunk < 0:
            raise ValueError("world_size must be >= 1 and start_chunk >= 0")
        if not attn_groups and not state_groups:
            raise ValueError("a lookup needs at least one group")
        ranks = range(world_size)
        with self._lock:
            self._expire_leases_locked()
            self.counters.lookups += 1

            def has(i: int, groups: Sequence[int]) -> bool:
                return all((namespace, hashes[i], g, r) in self._objects for g in groups for r in ranks)

            attn_depth = start_chunk  # chunks start_chunk..attn_depth-1 all present
            while attn_depth < len(hashes) and has(attn_depth, attn_groups):
                attn_depth += 1
            hit = attn_depth
            if state_groups:
                while hit > start_chunk and not has(hit - 1, state_groups):
                    hit -= 1
            if hit <= start_chunk:
                self.counters.lookup_misses += 1
                return 0, None
            self.counters.lookup_hits += 1
            self.counters.lookup_hit_chunks += hit - start_chunk
            keys = [(namespace, hashes[i], g, r) for i in range(start_chunk, hit) for g in attn_groups for r in ranks]
            keys += [(namespace, hashes[hit - 1], g, r) for g in state_groups for r in ranks]
            for key in keys:
                self._objects.move_to_end(key)
            if not lease:
                return hit, None
            lease_id = self._next_lease_id
            self._next_lease_id += 1
            for key in keys:
                self._objects[key].leases += 1
            self._leases[lease_id] = _Lease(self._clock() + self.lease_ttl_s, keys)
            self.counters.leases_granted += 1
            return hit, lease_id

    def release(self, lease_id: int) -> bool:
        """Release a lease; False if it was unknown or had already expired."""
        with self._lock:
            if lease_id not in self._leases:
                return False
            self._drop_lease_locked(lease_id)
            self.counters.leases_released += 1
            return True

    def expire_leases(self) -> int:
        """Drop leases past their TTL; returns how many."""
        with self._lock:
            return self._expire_leases_locked()

    def _expire_leases_locked(self) -> int:
        now = self._clock()
        expired = [i for i, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self._drop_lease_locked(lease_id)
        self.counters.leases_expired += len(expired)
        return len(expired)

    def _drop_lease_locked(self, lease_id: int) -> None:
        for key in self._leases.pop(lease_id).keys:
            entry = self._objects.get(key)
            if entry is not None:
                entry.leases -= 1

    # --- introspection -------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: StoreKey) -> bool:
        return key in self._objects

    def is_leased(self, key: StoreKey) -> bool:
        entry = self._objects.get(key)
        return entry is not None and entry.leases > 0

    def snapshot(self) -> dict[str, Any]:
        """A consistent JSON-able view for /status and /metrics."""
        with self._lock:
            c = self.counters
            return {
                "objects": len(self._objects),
                "used_bytes": self._used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "bytes_by_group": {str(g): b for g, b in sorted(self._bytes_by_group.items()) if b},
                "objects_by_group": {str(g): n for g, n in sorted(self._objects_by_group.items()) if n},
                "active_leases": len(self._leases),
                "leased_objects": sum(1 for e in self._objects.values() if e.leases),
                "superseded_objects": sum(1 for e in self._objects.values() if e.superseded),
                "lookups": c.lookups,
                "hits": c.lookup_hits,
                "misses": c.lookup_misses,
                "hit_chunks": c.lookup_hit_chunks,
                "get_hits": c.get_hits,
                "get_misses": c.get_misses,
                "puts_stored": c.puts_stored,
                "puts_existing": c.puts_existing,
                "puts_no_space": c.puts_no_space,
                "evictions": c.evictions,
                "evicted_bytes": c.evicted_bytes,
                "leases_granted": c.leases_granted,
                "leases_released": c.leases_released,
                "leases_expired": c.leases_expired,
                "stored_bytes_total": c.stored_bytes_total,
                "served_bytes_total": c.served_bytes_total,
            }
