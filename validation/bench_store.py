"""Put latency of glm-cache-server under memory pressure, by object count.

A put under pressure must not scan every object (skipping the leased ones each time), or
its cost grows with the object count (3.25 ms per put at 20k objects). Here the store is
filled to its byte budget
with small objects, the oldest 10% are leased (one lookup over their prefix, so a scan
from the LRU end would meet them first), and every timed put of a new object must evict
one. Object count is what matters, so objects are small. The same is measured in process
(the store alone) and through a real server (a put round trip over ZMQ), at 20k and 200k
objects, and printed side by side.

    python -m validation.bench_store [--counts 20000 200000] [--puts 5000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cache_server.client import CacheClient
from cache_server.protocol import PutResult
from cache_server.store import ObjectStore
from testing.server_process import ServerProcess

NS = "bench"
OBJECT_BYTES = 64
LEASED_SHARE = 0.10
FILL_BATCH = 1000  # objects per put while filling the server


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def percentiles(times_s: list[float]) -> tuple[float, float]:
    """(p50, p99) in microseconds."""
    ordered = sorted(times_s)
    return statistics.median(ordered) * 1e6, ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e6


def bench_in_process(n: int, puts: int) -> tuple[float, float]:
    payload = b"x" * OBJECT_BYTES
    store = ObjectStore(n * OBJECT_BYTES, OBJECT_BYTES, lease_ttl_s=3600.0)
    for i in range(n):
        store.put((NS, h(i), 0, 0), payload)
    hit, lease = store.lookup(NS, [h(i) for i in range(int(n * LEASED_SHARE))], [0], [], 1)
    assert hit == int(n * LEASED_SHARE) and lease is not None
    times = []
    for i in range(n, n + puts):
        t0 = time.perf_counter()
        result = store.put((NS, h(i), 0, 0), payload)
        times.append(time.perf_counter() - t0)
        assert result is PutResult.STORED
    assert len(store) == n and store.counters.evictions == puts
    return percentiles(times)


def bench_server(n: int, puts: int) -> tuple[float, float]:
    payload = b"x" * OBJECT_BYTES
    l1_gb = n * OBJECT_BYTES / (1 << 30)
    with ServerProcess("--l1-size-gb", repr(l1_gb), "--max-object-size-mb", repr(OBJECT_BYTES / (1 << 20))) as s, \
            CacheClient(s.url, timeout_s=60.0) as c:
        capacity = c.stats()["capacity_bytes"]
        n = capacity // OBJECT_BYTES  # the budget rounds to whole bytes
        for start in range(0, n, FILL_BATCH):
            c.put(NS, [(h(i), 0, 0, payload) for i in range(start, min(n, start + FILL_BATCH))])
        hit, lease = c.lookup(NS, [h(i) for i in range(int(n * LEASED_SHARE))], [0], [])
        assert hit == int(n * LEASED_SHARE) and lease is not None
        times = []
        for i in range(n, n + puts):
            t0 = time.perf_counter()
            result = c.put(NS, [(h(i), 0, 0, payload)])
            times.append(time.perf_counter() - t0)
            assert result == ["stored"]
        stats = c.stats()
        assert stats["objects"] == n and stats["evictions"] == puts
    return percentiles(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[20_000, 200_000], help="objects in the full store")
    ap.add_argument("--puts", type=int, default=5000, help="timed puts per case, each evicting one object")
    args = ap.parse_args()
    t_start = time.perf_counter()
    rows = {"in-process store.put": bench_in_process, "server put round trip": bench_server}
    results = {(name, n): fn(n, args.puts) for name, fn in rows.items() for n in args.counts}
    print(f"put latency under memory pressure: store full at its budget, every put evicts one "
          f"{OBJECT_BYTES}-byte object, oldest {LEASED_SHARE:.0%} leased; {args.puts} timed puts per case")
    print(f"{'':24s}" + "".join(f"{f'{n:,} objects':>22s}" for n in args.counts))
    print(f"{'':24s}" + "".join(f"{'p50 µs':>11s}{'p99 µs':>11s}" for _ in args.counts))
    for name in rows:
        print(f"{name:24s}" + "".join(f"{results[name, n][0]:11.1f}{results[name, n][1]:11.1f}" for n in args.counts))
    print(f"({time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
