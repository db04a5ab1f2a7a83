"""Leases: which lookup pinned which of the store's objects, for whom, until when.

A lease pins the objects a lookup's resume needs (not evictable) until it is released or
its TTL passes. Leases are capped, because uncapped, many lookups can pin the whole store
and every put gets NO_SPACE: at most ``max_leased_bytes`` are pinned at once, and at most
``max_per_owner`` leases per owner (the server passes the client's ZMQ identity). Going
over either drops the oldest lease (of that owner, or of anyone), never refuses the newest:
the newest lookup is the one whose load is about to run, the oldest the most likely to be
finished or leaked. A lookup whose own objects exceed the byte cap gets no lease.

Leases are kept in grant order, which with one TTL is expiry order, so expiry looks only at
the expired ones, and the oldest lease (of anyone, or of one owner) is found in O(1).

A lease is its owner's: its id is a random 64-bit number (not a counter another client
could count along), and a release by anyone but its owner (another connection) is refused
(``not_owner``) and changes nothing.
"""

from __future__ import annotations

import enum
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cache_server.layout import StoreKey


class Release(str, enum.Enum):
    """What a release did (the server's reply names it: ``reason`` when not released)."""

    RELEASED = "released"
    UNKNOWN = "unknown"  # never granted, expired, released already, or dropped by a cap
    NOT_OWNER = "not_owner"  # another owner's lease: left as it is


class Pinnable(Protocol):
    """What a lease needs of a stored object."""

    charge: int  # the bytes it counts against the budget (payload and overhead)
    kind: int  # which byte share it counts against (cache_server.eviction's kinds)
    leases: int  # active leases on it; > 0: not evictable


@dataclass(slots=True)
class Lease:
    expires_at: float
    keys: list[StoreKey]
    owner: bytes | None


ANY_OWNER = object()  # release(owner=ANY_OWNER): whoever asks (in-process callers, not the wire)


class LeaseTable:
    """The active leases on the objects of ``objects`` (the store's own table, which it
    keeps current), and the bytes they pin. ``counters`` is the store's
    :class:`~cache_server.store_accounts.StoreCounters`; ``unpinned(key, obj)`` is called
    for an object whose last lease ended (it becomes an eviction candidate again). Not
    thread-safe: the store calls it under its lock."""

    def __init__(self, objects: Mapping[StoreKey, Any], ttl_s: float, clock: Callable[[], float],
                 max_leased_bytes: int, max_per_owner: int | None, counters: Any,
                 unpinned: Callable[[StoreKey, Any], None]) -> None:
        self._objects = objects
        self.ttl_s = ttl_s
        self._clock = clock
        self.max_leased_bytes = max_leased_bytes
        self.max_per_owner = max_per_owner
        self._counters = counters
        self._unpinned = unpinned
        self._leases: OrderedDict[int, Lease] = OrderedDict()  # grant order == expiry order
        self._by_owner: dict[bytes, OrderedDict[int, None]] = {}
        self.leased_bytes = 0  # bytes of objects with at least one lease
        self.kind_leased = [0, 0]  # the same, by kind
        self.leased_objects = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def grant(self, keys: list[StoreKey], owner: bytes | None) -> int | None:
        """Pin ``keys`` (all resident) for ``owner``, within the caps; the lease id, or None
        when these objects alone exceed the byte cap."""
        if sum(self._objects[k].charge for k in set(keys)) > self.max_leased_bytes:
            self._counters.leases_refused += 1
            return None
        if owner is not None and self.max_per_owner is not None:
            while len(self._by_owner.get(owner, ())) >= self.max_per_owner:
                self.drop(next(iter(self._by_owner[owner])))
                self._counters.leases_dropped_client_cap += 1
        for key in keys:
            obj = self._objects[key]
            if not obj.leases:
                self._count_pinned(obj, 1)
            obj.leases += 1
        lease_id = self._new_id()
        self._leases[lease_id] = Lease(self._clock() + self.ttl_s, keys, owner)
        if owner is not None:
            self._by_owner.setdefault(owner, OrderedDict())[lease_id] = None
        # This lease alone fits, so the oldest ones are dropped before it would be.
        while self.leased_bytes > self.max_leased_bytes:
            self.drop(next(iter(self._leases)))
            self._counters.leases_dropped_leased_bytes += 1
        self._counters.leases_granted += 1
        return lease_id

    def _new_id(self) -> int:
        while True:
            lease_id = secrets.randbits(64)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def release(self, lease_id: int, owner: Any = ANY_OWNER) -> Release:
        """Release a lease of ``owner``'s: ``released``; ``unknown`` if it never was, had
        expired, was released or dropped by a cap; ``not_owner`` if another owner holds it
        (left as it is)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return Release.UNKNOWN
        if owner is not ANY_OWNER and lease.owner != owner:
            self._counters.lease_releases_refused += 1
            return Release.NOT_OWNER
        self.drop(lease_id)
        self._counters.leases_released += 1
        return Release.RELEASED

    def expire(self) -> int:
        """Drop leases past their TTL; returns how many."""
        now = self._clock()
        expired = 0
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))  # the oldest grant expires first
            if lease.expires_at > now:
                break
            self.drop(lease_id)
            expired += 1
        self._counters.leases_expired += expired
        return expired

    def drop(self, lease_id: int) -> None:
        """End a lease, unpinning the objects it was the last lease on."""
        lease = self._leases.pop(lease_id)
        if lease.owner is not None:
            mine = self._by_owner[lease.owner]
            del mine[lease_id]
            if not mine:
                del self._by_owner[lease.owner]
        for key in lease.keys:
            obj = self._objects.get(key)
            if obj is not None:
                obj.leases -= 1
                if not obj.leases:
                    self._count_pinned(obj, -1)
                    self._unpinned(key, obj)

    def drop_holding(self, keys: set[StoreKey]) -> None:
        """End every lease on any of ``keys``."""
        for lease_id in [i for i, lease in self._leases.items() if any(k in keys for k in lease.keys)]:
            self.drop(lease_id)

    def removed(self, obj: Pinnable) -> None:
        """A leased object left the store: its bytes are no longer pinned."""
        self._count_pinned(obj, -1)

    def _count_pinned(self, obj: Pinnable, sign: int) -> None:
        self.leased_bytes += sign * obj.charge
        self.kind_leased[obj.kind] += sign * obj.charge
        self.leased_objects += sign
