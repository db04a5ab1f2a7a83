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

Cost (review of issue 11: every put under pressure scanned all objects, every operation all
leases). Victims come from two heaps, one per class (superseded or not), of ``(last use,
key)`` items with lazy deletion: a touch pushes a fresh item and the old one goes stale, a
leased object's item is dropped when popped and pushed again when its last lease ends. A
put that must evict pops O(victims) items, O(log n) each, amortised over the pushes; the
heaps are rebuilt when stale items outnumber live ones. Whether a put can succeed is known
before anything is evicted, from the unleased byte total. Leases live in an ordered dict
in grant order, which with one TTL is expiry order, so expiry only looks at expired ones.

Leases are capped (review: 1000 lookups pinned the whole store and every put got NO_SPACE):
at most ``max_leased_bytes`` are pinned at once, and at most ``max_leases_per_owner`` leases
per owner (the server passes the client's ZMQ identity). Going over either drops the
oldest lease (of that owner, or of anyone), never refuses the newest: the newest lookup is
the one whose load is about to run, the oldest the most likely to be finished or leaked.
A lookup whose own objects exceed the byte cap gets its hit without a lease.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache_server.protocol import PutResult

Payload = bytes | memoryview
StoreKey = tuple[str, bytes, int, int]  # (namespace, chunk hash, group, rank)
_HeapItem = tuple[int, StoreKey]  # (tick of last use, key)


@dataclass(slots=True)
class _Entry:
    payload: Payload
    nbytes: int
    tick: int  # last use; orders eviction within a class (superseded or not)
    checksum: bytes = b""  # written by the storing client, returned to loaders as is
    leases: int = 0  # active leases holding this object; > 0 means not evictable
    children: set[bytes] | None = None  # hashes of resident newer states linked to this one by ``prev``
    parent: bytes | None = None  # hash of the state this one was linked to, when it was resident

    @property
    def superseded(self) -> bool:
        return self.children is not None and len(self.children) == 1


@dataclass(slots=True)
class _Lease:
    expires_at: float
    keys: list[StoreKey]
    owner: bytes | None


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
    leases_dropped_client_cap: int = 0  # oldest lease of an owner dropped for its newest
    leases_dropped_leased_bytes: int = 0  # oldest lease of anyone dropped to keep pinned bytes under the cap
    leases_refused: int = 0  # hits answered without a lease: their own objects exceed the byte cap
    stored_bytes_total: int = 0
    served_bytes_total: int = 0


class ObjectStore:
    """Bounded in-memory store of opaque objects with LRU eviction and leases.

    Thread-safe: the ZMQ loop mutates it while the HTTP thread reads stats.
    ``max_leased_bytes`` (default: the whole capacity, i.e. no cap beyond it) bounds the
    bytes pinned by leases; ``max_leases_per_owner`` (default: none) the leases one owner
    holds.
    """

    def __init__(self, capacity_bytes: int, max_object_bytes: int, lease_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, *, max_leased_bytes: int | None = None,
                 max_leases_per_owner: int | None = None) -> None:
        if capacity_bytes <= 0 or max_object_bytes <= 0 or lease_ttl_s <= 0:
            raise ValueError("capacity, maximum object size and lease TTL must be positive")
        if (max_leased_bytes is not None and max_leased_bytes <= 0) or \
                (max_leases_per_owner is not None and max_leases_per_owner <= 0):
            raise ValueError("lease caps must be positive")
        self.capacity_bytes = capacity_bytes
        self.max_object_bytes = max_object_bytes
        self.lease_ttl_s = lease_ttl_s
        self.max_leased_bytes = min(max_leased_bytes or capacity_bytes, capacity_bytes)
        self.max_leases_per_owner = max_leases_per_owner
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[StoreKey, _Entry] = {}
        # Eviction candidates, one heap per class: [plain LRU, superseded]. Lazy deletion.
        self._heaps: tuple[list[_HeapItem], list[_HeapItem]] = ([], [])
        self._tick = 0
        self._leases: OrderedDict[int, _Lease] = OrderedDict()  # grant order == expiry order
        self._leases_by_owner: dict[bytes, OrderedDict[int, None]] = {}
        self._next_lease_id = 1
        self._used_bytes = 0
        self._leased_bytes = 0  # bytes of objects with at least one lease
        self._leased_objects = 0
        self._superseded_objects = 0
        self._bytes_by_group: dict[int, int] = defaultdict(int)
        self._objects_by_group: dict[int, int] = defaultdict(int)
        self._objects_by_namespace: dict[str, int] = defaultdict(int)
        self._bytes_by_namespace_group: dict[tuple[str, int], int] = defaultdict(int)
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
                self._touch_locked(key, entry)
                self.counters.puts_existing += 1
                return PutResult.EXISTS
            need = self._used_bytes + nbytes - self.capacity_bytes
            if need > self._used_bytes - self._leased_bytes:  # even every unleased object is too little
                self.counters.puts_no_space += 1
                return PutResult.NO_SPACE
            while need > 0:
                freed = self._remove_locked(self._pop_victim_locked())
                need -= freed
                self.counters.evicted_bytes += freed
                self.counters.evictions += 1
            self._tick += 1
            entry = _Entry(payload, nbytes, self._tick, checksum)
            self._objects[key] = entry
            self._used_bytes += nbytes
            self._bytes_by_group[key[2]] += nbytes
            self._objects_by_group[key[2]] += 1
            self._objects_by_namespace[key[0]] += 1
            self._bytes_by_namespace_group[key[0], key[2]] += nbytes
            self._queue_locked(key, entry)
            if prev is not None and prev != key[1]:
                parent_key = (key[0], prev, key[2], key[3])
                parent = self._objects.get(parent_key)
                if parent is not None:
                    entry.parent = prev
                    self._set_children_locked(parent_key, parent, (parent.children or set()) | {key[1]})
            self.counters.puts_stored += 1
            self.counters.stored_bytes_total += nbytes
            return PutResult.STORED

    def _pop_victim_locked(self) -> StoreKey:
        """The next object to evict: the least recently used unleased superseded state, else
        the least recently used unleased object. Stale heap items are discarded on the way."""
        for superseded in (True, False):
            heap = self._heaps[superseded]
            while heap:
                tick, key = heapq.heappop(heap)
                entry = self._objects.get(key)
                if entry is not None and entry.tick == tick and entry.leases == 0 and entry.superseded == superseded:
                    return key
        raise RuntimeError("store invariant broken: unleased bytes exist but no eviction candidate")

    def _queue_locked(self, key: StoreKey, entry: _Entry) -> None:
        """Make an unleased object an eviction candidate at its last-use position."""
        if entry.leases:
            return
        heapq.heappush(self._heaps[entry.superseded], (entry.tick, key))
        if len(self._heaps[0]) + len(self._heaps[1]) > 2 * len(self._objects) + 1024:
            self._rebuild_heaps_locked()

    def _rebuild_heaps_locked(self) -> None:
        """Drop stale items: O(n), once per at least n pushes."""
        heaps: tuple[list[_HeapItem], list[_HeapItem]] = ([], [])
        for key, entry in self._objects.items():
            if not entry.leases:
                heaps[entry.superseded].append((entry.tick, key))
        for heap in heaps:
            heapq.heapify(heap)
        self._heaps = heaps

    def _touch_locked(self, key: StoreKey, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        self._queue_locked(key, entry)

    def _set_children_locked(self, key: StoreKey, entry: _Entry, children: set[bytes] | None) -> None:
        """Replace a state's children, keeping the superseded count and its class heap right."""
        was = entry.superseded
        entry.children = children or None
        if entry.superseded != was:
            self._superseded_objects += 1 if entry.superseded else -1
            self._queue_locked(key, entry)  # same last use, new class

    def _remove_locked(self, key: StoreKey) -> int:
        entry = self._objects.pop(key)
        self._used_bytes -= entry.nbytes
        for counts, label, amount in ((self._bytes_by_group, key[2], entry.nbytes),
                                      (self._objects_by_group, key[2], 1),
                                      (self._objects_by_namespace, key[0], 1),
                                      (self._bytes_by_namespace_group, (key[0], key[2]), entry.nbytes)):
            counts[label] -= amount
            if not counts[label]:  # a table per label ever seen would grow without bound
                del counts[label]
        if entry.leases:
            self._leased_bytes -= entry.nbytes
            self._leased_objects -= 1
        if entry.superseded:
            self._superseded_objects -= 1
        if entry.parent is not None:  # a parent must not count an evicted state as its successor
            parent_key = (key[0], entry.parent, key[2], key[3])
            parent = self._objects.get(parent_key)
            if parent is not None and parent.children and key[1] in parent.children:
                self._set_children_locked(parent_key, parent, parent.children - {key[1]})
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
            if not self._objects:
                self._heaps = ([], [])
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
            self._touch_locked(key, entry)
            self.counters.get_hits += 1
            self.counters.served_bytes_total += entry.nbytes
            return entry.payload, entry.checksum

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int, start_chunk: int = 0,
               lease: bool = True, owner: bytes | None = None,
               replicated_groups: Sequence[int] = ()) -> tuple[int, int | None]:
        """Deepest resume point of a prefix, in chunks.

        Returns ``(j, lease_id)``: the largest ``j`` with ``start_chunk < j <= len(hashes)``
        such that every attention group has objects for chunks ``start_chunk .. j-1`` and
        every state group an object at chunk ``j-1``, for every rank below ``world_size``
        (rank 0 only for ``replicated_groups``: groups identical on every tensor-parallel
        rank are stored once); ``(0, None)`` if there is none. The objects that resume needs are leased (not
        evictable) until :meth:`release` or the lease TTL, within the lease caps (``owner``
        is who the per-owner cap counts against); a hit whose objects alone exceed the
        leased-bytes cap comes with ``lease_id`` None.
        """
        if world_size < 1 or start_chunk < 0:
            raise ValueError("world_size must be >= 1 and start_chunk >= 0")
        if not attn_groups and not state_groups:
            raise ValueError("a lookup needs at least one group")
        replicated = frozenset(replicated_groups)

        def ranks_of(g: int) -> range:
            return range(1) if g in replicated else range(world_size)

        with self._lock:
            self._expire_leases_locked()
            self.counters.lookups += 1

            def has(i: int, groups: Sequence[int]) -> bool:
                return all((namespace, hashes[i], g, r) in self._objects for g in groups for r in ranks_of(g))

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
            keys = [(namespace, hashes[i], g, r) for i in range(start_chunk, hit) for g in attn_groups
                    for r in ranks_of(g)]
            keys += [(namespace, hashes[hit - 1], g, r) for g in state_groups for r in ranks_of(g)]
            for key in keys:
                if lease:  # about to be pinned: no heap item until the lease ends
                    self._tick += 1
                    self._objects[key].tick = self._tick
                else:
                    self._touch_locked(key, self._objects[key])
            if not lease:
                return hit, None
            lease_id = self._grant_lease_locked(keys, owner)
            if lease_id is None:
                for key in keys:
                    self._queue_locked(key, self._objects[key])
            return hit, lease_id

    def _grant_lease_locked(self, keys: list[StoreKey], owner: bytes | None) -> int | None:
        if sum(self._objects[k].nbytes for k in set(keys)) > self.max_leased_bytes:
            self.counters.leases_refused += 1
            return None
        if owner is not None and self.max_leases_per_owner is not None:
            mine = self._leases_by_owner.get(owner)
            while mine and len(mine) >= self.max_leases_per_owner:
                self._drop_lease_locked(next(iter(mine)))
                self.counters.leases_dropped_client_cap += 1
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        for key in keys:
            entry = self._objects[key]
            if not entry.leases:
                self._leased_bytes += entry.nbytes
                self._leased_objects += 1
            entry.leases += 1
        self._leases[lease_id] = _Lease(self._clock() + self.lease_ttl_s, keys, owner)
        if owner is not None:
            self._leases_by_owner.setdefault(owner, OrderedDict())[lease_id] = None
        # This lease alone fits, so the oldest ones are dropped before it would be.
        while self._leased_bytes > self.max_leased_bytes:
            self._drop_lease_locked(next(iter(self._leases)))
            self.counters.leases_dropped_leased_bytes += 1
        self.counters.leases_granted += 1
        return lease_id

    def release(self, lease_id: int) -> bool:
        """Release a lease; False if it was unknown, had expired or was dropped by a cap."""
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
        expired = 0
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))  # the oldest grant expires first
            if lease.expires_at > now:
                break
            self._drop_lease_locked(lease_id)
            expired += 1
        self.counters.leases_expired += expired
        return expired

    def _drop_lease_locked(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease.owner is not None:
            mine = self._leases_by_owner[lease.owner]
            del mine[lease_id]
            if not mine:
                del self._leases_by_owner[lease.owner]
        for key in lease.keys:
            entry = self._objects.get(key)
            if entry is not None:
                entry.leases -= 1
                if not entry.leases:
                    self._leased_bytes -= entry.nbytes
                    self._leased_objects -= 1
                    self._queue_locked(key, entry)  # back in line at its last use

    # --- introspection -------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def leased_bytes(self) -> int:
        return self._leased_bytes

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: StoreKey) -> bool:
        return key in self._objects

    def is_leased(self, key: StoreKey) -> bool:
        entry = self._objects.get(key)
        return entry is not None and entry.leases > 0

    def is_superseded(self, key: StoreKey) -> bool:
        entry = self._objects.get(key)
        return entry is not None and entry.superseded

    def namespace_group_bytes(self, namespace: str, group: int) -> int:
        """Resident bytes of one group in one namespace."""
        return self._bytes_by_namespace_group.get((namespace, group), 0)

    def namespace_objects(self, namespace: str) -> int:
        """Objects resident in one namespace."""
        return self._objects_by_namespace.get(namespace, 0)

    def snapshot(self) -> dict[str, Any]:
        """A consistent JSON-able view for /status and /metrics; O(groups), not O(objects)."""
        with self._lock:
            c = self.counters
            return {
                "objects": len(self._objects),
                "used_bytes": self._used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "bytes_by_group": {str(g): b for g, b in sorted(self._bytes_by_group.items()) if b},
                "objects_by_group": {str(g): n for g, n in sorted(self._objects_by_group.items()) if n},
                "active_leases": len(self._leases),
                "leased_objects": self._leased_objects,
                "leased_bytes": self._leased_bytes,
                "max_leased_bytes": self.max_leased_bytes,
                "superseded_objects": self._superseded_objects,
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
                "leases_dropped_client_cap": c.leases_dropped_client_cap,
                "leases_dropped_leased_bytes": c.leases_dropped_leased_bytes,
                "leases_refused": c.leases_refused,
                "stored_bytes_total": c.stored_bytes_total,
                "served_bytes_total": c.served_bytes_total,
            }
