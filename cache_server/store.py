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

Usable prefixes (issue 12, seed 000: the cache report counted bytes while every session
had lost the snapshot it needed). A namespace whose engine declared its layout
(:meth:`set_layout`: attention and state groups, TP world size, replicated groups, chunk
tokens) gets a chunk tree: one node per chunk hash, linked to the previous chunk by the
``parent`` its objects were put with. A node is *resumable* when it and every ancestor
hold all their attention objects and it holds every state object (what :meth:`lookup`
needs to stop there); ``covered`` counts the resumable nodes at or below each node, kept
incrementally (a walk up the path when a state completes or breaks, a walk down the
subtree only when a path's attention breaks or heals). From it, per namespace and O(1)
to read: resumable tokens (chunks on some resumable path, times the chunk size),
resumable states, states held, and states evicted while still the newest of their path.

Eviction classes, in order, each a heap of ``(last use, key)`` as above:
0. worthless: objects of a node that was once on a resumable path and no longer is (its
   states were all evicted, or an attention chunk above it went). Nothing can resume
   through them, so they go before anything that still can. A node that was never on a
   resumable path is *pending* (a prompt whose state has not been saved yet, or a TP
   rank's state that arrived before rank 0's attention) and stays in class 2: evicting it
   as worthless would make every new conversation's first chunks the first victims.
1. superseded states (see above).
2. everything else.

Within a class (issue 12, Marconi arXiv 2411.19379: FLOP-aware eviction), with
``eviction="value"`` (the default) objects are ordered GreedyDual-style: a touch gives an
object the priority ``L + value / bytes``, the lowest priority goes first, and ``L`` rises
to the priority of each class-2 object evicted. ``value`` is the prefill a resume saves, in
token-equivalents: a state at depth ``d`` chunks resumes ``T = d * C`` tokens, and
``saved(T) = T * (1 + value_alpha * T)`` (KDA and the MLPs grow linearly with ``T``,
attention over the prefix quadratically; the default ``value_alpha = 1/65536`` says the
quadratic part equals the linear part at 64k tokens). A state's bytes are its own (the
attention above it is shared and counted with the attention objects); an attention object's
value is the largest ``saved`` of the resumable states at or below its chunk (kept on the
walk up the path that already counts them; not lowered when a deeper state goes while a
shallower one below stays, only when the chunk stops being covered), so a path's attention
(small, worth its deepest state) outlives its states, and once the last state below goes it
is class 0. So under pressure a deep state outlives a shallow one touched at the same time,
and recency still wins in the end: ``L`` catches up with every priority. ``L`` follows
class-2 evictions only: worthless or superseded objects are not the frontier.
Untracked namespaces have value 0: their order is exactly LRU. ``eviction="lru"``: value 0
everywhere (plain LRU within each class, the order before issue 12's value ordering).

Optional separate share for states (``state_share`` in (0, 1)): the declared state groups
of tracked namespaces may hold at most that fraction of the capacity and everything else
the rest; a put evicts only from its own share. Default None (one budget): measured by
``validation/bench_capacity.py`` (README): 0.3 resumed 2-4% more tokens per GB with 20k
sessions, 21% less with 100k sessions and 74% less in seed 000 (the 308k prompt no longer
fits the rest); 0.5 less everywhere. One budget adapts to the mix; a share has to be guessed.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cache_server.protocol import PutResult

Payload = bytes | memoryview
StoreKey = tuple[str, bytes, int, int]  # (namespace, chunk hash, group, rank)
_HeapItem = tuple[float, int, StoreKey]  # (priority, tick of last use, key)
UNKNOWN_PARENT = b""  # ``parent`` of an object whose writer did not say which chunk precedes it
_WORTHLESS, _SUPERSEDED, _PLAIN = 0, 1, 2  # eviction classes, evicted in this order
_OTHER, _STATE = 0, 1  # kinds: a declared state group of a tracked namespace, or anything else
EVICTION_POLICIES = ("value", "lru")
DEFAULT_VALUE_ALPHA = 1 / 65536  # per token: attention's quadratic prefill cost equals the rest at 64k


def _empty_heaps() -> tuple[tuple[list[_HeapItem], ...], ...]:
    return tuple(([], [], []) for _ in (_OTHER, _STATE))


@dataclass(slots=True)
class _Entry:
    payload: Payload
    nbytes: int
    tick: int  # last use; breaks priority ties (LRU)
    kind: int = _OTHER  # _STATE: counts against the state share
    base: float = 0.0  # the store's L (inflation) at last use
    prio: float = 0.0  # base + value per byte when last queued; orders eviction within a class
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


@dataclass(frozen=True, slots=True)
class Layout:
    """What an engine declared about a namespace at hello: which groups are attention
    (needed for every chunk) and which are state (needed at the resume point), on how
    many ranks, which are stored once, and the chunk size in tokens."""

    attn_groups: frozenset[int]
    state_groups: frozenset[int]
    world_size: int
    replicated_groups: frozenset[int]
    chunk_tokens: int

    def copies(self, groups: frozenset[int]) -> int:
        return sum(1 if g in self.replicated_groups else self.world_size for g in groups)


@dataclass(slots=True)
class _Node:
    """One chunk of a tracked namespace's chunk tree (see the module docstring)."""

    parent: bytes | None = None  # previous chunk's hash; None: the first chunk
    parent_known: bool = False
    children: set[bytes] = field(default_factory=set)  # nodes whose parent is this one
    attn: int = 0  # resident attention objects
    state: int = 0  # resident state objects
    chain_ok: bool = False  # this node and every ancestor hold all their attention
    covered: int = 0  # resumable nodes at or below this one
    claimed: bool = False  # was covered once: losing that makes its objects worthless
    resumable: bool = False
    depth: int = 0  # chunks from the first to this one, inclusive; valid while chain_ok
    value: float = 0.0  # largest saved() of a resumable node at or below (see the module docstring)


@dataclass
class _NamespaceUsage:
    """Incremental usable-prefix figures of one tracked namespace."""

    covered_nodes: int = 0  # chunks on at least one resumable path
    resumable_states: int = 0  # nodes a lookup can stop at
    states_held: int = 0  # nodes with every state object
    states_evicted_newest: int = 0  # complete states evicted with no newer state on their path
    worthless_objects: int = 0  # objects of claimed, uncovered nodes (class 0)


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
                 max_leases_per_owner: int | None = None, eviction: str = "value",
                 value_alpha: float = DEFAULT_VALUE_ALPHA, state_share: float | None = None) -> None:
        if capacity_bytes <= 0 or max_object_bytes <= 0 or lease_ttl_s <= 0:
            raise ValueError("capacity, maximum object size and lease TTL must be positive")
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
        self._kind_bytes = [0, 0]
        self._kind_leased = [0, 0]
        self._inflation = 0.0  # GreedyDual's L
        self.capacity_bytes = capacity_bytes
        self.max_object_bytes = max_object_bytes
        self.lease_ttl_s = lease_ttl_s
        self.max_leased_bytes = min(max_leased_bytes or capacity_bytes, capacity_bytes)
        self.max_leases_per_owner = max_leases_per_owner
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[StoreKey, _Entry] = {}
        # Eviction candidates, one heap per kind (other, state) and class (worthless,
        # superseded, plain). Lazy deletion.
        self._heaps: tuple[tuple[list[_HeapItem], ...], ...] = _empty_heaps()
        self._layouts: dict[str, Layout] = {}
        self._nodes: dict[str, dict[bytes, _Node]] = {}  # tracked namespaces' chunk trees
        self._usage: dict[str, _NamespaceUsage] = {}
        self._heap_items = 0  # items in all heaps, stale ones included
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

    def set_layout(self, namespace: str, layout: Layout) -> None:
        """Declare a namespace's layout (the server does, from the engine's hello), which
        turns on its chunk tree, usable-prefix figures and worthless-first eviction. A
        namespace's layout is fixed by its fingerprint; a different one is only taken while
        the namespace holds no objects (its tree was built with the old counts)."""
        with self._lock:
            old = self._layouts.get(namespace)
            if old == layout or (old is not None and self._objects_by_namespace.get(namespace)):
                return
            self._layouts[namespace] = layout
            self._nodes[namespace] = {}
            self._usage[namespace] = _NamespaceUsage()

    def put(self, key: StoreKey, payload: Payload, prev: bytes | None = None,
            checksum: bytes = b"", parent: bytes | None = UNKNOWN_PARENT) -> PutResult:
        """Store one object. Makes room by evicting whole unleased objects (worthless ones
        first, then superseded states, then least recently used); if that cannot make room,
        evicts nothing and answers ``NO_SPACE``. ``prev`` links a state object to the
        previous state of the same path (same namespace, group and rank). ``parent`` is the
        hash of the chunk before this one (None: the first chunk; :data:`UNKNOWN_PARENT`:
        not said), which places the object in its namespace's chunk tree."""
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
            kind = self._kind_of(key)
            if self._kind_caps is None:  # one budget: any unleased object may go
                need = self._used_bytes + nbytes - self.capacity_bytes
                evictable = self._used_bytes - self._leased_bytes
                victims_of: int | None = None
            else:  # its own share only
                need = self._kind_bytes[kind] + nbytes - self._kind_caps[kind]
                evictable = self._kind_bytes[kind] - self._kind_leased[kind]
                victims_of = kind
            if need > evictable:  # even every unleased object is too little
                self.counters.puts_no_space += 1
                return PutResult.NO_SPACE
            while need > 0:
                freed = self._remove_locked(self._pop_victim_locked(victims_of), evicted=True)
                need -= freed
                self.counters.evicted_bytes += freed
                self.counters.evictions += 1
            self._tick += 1
            entry = _Entry(payload, nbytes, self._tick, kind, self._inflation, checksum=checksum)
            self._objects[key] = entry
            self._used_bytes += nbytes
            self._kind_bytes[kind] += nbytes
            self._bytes_by_group[key[2]] += nbytes
            self._objects_by_group[key[2]] += 1
            self._objects_by_namespace[key[0]] += 1
            self._bytes_by_namespace_group[key[0], key[2]] += nbytes
            if key[0] in self._layouts:
                self._tree_add_locked(key, parent)
            self._queue_locked(key, entry)  # after the tree knows its node: its value per byte
            if prev is not None and prev != key[1]:
                parent_key = (key[0], prev, key[2], key[3])
                parent = self._objects.get(parent_key)
                if parent is not None:
                    entry.parent = prev
                    self._set_children_locked(parent_key, parent, (parent.children or set()) | {key[1]})
            self.counters.puts_stored += 1
            self.counters.stored_bytes_total += nbytes
            return PutResult.STORED

    def _kind_of(self, key: StoreKey) -> int:
        layout = self._layouts.get(key[0])
        return _STATE if layout is not None and key[2] in layout.state_groups else _OTHER

    def _pop_victim_locked(self, kind: int | None = None) -> StoreKey:
        """The next object to evict: the unleased object of lowest priority (least recently
        used, under ``eviction="lru"``) of the first non-empty class (worthless, superseded,
        plain), of ``kind`` only if given. Stale heap items (touched, leased, requeued with
        another priority or class since) are discarded on the way."""
        kinds = (_OTHER, _STATE) if kind is None else (kind,)
        for cls in (_WORTHLESS, _SUPERSEDED, _PLAIN):
            best: list[_HeapItem] | None = None
            for k in kinds:
                heap = self._heaps[k][cls]
                while heap:
                    prio, tick, key = heap[0]
                    entry = self._objects.get(key)
                    if entry is not None and entry.tick == tick and entry.prio == prio and entry.leases == 0 \
                            and self._class_locked(key, entry) == cls:
                        break
                    heapq.heappop(heap)
                    self._heap_items -= 1
                if heap and (best is None or heap[0] < best[0]):
                    best = heap
            if best is not None:
                prio, _, key = heapq.heappop(best)
                self._heap_items -= 1
                if cls == _PLAIN and prio > self._inflation:
                    self._inflation = prio  # GreedyDual: L rises to the evicted priority
                return key
        raise RuntimeError("store invariant broken: unleased bytes exist but no eviction candidate")

    def _saved(self, layout: Layout, depth: int) -> float:
        """Prefill a resume at ``depth`` chunks saves, in token-equivalents."""
        t = depth * layout.chunk_tokens
        return t * (1.0 + self.value_alpha * t)

    def _density_locked(self, key: StoreKey, entry: _Entry) -> float:
        """Value per byte of one object (0: untracked, ``eviction="lru"``, or off the tree)."""
        if self.eviction != "value":
            return 0.0
        nodes = self._nodes.get(key[0])
        node = None if nodes is None else nodes.get(key[1])
        if node is None or not node.chain_ok:
            return 0.0
        layout = self._layouts[key[0]]
        if key[2] in layout.state_groups:
            return self._saved(layout, node.depth) / (layout.copies(layout.state_groups) * entry.nbytes)
        value = node.value or self._saved(layout, node.depth)  # pending: at least its own depth
        return value / (layout.copies(layout.attn_groups) * entry.nbytes)

    def _class_locked(self, key: StoreKey, entry: _Entry) -> int:
        nodes = self._nodes.get(key[0])
        if nodes is not None:
            node = nodes.get(key[1])
            if node is not None and node.claimed and not node.covered:
                return _WORTHLESS
        return _SUPERSEDED if entry.superseded else _PLAIN

    def _queue_locked(self, key: StoreKey, entry: _Entry) -> None:
        """Make an unleased object an eviction candidate at its priority (recomputed: its
        value may have changed since its last use)."""
        if entry.leases:
            return
        entry.prio = entry.base + self._density_locked(key, entry)
        heapq.heappush(self._heaps[entry.kind][self._class_locked(key, entry)], (entry.prio, entry.tick, key))
        self._heap_items += 1
        if self._heap_items > 2 * len(self._objects) + 1024:
            self._rebuild_heaps_locked()

    def _rebuild_heaps_locked(self) -> None:
        """Drop stale items: O(n), once per at least n pushes."""
        heaps = _empty_heaps()
        for key, entry in self._objects.items():
            if not entry.leases:
                heaps[entry.kind][self._class_locked(key, entry)].append((entry.prio, entry.tick, key))
        for by_class in heaps:
            for heap in by_class:
                heapq.heapify(heap)
        self._heaps = heaps
        self._heap_items = sum(len(heap) for by_class in heaps for heap in by_class)

    def _touch_locked(self, key: StoreKey, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        entry.base = self._inflation
        self._queue_locked(key, entry)

    def _set_children_locked(self, key: StoreKey, entry: _Entry, children: set[bytes] | None) -> None:
        """Replace a state's children, keeping the superseded count and its class heap right."""
        was = entry.superseded
        entry.children = children or None
        if entry.superseded != was:
            self._superseded_objects += 1 if entry.superseded else -1
            self._queue_locked(key, entry)  # same last use, new class

    def _remove_locked(self, key: StoreKey, evicted: bool = False) -> int:
        entry = self._objects.pop(key)
        self._used_bytes -= entry.nbytes
        self._kind_bytes[entry.kind] -= entry.nbytes
        for counts, label, amount in ((self._bytes_by_group, key[2], entry.nbytes),
                                      (self._objects_by_group, key[2], 1),
                                      (self._objects_by_namespace, key[0], 1),
                                      (self._bytes_by_namespace_group, (key[0], key[2]), entry.nbytes)):
            counts[label] -= amount
            if not counts[label]:  # a table per label ever seen would grow without bound
                del counts[label]
        if entry.leases:
            self._leased_bytes -= entry.nbytes
            self._kind_leased[entry.kind] -= entry.nbytes
            self._leased_objects -= 1
        if entry.superseded:
            self._superseded_objects -= 1
        if key[0] in self._layouts:
            self._tree_remove_locked(key, entry, evicted)
        if entry.parent is not None:  # a parent must not count an evicted state as its successor
            parent_key = (key[0], entry.parent, key[2], key[3])
            parent = self._objects.get(parent_key)
            if parent is not None and parent.children and key[1] in parent.children:
                self._set_children_locked(parent_key, parent, parent.children - {key[1]})
        return entry.nbytes

    # --- chunk tree of tracked namespaces (usable prefixes, worthless-first eviction) ------

    def _tree_add_locked(self, key: StoreKey, parent: bytes | None) -> None:
        ns, digest, group = key[0], key[1], key[2]
        layout, nodes = self._layouts[ns], self._nodes[ns]
        if group not in layout.attn_groups and group not in layout.state_groups:
            return  # a group the engine did not declare: plain LRU, outside the tree
        node = nodes.get(digest)
        if node is None:
            node = nodes[digest] = _Node()
        if not node.parent_known and parent != UNKNOWN_PARENT and parent != digest:
            node.parent, node.parent_known = parent, True
            if parent is not None:
                parent_node = nodes.get(parent)
                if parent_node is None:
                    parent_node = nodes[parent] = _Node()  # structure only, until its objects come
                parent_node.children.add(digest)
        if group in layout.attn_groups:
            node.attn += 1
        else:
            node.state += 1
            if node.state == layout.copies(layout.state_groups):
                self._usage[ns].states_held += 1
        if self._class_locked(key, self._objects[key]) == _WORTHLESS:
            self._usage[ns].worthless_objects += 1
        self._refresh_node_locked(ns, digest, node)

    def _tree_remove_locked(self, key: StoreKey, entry: _Entry, evicted: bool) -> None:
        ns, digest, group = key[0], key[1], key[2]
        layout, nodes = self._layouts[ns], self._nodes[ns]
        node = nodes.get(digest)
        if node is None:
            return
        usage = self._usage[ns]
        if group in layout.attn_groups:
            node.attn -= 1
        elif group in layout.state_groups:
            if node.state == layout.copies(layout.state_groups):
                usage.states_held -= 1
                if evicted and not entry.children:
                    usage.states_evicted_newest += 1
            node.state -= 1
        else:
            return
        if node.claimed and not node.covered:
            usage.worthless_objects -= 1
        self._refresh_node_locked(ns, digest, node)
        self._prune_locked(nodes, digest)

    def _prune_locked(self, nodes: dict[bytes, _Node], digest: bytes) -> None:
        """Forget nodes with no objects and no children, up the path."""
        while True:
            node = nodes.get(digest)
            if node is None or node.attn or node.state or node.children:
                return
            del nodes[digest]
            if not node.parent_known or node.parent is None or node.parent not in nodes:
                return
            nodes[node.parent].children.discard(digest)
            digest = node.parent

    def _chain_ok_locked(self, ns: str, node: _Node) -> bool:
        layout = self._layouts[ns]
        if not node.parent_known or node.attn < layout.copies(layout.attn_groups):
            return False
        if node.parent is None:
            return True
        parent = self._nodes[ns].get(node.parent)
        return parent is not None and parent.chain_ok

    def _refresh_node_locked(self, ns: str, digest: bytes, node: _Node) -> None:
        """Bring ``node`` (whose object counts just changed) and the nodes it affects up to date."""
        chain_ok = self._chain_ok_locked(ns, node)
        if chain_ok and not node.chain_ok:
            self._reroot_locked(ns, digest, node)
        elif node.chain_ok and not chain_ok:
            self._unroot_locked(ns, digest, node)
        elif chain_ok:
            layout = self._layouts[ns]
            resumable = node.state == layout.copies(layout.state_groups)
            if resumable != node.resumable:
                node.resumable = resumable
                self._usage[ns].resumable_states += 1 if resumable else -1
                self._add_cover_locked(ns, digest, 1 if resumable else -1)
                if resumable:
                    self._raise_value_locked(ns, digest, self._saved(layout, node.depth))

    def _set_cover_locked(self, ns: str, digest: bytes, node: _Node, covered: int) -> None:
        """Change a node's cover, keeping the namespace figures and its objects' classes right."""
        was_worthless = node.claimed and not node.covered
        if bool(covered) != bool(node.covered):
            self._usage[ns].covered_nodes += 1 if covered else -1
        node.covered = covered
        if covered:
            node.claimed = True
        else:
            node.value = 0.0  # nothing at or below resumes: the value walk starts afresh
        worthless = node.claimed and not node.covered
        if worthless != was_worthless:
            n = self._requeue_node_locked(ns, digest)
            self._usage[ns].worthless_objects += n if worthless else -n

    def _add_cover_locked(self, ns: str, digest: bytes | None, delta: int) -> None:
        """Add ``delta`` resumable nodes to ``digest`` and every ancestor: O(depth)."""
        nodes = self._nodes[ns]
        while digest is not None:
            node = nodes.get(digest)
            if node is None:
                return
            self._set_cover_locked(ns, digest, node, node.covered + delta)
            if not node.parent_known:
                return
            digest = node.parent

    def _requeue_node_locked(self, ns: str, digest: bytes, attention_only: bool = False) -> int:
        """Push a node's unleased objects into their (new) class heaps at their (new)
        priority; returns its object count."""
        layout = self._layouts[ns]
        n = 0
        for group in (*layout.attn_groups, *(() if attention_only else layout.state_groups)):
            ranks = 1 if group in layout.replicated_groups else layout.world_size
            for rank in range(ranks):
                key = (ns, digest, group, rank)
                entry = self._objects.get(key)
                if entry is not None:
                    n += 1
                    self._queue_locked(key, entry)
        return n

    def _unroot_locked(self, ns: str, digest: bytes, node: _Node) -> None:
        """``node`` lost attention (its own or an ancestor's): nothing at or below it can be
        resumed. O(depth + the part of its subtree that was resumable-rooted)."""
        if node.covered and node.parent_known and node.parent is not None:
            self._add_cover_locked(ns, node.parent, -node.covered)
        nodes, usage = self._nodes[ns], self._usage[ns]
        stack = [(digest, node)]
        while stack:
            d, n = stack.pop()
            n.chain_ok = False
            if n.resumable:
                n.resumable = False
                usage.resumable_states -= 1
            self._set_cover_locked(ns, d, n, 0)
            self._requeue_node_locked(ns, d)  # off the tree: value 0
            stack.extend((c, nodes[c]) for c in n.children if c in nodes and nodes[c].chain_ok)

    def _reroot_locked(self, ns: str, digest: bytes, node: _Node) -> None:
        """``node``'s path to the first chunk is whole again (a missing attention object was
        put back): recount its subtree's resumable nodes bottom-up and add them above it."""
        layout, nodes, usage = self._layouts[ns], self._nodes[ns], self._usage[ns]
        full_state = layout.copies(layout.state_groups)
        order: list[tuple[bytes, _Node]] = []
        stack = [(digest, node)]
        node.chain_ok = True
        node.depth = 1 if node.parent is None else nodes[node.parent].depth + 1
        while stack:
            d, n = stack.pop()
            order.append((d, n))
            for c in n.children:
                child = nodes.get(c)
                if child is not None and not child.chain_ok and child.parent_known \
                        and child.attn >= layout.copies(layout.attn_groups):
                    child.chain_ok = True
                    child.depth = n.depth + 1
                    stack.append((c, child))
        for d, n in reversed(order):  # children before parents
            n.resumable = n.state == full_state
            usage.resumable_states += n.resumable
            live = [nodes[c] for c in n.children if c in nodes and nodes[c].chain_ok]
            self._set_cover_locked(ns, d, n, sum(c.covered for c in live) + n.resumable)
            n.value = max([c.value for c in live] + [self._saved(layout, n.depth) if n.resumable else 0.0])
            self._requeue_node_locked(ns, d)  # new depth and value: new priorities
        if node.covered and node.parent is not None:
            self._add_cover_locked(ns, node.parent, node.covered)
            self._raise_value_locked(ns, node.parent, node.value)

    def _raise_value_locked(self, ns: str, digest: bytes | None, value: float) -> None:
        """A resumable node worth ``value`` appeared at or below ``digest``: raise the value
        of the path above it (and its attention objects' priorities) up to the first node
        already worth as much. O(depth log n), on the walk the cover count takes anyway."""
        nodes = self._nodes[ns]
        while digest is not None:
            node = nodes.get(digest)
            if node is None or node.value >= value:
                return
            node.value = value
            self._requeue_node_locked(ns, digest, attention_only=True)
            if not node.parent_known:
                return
            digest = node.parent

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
            for ns in [n for n in self._layouts if namespace is None or n == namespace]:
                self._nodes[ns] = {}  # emptied wholesale: no walks per removed object
                self._usage[ns] = _NamespaceUsage(states_evicted_newest=self._usage[ns].states_evicted_newest)
            for key in keys:
                self._remove_locked(key)
            gone = set(keys)
            for lease_id in [i for i, lease in self._leases.items() if any(k in gone for k in lease.keys)]:
                self._drop_lease_locked(lease_id)
            if not self._objects:
                self._heaps = _empty_heaps()
                self._heap_items = 0
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
                    self._objects[key].base = self._inflation
                else:
                    self._touch_locked(key, self._objects[key])
            if not lease:
                return hit, None
            lease_id = self._grant_lease_locked(keys, owner)
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

        def wanted(groups: Sequence[int]) -> list[tuple[int, int]]:
            return [(g, r) for g in groups for r in (range(1) if g in replicated else range(world_size))]

        attn, state = wanted(attn_groups), wanted(state_groups)
        with self._lock:
            objects = self._objects
            depth = 0
            for h in hashes:
                if not all((namespace, h, g, r) in objects for g, r in attn):
                    break
                depth += 1
            at_start = 0 < start_chunk <= len(hashes) and bool(state) and all(
                (namespace, hashes[start_chunk - 1], g, r) in objects for g, r in state)
            return depth, at_start

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
                self._kind_leased[entry.kind] += entry.nbytes
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
                    self._kind_leased[entry.kind] -= entry.nbytes
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

    def usable_prefixes(self, namespace: str) -> dict[str, int] | None:
        """The usable-prefix figures of a namespace with a declared layout (None otherwise):
        O(1), maintained as objects come and go."""
        with self._lock:
            usage, layout = self._usage.get(namespace), self._layouts.get(namespace)
            if usage is None or layout is None:
                return None
            return {"resumable_tokens": usage.covered_nodes * layout.chunk_tokens,
                    "resumable_chunks": usage.covered_nodes, "resumable_states": usage.resumable_states,
                    "states_held": usage.states_held, "states_evicted_newest": usage.states_evicted_newest,
                    "worthless_objects": usage.worthless_objects}

    def tracked_namespaces(self) -> list[str]:
        """Namespaces with a declared layout (whose usable prefixes are tracked)."""
        with self._lock:
            return list(self._layouts)

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
