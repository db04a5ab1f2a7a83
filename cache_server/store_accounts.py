"""The object store's bookkeeping: each object's entry, what the store holds counted by
kind, group and namespace (:class:`Occupancy`), and its monotonic counters. The store
(:mod:`cache_server.store`) keeps all three under its lock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields

from cache_server.eviction import OTHER
from cache_server.layout import StoreKey

Payload = bytes | memoryview


OBJECT_OVERHEAD_BYTES = 2048
"""What the server charges each object against ``--l1-size-gb`` beyond its payload: its index
entry, key, eviction-heap item, chunk-tree node and counters. Measured: 1.03 KB of Python
objects per 1-byte object in a declared namespace (``tracemalloc``), about 1.5 KB of RSS; 2 KB
keeps a flood of tiny objects within the budget (``validation/bench_object_overhead.py``)."""


@dataclass(slots=True)
class Entry:
    """One stored object (a :class:`~cache_server.leases.Pinnable`)."""

    payload: Payload
    nbytes: int
    charge: int  # what it counts against the budget: nbytes plus the store's per-object overhead
    tick: int  # last use; breaks priority ties (LRU)
    kind: int = OTHER  # STATE: counts against the state share
    base: float = 0.0  # the eviction queues' L (inflation) at last use
    prio: float = 0.0  # base + value per byte when last queued; orders eviction within a class
    checksum: bytes = b""  # written by the storing client, returned to loaders as is
    leases: int = 0  # active leases holding this object; > 0 means not evictable
    next_states: set[bytes] | None = None  # hashes of resident newer states linked to this one by ``prev``
    prev_state: bytes | None = None  # hash of the state this one was linked to, when it was resident

    @property
    def superseded(self) -> bool:
        return self.next_states is not None and len(self.next_states) == 1


class Occupancy:
    """What the store holds, counted as objects come and go: payload bytes, charged bytes
    (payloads plus each object's overhead: what the capacity bounds), charged bytes per
    kind, and bytes and objects by group and namespace. Not thread-safe: the store updates
    it under its lock."""

    def __init__(self) -> None:
        self.used_bytes = 0  # payloads
        self.charged_bytes = 0
        self.kind_bytes = [0, 0]  # charged, per kind (other, state)
        self.bytes_by_group: dict[int, int] = defaultdict(int)
        self.objects_by_group: dict[int, int] = defaultdict(int)
        self.objects_by_namespace: dict[str, int] = defaultdict(int)
        self.bytes_by_namespace_group: dict[tuple[str, int], int] = defaultdict(int)

    def add(self, key: StoreKey, entry: Entry) -> None:
        self.used_bytes += entry.nbytes
        self.charged_bytes += entry.charge
        self.kind_bytes[entry.kind] += entry.charge
        self.bytes_by_group[key.group] += entry.nbytes
        self.objects_by_group[key.group] += 1
        self.objects_by_namespace[key.namespace] += 1
        self.bytes_by_namespace_group[key.namespace, key.group] += entry.nbytes

    def remove(self, key: StoreKey, entry: Entry) -> None:
        self.used_bytes -= entry.nbytes
        self.charged_bytes -= entry.charge
        self.kind_bytes[entry.kind] -= entry.charge
        for counts, label, amount in ((self.bytes_by_group, key.group, entry.nbytes),
                                      (self.objects_by_group, key.group, 1),
                                      (self.objects_by_namespace, key.namespace, 1),
                                      (self.bytes_by_namespace_group, (key.namespace, key.group), entry.nbytes)):
            counts[label] -= amount
            if not counts[label]:  # a table per label ever seen would grow without bound
                del counts[label]

    def bytes_by_group_name(self, name_of: Callable[[str, int], str]) -> dict[str, int]:
        """Resident bytes by what the groups hold, over every namespace (group ids mean
        different things in different namespaces; names, declared at hello, do not):
        ``name_of(namespace, group)`` names a group."""
        out: dict[str, int] = defaultdict(int)
        for (ns, g), b in self.bytes_by_namespace_group.items():
            out[name_of(ns, g)] += b
        return dict(sorted(out.items()))


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
    lease_releases_refused: int = 0  # releases of another connection's lease (left as it was)
    stored_bytes_total: int = 0
    served_bytes_total: int = 0

    def snapshot(self) -> dict[str, int]:
        """The counters under their /status names."""
        return {_SNAPSHOT_NAMES.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}


_SNAPSHOT_NAMES = {"lookup_hits": "hits", "lookup_misses": "misses", "lookup_hit_chunks": "hit_chunks"}
