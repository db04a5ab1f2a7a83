"""The object store: exact byte accounting, eviction of whole objects, leases.

An object is addressed by ``(namespace, chunk hash, group, rank)`` (:mod:`cache_server.layout`
says which objects a prefix needs). The store does not know which group is which: a lookup
says, or an engine's declared layout does (:meth:`ObjectStore.set_layout`), which turns on
the namespace's chunk tree (:mod:`cache_server.chunk_tree`: which stored prefixes a lookup
can still resume).

Nothing is dropped before it must be: a put evicts whole unleased objects only when the
budget is full, in the order of :mod:`cache_server.eviction` (worthless, then superseded
states, then by recency and value per byte). A state object may be stored with a link to
the previous state of the same conversation path (``prev``): the store counts each state's
resident newer states, which says whether it is superseded. Whether a put can succeed is
known before anything is evicted, from the unleased byte total.

Lookups lease what their resume needs (:mod:`cache_server.leases`: the caps, and why). Each
object's entry, the byte and object counts by kind, group and namespace, and the counters
are :mod:`cache_server.store_accounts`.

Optional separate share for states (``state_share`` in (0, 1)): the declared state groups
of tracked namespaces may hold at most that fraction of the capacity and everything else
the rest; a put evicts only from its own share. Default None (one budget): measured by
``validation/bench_capacity.py`` (README): 0.3 resumed 2-4% more tokens per GB with 20k
sessions, 21% less with 100k sessions and 74% less in its seed-000 phase (the 308k-token
prompt no longer fits the rest); 0.5 less everywhere. One budget adapts to the mix; a
share has to be guessed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from cache_server.chunk_tree import UNKNOWN_PARENT, ChunkTree
from cache_server.eviction import (
    DEFAULT_VALUE_ALPHA,
    EVICTION_POLICIES,
    OTHER,
    PLAIN,
    STATE,
    SUPERSEDED,
    WORTHLESS,
    EvictionQueues,
    HeapItem,
)
from cache_server.layout import Layout, StoreKey, attention_depth, group_ranks, resume_depth
from cache_server.leases import ANY_OWNER, LeaseTable, Release
from cache_server.protocol import PutResult
from cache_server.store_accounts import Entry, Occupancy, Payload, StoreCounters

__all__ = ["ObjectStore", "StoreCounters"]


class ObjectStore:
    """Bounded in-memory store of opaque objects with eviction and leases.

    Thread-safe: the ZMQ loop mutates it while the HTTP thread reads stats.
    ``max_leased_bytes`` (default: the whole capacity, i.e. no cap beyond it) bounds the
    bytes pinned by leases; ``max_leases_per_owner`` (default: none) the leases one owner
    holds. Each object is charged its payload plus ``object_overhead_bytes`` (the server
    passes :data:`~cache_server.store_accounts.OBJECT_OVERHEAD_BYTES`) against the
    capacity, its kind's share and the leased-bytes cap: tiny objects fill the budget too,
    and are evicted like any other. ``used_bytes`` stays the payloads' sum;
    ``charged_bytes`` is what the budget holds.
    """

    def __init__(self, capacity_bytes: int, max_object_bytes: int, lease_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, *, max_leased_bytes: int | None = None,
                 max_leases_per_owner: int | None = None, eviction: str = "value",
                 value_alpha: float = DEFAULT_VALUE_ALPHA, state_share: float | None = None,
                 object_overhead_bytes: int = 0) -> None:
        if capacity_bytes <= 0 or max_object_bytes <= 0 or lease_ttl_s <= 0:
            raise ValueError("capacity, maximum object size and lease TTL must be positive")
        if not 0 <= object_overhead_bytes < capacity_bytes:
            raise ValueError("object_overhead_bytes must be >= 0 and below the capacity")
        self.object_overhead_bytes = object_overhead_bytes
        if (max_leased_bytes is not None and max_leased_bytes <= 0) or \
                (max_leases_per_owner is not None and max_leases_per_owner <= 0):
            raise ValueError("lease caps must be positive")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, not {eviction!r}")
        if value_alpha < 0:
            raise ValueError("value_alpha must be >= 0")
        if state_share is not None and not 0 < state_share < 1:
            raise ValueError("state_share must be in (0, 1) or None")
        self.eviction, self.value_alpha, self.state_share = eviction, value_alpha, state_share
        # Byte caps per kind (other, state); None: one budget for both.
        self._kind_caps: tuple[int, int] | None = None if state_share is None else (
            capacity_bytes - int(capacity_bytes * state_share), int(capacity_bytes * state_share))
        self.capacity_bytes = capacity_bytes
        self.max_object_bytes = max_object_bytes
        self.lease_ttl_s = lease_ttl_s
        self.max_leased_bytes = min(max_leased_bytes or capacity_bytes, capacity_bytes)
        self.max_leases_per_owner = max_leases_per_owner
        self._lock = threading.Lock()
        self._objects: dict[StoreKey, Entry] = {}
        self._eviction = EvictionQueues()  # unleased objects by kind and class, lazy deletion
        self._trees: dict[str, ChunkTree] = {}  # namespaces with a declared layout
        self._tick = 0
        self._held = Occupancy()  # bytes and objects, by kind, group and namespace
        self._superseded_objects = 0
        self.counters = StoreCounters()
        self._leases = LeaseTable(self._objects, lease_ttl_s, clock, self.max_leased_bytes, max_leases_per_owner,
                                  self.counters, unpinned=self._queue_locked)

    # --- writes --------------------------------------------------------------------------

    def set_layout(self, namespace: str, layout: Layout) -> None:
        """Declare a namespace's layout (the server does, from the engine's hello), which
        turns on its chunk tree, usable-prefix figures and worthless-first eviction. A
        namespace's layout is fixed by its fingerprint; a different one is only taken while
        the namespace holds no objects (its tree was built with the old counts)."""
        with self._lock:
            tree = self._trees.get(namespace)
            if tree is not None and (tree.layout == layout or self._held.objects_by_namespace.get(namespace)):
                return
            self._trees[namespace] = ChunkTree(namespace, layout, self.value_alpha, self._requeue_locked)

    def put(self, key: StoreKey, payload: Payload, prev: bytes | None = None,
            checksum: bytes = b"", parent: bytes | None = UNKNOWN_PARENT,
            keep: Collection[StoreKey] = ()) -> PutResult:
        """Store one object. Makes room by evicting whole unleased objects (worthless ones
        first, then superseded states, then least recently used), never one in ``keep``; if
        that cannot make room, evicts nothing and answers ``NO_SPACE``. ``prev`` links a
        state object to the previous state of the same path (same namespace, group and
        rank). ``parent`` is the hash of the chunk before this one (None: the first chunk;
        :data:`UNKNOWN_PARENT`: not said), which places the object in its namespace's chunk
        tree. ``keep``: what an L2 promotion's resume goes through in L1 (often worthless
        leftovers of that very prefix: the first candidates, were they not kept)."""
        key = StoreKey._make(key)  # read by field name below (callers may pass a plain tuple)
        nbytes = memoryview(payload).nbytes
        charge = nbytes + self.object_overhead_bytes
        if nbytes > self.max_object_bytes or charge > self.capacity_bytes:
            return PutResult.TOO_LARGE
        with self._lock:
            self._leases.expire()
            entry = self._objects.get(key)
            if entry is not None:
                self._touch_locked(key, entry)
                self.counters.puts_existing += 1
                return PutResult.EXISTS
            kind = self._kind_of(key)
            if self._kind_caps is None:  # one budget: any unleased object may go
                need = self._held.charged_bytes + charge - self.capacity_bytes
                evictable = self._held.charged_bytes - self._leases.leased_bytes
                victims_of: int | None = None
            else:  # its own share only
                need = self._held.kind_bytes[kind] + charge - self._kind_caps[kind]
                evictable = self._held.kind_bytes[kind] - self._leases.kind_leased[kind]
                victims_of = kind
            kept = [e for e in map(self._objects.get, keep)
                    if e is not None and not e.leases and victims_of in (None, e.kind)]
            if need > evictable - sum(e.charge for e in kept):  # even every unleased object is too little
                self.counters.puts_no_space += 1
                return PutResult.NO_SPACE
            passed_over: list[StoreKey] = []
            while need > 0:
                victim = self._remove_locked(self._pop_victim_locked(victims_of, keep, passed_over), evicted=True)
                need -= victim.charge
                self.counters.evicted_bytes += victim.nbytes
                self.counters.evictions += 1
            for k in passed_over:  # back in line: popping them off the heap was not evicting them
                self._queue_locked(k, self._objects[k])
            self._tick += 1
            entry = Entry(payload, nbytes, charge, self._tick, kind, self._eviction.inflation, checksum=checksum)
            self._objects[key] = entry
            self._held.add(key, entry)
            tree = self._trees.get(key.namespace)
            if tree is not None:
                tree.add(key.chunk, key.group, parent)
            self._queue_locked(key, entry)  # after the tree knows its node: its value per byte
            if prev is not None and prev != key.chunk:
                prev_key = StoreKey(key.namespace, prev, key.group, key.rank)
                prev_entry = self._objects.get(prev_key)
                if prev_entry is not None:
                    entry.prev_state = prev
                    self._set_next_states_locked(prev_key, prev_entry, (prev_entry.next_states or set()) | {key.chunk})
            self.counters.puts_stored += 1
            self.counters.stored_bytes_total += nbytes
            return PutResult.STORED

    def _kind_of(self, key: StoreKey) -> int:
        tree = self._trees.get(key.namespace)
        return STATE if tree is not None and key.group in tree.layout.state_groups else OTHER

    def _pop_victim_locked(self, kind: int | None = None, keep: Collection[StoreKey] = (),
                           passed_over: list[StoreKey] | None = None) -> StoreKey:
        """The next object to evict (:meth:`EvictionQueues.pop`), of ``kind`` only if given,
        not one of ``keep`` (those the queue offers are appended to ``passed_over``)."""

        def is_current(item: HeapItem, cls: int) -> bool:
            prio, tick, key = item
            entry = self._objects.get(key)
            current = entry is not None and entry.tick == tick and entry.prio == prio and entry.leases == 0 \
                and self._class_locked(key, entry) == cls
            if current and key in keep:
                if passed_over is not None:
                    passed_over.append(key)
                return False
            return current

        key = self._eviction.pop((OTHER, STATE) if kind is None else (kind,), is_current)
        if key is None:
            raise RuntimeError("store invariant broken: unleased bytes exist but no eviction candidate")
        return key

    def _density_locked(self, key: StoreKey, entry: Entry) -> float:
        """Value per byte of budget of one object (0: untracked, ``eviction="lru"``, or off the
        tree); its charge, at least 1 (an empty object under an overhead of 0)."""
        if self.eviction != "value":
            return 0.0
        tree = self._trees.get(key.namespace)
        return 0.0 if tree is None else tree.value_per_byte(key.chunk, key.group, max(1, entry.charge))

    def _class_locked(self, key: StoreKey, entry: Entry) -> int:
        tree = self._trees.get(key.namespace)
        if tree is not None and tree.worthless(key.chunk):
            return WORTHLESS
        return SUPERSEDED if entry.superseded else PLAIN

    def _queue_locked(self, key: StoreKey, entry: Entry) -> None:
        """Make an unleased object an eviction candidate at its priority (recomputed: its
        value may have changed since its last use)."""
        if entry.leases:
            return
        entry.prio = entry.base + self._density_locked(key, entry)
        self._eviction.push(entry.kind, self._class_locked(key, entry), (entry.prio, entry.tick, key))
        if self._eviction.needs_rebuild(len(self._objects)):
            self._eviction.rebuild((e.kind, self._class_locked(k, e), (e.prio, e.tick, k))
                                   for k, e in self._objects.items() if not e.leases)

    def _requeue_locked(self, key: StoreKey) -> bool:
        """Queue ``key`` again if it is resident (the chunk tree changed its class or value)."""
        entry = self._objects.get(key)
        if entry is None:
            return False
        self._queue_locked(key, entry)
        return True

    def _touch_locked(self, key: StoreKey, entry: Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        entry.base = self._eviction.inflation
        self._queue_locked(key, entry)

    def _set_next_states_locked(self, key: StoreKey, entry: Entry, next_states: set[bytes] | None) -> None:
        """Replace a state's newer states, keeping the superseded count and its class heap right."""
        was = entry.superseded
        entry.next_states = next_states or None
        if entry.superseded != was:
            self._superseded_objects += 1 if entry.superseded else -1
            self._queue_locked(key, entry)  # same last use, new class

    def _remove_locked(self, key: StoreKey, evicted: bool = False) -> Entry:
        entry = self._objects.pop(key)
        self._held.remove(key, entry)
        if entry.leases:
            self._leases.removed(entry)
        if entry.superseded:
            self._superseded_objects -= 1
        tree = self._trees.get(key.namespace)
        if tree is not None:
            tree.remove(key.chunk, key.group, evicted_newest=evicted and not entry.next_states)
        if entry.prev_state is not None:  # the previous state must not count a removed one as its successor
            prev_key = StoreKey(key.namespace, entry.prev_state, key.group, key.rank)
            prev_entry = self._objects.get(prev_key)
            if prev_entry is not None and prev_entry.next_states and key.chunk in prev_entry.next_states:
                self._set_next_states_locked(prev_key, prev_entry, prev_entry.next_states - {key.chunk})
        return entry

    def delete(self, key: StoreKey) -> bool:
        """Remove one object now, leased or not (a loader found it corrupt)."""
        with self._lock:
            if key not in self._objects:
                return False
            self._remove_locked(StoreKey._make(key))
            return True

    def clear(self, namespace: str | None = None) -> int:
        """Remove every object (of one namespace, if given), leased ones included, and drop
        the leases on them. Returns the number of objects removed."""
        with self._lock:
            keys = [k for k in self._objects if namespace is None or k.namespace == namespace]
            for ns, tree in self._trees.items():
                if namespace is None or ns == namespace:
                    tree.forget_objects()
            for key in keys:
                self._remove_locked(key)
            self._leases.drop_holding(set(keys))
            if not self._objects:
                self._eviction.clear()
            return len(keys)

    def clear_unleased(self, namespace: str | None = None) -> tuple[int, int]:
        """Remove every object (of one namespace, if given) that no live lease holds: an
        engine that was answered a hit still loads it. LMCache's clear without ``force``.
        Returns ``(removed, kept)``."""
        with self._lock:
            self._leases.expire()
            keys = [k for k, e in self._objects.items() if (namespace is None or k.namespace == namespace) and not e.leases]
            kept = sum(1 for k in self._objects if namespace is None or k.namespace == namespace) - len(keys)
            for key in keys:
                self._remove_locked(key)
            if not self._objects:
                self._eviction.clear()
            return len(keys), kept

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
            self._touch_locked(StoreKey._make(key), entry)
            self.counters.get_hits += 1
            self.counters.served_bytes_total += entry.nbytes
            return entry.payload, entry.checksum

    def _holds_locked(self, namespace: str, digest: bytes, ranked: list[tuple[int, int]]) -> bool:
        return all((namespace, digest, g, r) in self._objects for g, r in ranked)

    def lookup(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
               state_groups: Sequence[int], world_size: int, start_chunk: int = 0,
               lease: bool = True, owner: bytes | None = None,
               replicated_groups: Sequence[int] = ()) -> tuple[int, int | None]:
        """Deepest resume point of a prefix, in chunks.

        Returns ``(j, lease_id)``: the largest ``j`` with ``start_chunk < j <= len(hashes)``
        such that every attention group has objects for chunks ``start_chunk .. j-1`` and
        every state group an object at chunk ``j-1``, for every rank below ``world_size``
        (rank 0 only for ``replicated_groups``: groups identical on every tensor-parallel
        rank are stored once); ``(0, None)`` if there is none. The objects that resume needs
        are leased (not evictable) until :meth:`release` or the lease TTL, within the lease
        caps (``owner`` is who the per-owner cap counts against); a hit whose objects alone
        exceed the leased-bytes cap comes with ``lease_id`` None.
        """
        if world_size < 1 or start_chunk < 0:
            raise ValueError("world_size must be >= 1 and start_chunk >= 0")
        if not attn_groups and not state_groups:
            raise ValueError("a lookup needs at least one group")
        replicated = frozenset(replicated_groups)
        attn = group_ranks(attn_groups, world_size, replicated)
        state = group_ranks(state_groups, world_size, replicated)
        with self._lock:
            self._leases.expire()
            self.counters.lookups += 1
            hit = resume_depth(start_chunk, len(hashes), lambda i: self._holds_locked(namespace, hashes[i], attn),
                               (lambda i: self._holds_locked(namespace, hashes[i], state)) if state_groups else None)
            if hit <= start_chunk:
                self.counters.lookup_misses += 1
                return 0, None
            self.counters.lookup_hits += 1
            self.counters.lookup_hit_chunks += hit - start_chunk
            keys = [StoreKey(namespace, hashes[i], g, r) for i in range(start_chunk, hit) for g, r in attn]
            keys += [StoreKey(namespace, hashes[hit - 1], g, r) for g, r in state]
            for key in keys:
                if lease:  # about to be pinned: no heap item until the lease ends
                    self._tick += 1
                    self._objects[key].tick = self._tick
                    self._objects[key].base = self._eviction.inflation
                else:
                    self._touch_locked(key, self._objects[key])
            if not lease:
                return hit, None
            lease_id = self._leases.grant(keys, owner)
            if lease_id is None:
                for key in keys:
                    self._queue_locked(key, self._objects[key])
            return hit, lease_id

    def held(self, namespace: str, hashes: Sequence[bytes], attn_groups: Sequence[int],
             state_groups: Sequence[int], world_size: int, start_chunk: int = 0,
             replicated_groups: Sequence[int] = ()) -> tuple[int, bool]:
        """What a client need not send again: ``(d, state)`` where chunks ``[0, d)`` of the
        prefix ``hashes`` have an object of every attention group for every rank (rank 0
        only for ``replicated_groups``), and ``state`` says whether every state group's
        objects are present at chunk ``start_chunk - 1`` (False for ``start_chunk`` 0).
        Touches nothing (no LRU update, no counters)."""
        replicated = frozenset(replicated_groups)
        attn = group_ranks(attn_groups, world_size, replicated)
        state = group_ranks(state_groups, world_size, replicated)
        with self._lock:
            depth = attention_depth(0, len(hashes), lambda i: self._holds_locked(namespace, hashes[i], attn))
            at_start = 0 < start_chunk <= len(hashes) and bool(state) and \
                self._holds_locked(namespace, hashes[start_chunk - 1], state)
            return depth, at_start

    def declared_layout(self, namespace: str) -> Layout | None:
        """The layout a namespace's engine declared at hello (None: none declared)."""
        with self._lock:
            tree = self._trees.get(namespace)
            return None if tree is None else tree.layout

    def presence(self, namespace: str, hashes: Sequence[bytes], layout: Layout, max_missing: int = 0
                 ) -> tuple[int, list[StoreKey], list[StoreKey], int]:
        """A router's probe (:mod:`cache_server.prefix_query`): the resume depth L1 alone
        holds for the prefix ``hashes`` under ``layout`` (the lookup rule, nothing leased);
        and, when ``max_missing`` is not 0, the attention and state keys L1 lacks (what an L2
        probe asks about), in chunk order, for the first ``horizon`` chunks: as many whole
        chunks as keep the lists within ``max_missing`` keys. Returns ``(depth,
        missing_attn, missing_state, horizon)``. Touches nothing: no LRU update, no counter,
        so that routers asking about every request do not keep objects alive.

        Only the depth is found under the store's lock (it stops at the first chunk missing
        an object); the lists are built without it, each key tested once against the
        object table (a dict lookup is atomic under the GIL: an object put or evicted
        meanwhile is seen as before or after, as by a query a moment earlier or later)."""
        attn = layout.ranks(sorted(layout.attn_groups))
        state = layout.ranks(sorted(layout.state_groups))
        with self._lock:
            depth = resume_depth(0, len(hashes), lambda i: self._holds_locked(namespace, hashes[i], attn),
                                 (lambda i: self._holds_locked(namespace, hashes[i], state)) if state else None)
        missing_attn: list[StoreKey] = []
        missing_state: list[StoreKey] = []
        horizon = 0
        if max_missing:
            objects = self._objects
            for h in hashes:
                lack_attn = [k for g, r in attn if (k := StoreKey(namespace, h, g, r)) not in objects]
                lack_state = [k for g, r in state if (k := StoreKey(namespace, h, g, r)) not in objects]
                if len(missing_attn) + len(missing_state) + len(lack_attn) + len(lack_state) > max_missing:
                    break
                missing_attn += lack_attn
                missing_state += lack_state
                horizon += 1
        return depth, missing_attn, missing_state, horizon

    def release(self, lease_id: int) -> bool:
        """Release a lease, whoever holds it; False if it was unknown, had expired or was
        dropped by a cap."""
        return self.release_from(lease_id, ANY_OWNER) is Release.RELEASED

    def release_from(self, lease_id: int, owner: Any) -> Release:
        """Release a lease of ``owner``'s (the server passes the client's ZMQ identity):
        ``released``, ``unknown`` (never granted, expired, released, or dropped by a cap) or
        ``not_owner`` (another owner's lease: left as it is)."""
        with self._lock:
            return self._leases.release(lease_id, owner)

    def expire_leases(self) -> int:
        """Drop leases past their TTL; returns how many."""
        with self._lock:
            return self._leases.expire()

    # --- introspection -------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._held.used_bytes

    @property
    def leased_bytes(self) -> int:
        return self._leases.leased_bytes

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
        return self._held.bytes_by_namespace_group.get((namespace, group), 0)

    def group_names(self, namespace: str) -> dict[str, str]:
        """What each of a namespace's groups holds, as its engine named them at hello
        (``{"<group>": "<name>"}``; empty without a declared layout or names)."""
        with self._lock:
            tree = self._trees.get(namespace)
            return {} if tree is None else {str(g): n for g, n in tree.layout.group_names}

    def usable_prefixes(self, namespace: str) -> dict[str, int] | None:
        """The usable-prefix figures of a namespace with a declared layout (None otherwise):
        O(1), maintained as objects come and go."""
        with self._lock:
            tree = self._trees.get(namespace)
            return None if tree is None else tree.figures()

    def forget_namespace(self, namespace: str) -> bool:
        """Drop an empty namespace's declared layout and chunk tree (the namespace table
        forgot it); False, and nothing dropped, while it holds objects."""
        with self._lock:
            if self._held.objects_by_namespace.get(namespace):
                return False
            self._trees.pop(namespace, None)
            return True

    def tracked_namespaces(self) -> list[str]:
        """Namespaces with a declared layout (whose usable prefixes are tracked)."""
        with self._lock:
            return list(self._trees)

    def namespace_objects(self, namespace: str) -> int:
        """Objects resident in one namespace."""
        return self._held.objects_by_namespace.get(namespace, 0)

    def _group_name_locked(self, namespace: str, group: int) -> str:
        """What a namespace's group holds, as its engine named it at hello (``group_<id>``
        without a declared layout)."""
        tree = self._trees.get(namespace)
        return tree.layout.name_of(group) if tree is not None else f"group_{group}"

    def snapshot(self) -> dict[str, Any]:
        """A consistent JSON-able view for /status and /metrics; O(namespaces x groups), not O(objects)."""
        with self._lock:
            c = self.counters
            return {
                "objects": len(self._objects),
                "used_bytes": self._held.used_bytes,
                "charged_bytes": self._held.charged_bytes,
                "object_overhead_bytes": self.object_overhead_bytes,
                "capacity_bytes": self.capacity_bytes,
                "bytes_by_group": {str(g): b for g, b in sorted(self._held.bytes_by_group.items()) if b},
                "objects_by_group": {str(g): n for g, n in sorted(self._held.objects_by_group.items()) if n},
                "bytes_by_group_name": self._held.bytes_by_group_name(self._group_name_locked),
                "active_leases": len(self._leases),
                "leased_objects": self._leases.leased_objects,
                "leased_bytes": self._leases.leased_bytes,
                "max_leased_bytes": self.max_leased_bytes,
                "superseded_objects": self._superseded_objects,
                **c.snapshot(),
            }
