"""Put cost of the chunk-tree retention, in process, by object count and policy.

A tracked namespace (attention stored once, a state on 4 ranks) is filled to its budget
with 13-chunk conversations; then every timed put (300 more conversations) evicts. The
value order's priority walks (up the path when a state completes) must keep a put
O(depth log n): the cost may not grow with the object count beyond the log.

    python -m validation.bench_retention [--counts 20000 200000] [--conversations 300]
"""

from __future__ import annotations

import argparse
import time

from cache_server.layout import Layout
from cache_server.store import ObjectStore

CHUNKS, RANKS, OBJECT_BYTES = 13, 4, 64


def run(n_objects: int, eviction: str, timed: int) -> tuple[float, int]:
    per_conv = CHUNKS + RANKS
    s = ObjectStore(n_objects * OBJECT_BYTES, OBJECT_BYTES, 3600.0, eviction=eviction)
    s.set_layout("ns", Layout(frozenset({0}), frozenset({1}), RANKS, frozenset({0}), 1536))

    def conversation(c: int) -> None:
        hs = [c.to_bytes(8, "big") + k.to_bytes(24, "big") for k in range(CHUNKS)]
        for k, h in enumerate(hs):
            s.put(("ns", h, 0, 0), b"a" * OBJECT_BYTES, parent=hs[k - 1] if k else None)
        for r in range(RANKS):
            s.put(("ns", hs[-1], 1, r), b"s" * OBJECT_BYTES, parent=hs[-2])

    c = 0
    while len(s) + per_conv <= n_objects:
        conversation(c)
        c += 1
    t = time.perf_counter()
    for i in range(timed):
        conversation(c + i)
    return (time.perf_counter() - t) / (timed * per_conv) * 1e6, s.counters.evictions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[20_000, 200_000])
    ap.add_argument("--conversations", type=int, default=300)
    args = ap.parse_args()
    print(f"{'objects':>8} {'LRU us/put':>11} {'value us/put':>13} {'evictions':>10}")
    for n in args.counts:
        lru, ev = run(n, "lru", args.conversations)
        value, _ = run(n, "value", args.conversations)
        print(f"{n:8,} {lru:11.1f} {value:13.1f} {ev:10,}")


if __name__ == "__main__":
    main()
