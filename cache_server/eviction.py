"""The object store's eviction order: retention classes, priorities within a class, and
the heaps that hold the candidates.

Classes, evicted in this order:

0. worthless: objects of a chunk that was once on a resumable path and no longer is (its
   states were all evicted, or an attention chunk above it went). Nothing can resume
   through them, so they go before anything that still can. A chunk that was never on a
   resumable path is *pending* (a prompt whose state has not been saved yet, or a TP
   rank's state that arrived before rank 0's attention) and stays in class 2: evicting it
   as worthless would make every new conversation's first chunks the first victims.
1. superseded states: a state with exactly one newer state after it on its conversation
   path (linked by ``prev``); the newer one resumes everything it could, and more. One
   with two or more is a fork point and is kept like any other. This keeps one long
   prompt's snapshots from evicting everyone else's.
2. everything else.

Within a class, with ``eviction="value"`` (the default; Marconi, arXiv 2411.19379:
FLOP-aware eviction), objects are ordered GreedyDual-style: a touch gives an object the
priority ``L + value / bytes``, the lowest priority goes first, and ``L`` rises to the
priority of each class-2 object evicted. ``value`` is the prefill a resume saves, in
token-equivalents: a state at depth ``d`` chunks resumes ``T = d * C`` tokens, and
``saved(T) = T * (1 + value_alpha * T)`` (KDA and the MLPs grow linearly with ``T``,
attention over the prefix quadratically; the default ``value_alpha = 1/65536`` says the
quadratic part equals the linear part at 64k tokens). How the chunk tree gives each object
its value is in :mod:`cache_server.chunk_tree`. So under pressure a deep state outlives a
shallow one touched at the same time, and recency still wins in the end: ``L`` catches up
with every priority. ``L`` follows class-2 evictions only: worthless or superseded objects
are not the frontier. Untracked namespaces have value 0: their order is exactly LRU.
``eviction="lru"``: value 0 everywhere (plain LRU within each class).

Cost: every put under pressure must not scan all objects. Victims come from one heap per
kind (state share or the rest) and class, of ``(priority, last use, key)`` items with lazy
deletion: a touch pushes a fresh item and the old one goes stale, a leased object's item is
dropped when popped and pushed again when its last lease ends. A put that must evict pops
O(victims) items, O(log n) each, amortised over the pushes; the heaps are rebuilt when
stale items outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from cache_server.layout import StoreKey

HeapItem = tuple[float, int, StoreKey]  # (priority, tick of last use, key)
WORTHLESS, SUPERSEDED, PLAIN = 0, 1, 2  # eviction classes, evicted in this order
OTHER, STATE = 0, 1  # kinds: a declared state group of a tracked namespace, or anything else
EVICTION_POLICIES = ("value", "lru")
DEFAULT_VALUE_ALPHA = 1 / 65536  # per token: attention's quadratic prefill cost equals the rest at 64k


def saved_prefill(tokens: int, value_alpha: float) -> float:
    """Prefill a resume of ``tokens`` tokens saves, in token-equivalents."""
    return tokens * (1.0 + value_alpha * tokens)


def _empty_heaps() -> tuple[tuple[list[HeapItem], ...], ...]:
    return tuple(([], [], []) for _ in (OTHER, STATE))


class EvictionQueues:
    """The candidates of every kind and class, and GreedyDual's ``L`` (``inflation``).
    Not thread-safe: the store calls it under its lock."""

    def __init__(self) -> None:
        self.heaps: tuple[tuple[list[HeapItem], ...], ...] = _empty_heaps()
        self.items = 0  # in all heaps, stale ones included
        self.inflation = 0.0

    def push(self, kind: int, cls: int, item: HeapItem) -> None:
        heapq.heappush(self.heaps[kind][cls], item)
        self.items += 1

    def needs_rebuild(self, live: int) -> bool:
        """Whether stale items outnumber the ``live`` objects (with some slack)."""
        return self.items > 2 * live + 1024

    def rebuild(self, candidates: Iterable[tuple[int, int, HeapItem]]) -> None:
        """Replace every heap by the ``(kind, class, item)`` candidates given: O(n)."""
        heaps = _empty_heaps()
        for kind, cls, item in candidates:
            heaps[kind][cls].append(item)
        for by_class in heaps:
            for heap in by_class:
                heapq.heapify(heap)
        self.heaps = heaps
        self.items = sum(len(heap) for by_class in heaps for heap in by_class)

    def clear(self) -> None:
        self.heaps = _empty_heaps()
        self.items = 0

    def pop(self, kinds: Sequence[int], is_current: Callable[[HeapItem, int], bool]) -> StoreKey | None:
        """The key of lowest priority of the first non-empty class, among ``kinds``; None if
        every heap is empty. Items ``is_current`` rejects (touched, leased, requeued with
        another priority or class since) are discarded on the way."""
        for cls in (WORTHLESS, SUPERSEDED, PLAIN):
            best: list[HeapItem] | None = None
            for kind in kinds:
                heap = self.heaps[kind][cls]
                while heap and not is_current(heap[0], cls):
                    heapq.heappop(heap)
                    self.items -= 1
                if heap and (best is None or heap[0] < best[0]):
                    best = heap
            if best is not None:
                prio, _, key = heapq.heappop(best)
                self.items -= 1
                if cls == PLAIN and prio > self.inflation:
                    self.inflation = prio  # GreedyDual: L rises to the evicted priority
                return key
        return None
