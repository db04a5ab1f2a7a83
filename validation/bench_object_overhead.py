"""What tiny objects cost a real glm-cache-server: RSS against objects held and the budget.

    python -m validation.bench_object_overhead                 # 160,000 puts per mix, 0.005 GiB
    python -m validation.bench_object_overhead --objects 20000 # quicker

For each payload mix (1 byte; 1 KiB; sizes spread from 1 byte to 64 KiB) a fresh server with
``--l1-size-gb`` of the budget takes ``--objects`` puts of attention objects along one chain
(a declared layout, so each has its chunk-tree node), 128 to a put. Printed per mix: objects
put and held, bytes charged against the budget, the server's RSS growth, and that growth
over the budget. The server charges each object its payload plus
``cache_server.store_accounts.OBJECT_OVERHEAD_BYTES``: held objects are bounded by the
budget whatever their size, and RSS growth stays within the budget plus a fixed overhead
(Python's heap fragments and the interpreter's own).

Then ``--namespaces`` hellos of fresh namespaces (each with a declared layout, the default
``--max-namespaces``): the server's RSS growth and the size of ``/metrics`` before and after.
A namespace the table forgets is gone (its layout, chunk tree and series).
"""

from __future__ import annotations

import argparse
import random
import time
import urllib.request

from cache_server.client import CacheClient
from testing.server_process import ServerProcess
from validation.reliability import rss_bytes, shmem_bytes

NS = "bench-overhead"
BATCH = 128
MIB = 1 << 20


def _private_rss(pid: int) -> int:
    """RSS less the clients' shared-memory segments the server maps (their pages, not its store)."""
    return rss_bytes(pid) - shmem_bytes(pid)


def _sizes(mix: str, n: int, rng: random.Random) -> list[int]:
    if mix == "1 B":
        return [1] * n
    if mix == "1 KiB":
        return [1024] * n
    return [rng.choice((1, 16, 256, 4096, 65536)) for _ in range(n)]


def run_mix(mix: str, objects: int, budget_gb: float) -> dict[str, float]:
    rng = random.Random(0)
    with ServerProcess("--separate-object-groups", "--l1-size-gb", str(budget_gb), "--chunk-size", "16") as srv, \
            CacheClient(srv.url, timeout_s=60) as c:
        c.hello(NS, 16, attn_groups=[0], state_groups=[1])
        time.sleep(0.5)  # the server's start-up threads settle
        rss0 = _private_rss(srv.proc.pid)
        sizes = _sizes(mix, objects, rng)
        prev = None
        t0 = time.perf_counter()
        for start in range(0, objects, BATCH):
            hashes = [(start + i + 1).to_bytes(32, "big") for i in range(min(BATCH, objects - start))]
            parents = [prev, *hashes[:-1]]
            c.put(NS, [(h, 0, 0, bytes(sizes[start + i])) for i, h in enumerate(hashes)], parent=parents)
            prev = hashes[-1]
        took = time.perf_counter() - t0
        stats = c.stats()
        rss1 = _private_rss(srv.proc.pid)
    budget = stats["capacity_bytes"]
    return {"objects put": objects, "held": stats["objects"], "payload MiB": stats["used_bytes"] / MIB,
            "charged MiB": stats.get("charged_bytes", stats["used_bytes"]) / MIB, "budget MiB": budget / MIB,
            "RSS growth MiB": (rss1 - rss0) / MIB, "growth / budget": (rss1 - rss0) / budget,
            "puts/s": objects / took}


def run_namespaces(n: int) -> dict[str, float]:
    with ServerProcess("--separate-object-groups") as srv, CacheClient(srv.url, timeout_s=60) as c:
        def scrape() -> int:
            with urllib.request.urlopen(srv.http_url + "/metrics", timeout=60) as r:
                return len(r.read())

        c.hello("first", 16, attn_groups=[0], state_groups=[1])
        time.sleep(0.5)
        rss0, size0 = _private_rss(srv.proc.pid), scrape()
        for i in range(n):
            c.hello(f"peer-{i}", 16, attn_groups=[0], state_groups=[1])
        rss1, size1 = _private_rss(srv.proc.pid), scrape()
        held = len(c.stats()["namespaces"])
    return {"hellos": n, "namespaces held": held, "RSS growth MiB": (rss1 - rss0) / MIB,
            "/metrics KB before": size0 / 1000, "/metrics KB after": size1 / 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=160_000)
    ap.add_argument("--budget-gb", type=float, default=0.005)
    ap.add_argument("--namespaces", type=int, default=50_000)
    args = ap.parse_args(argv)
    rows = [(mix, run_mix(mix, args.objects, args.budget_gb)) for mix in ("1 B", "1 KiB", "1 B-64 KiB")]
    cols = list(rows[0][1])
    print(f"{'mix':<10}" + "".join(f"{c:>16}" for c in cols))
    for mix, row in rows:
        print(f"{mix:<10}" + "".join(f"{row[c]:>16.2f}" if isinstance(row[c], float) else f"{row[c]:>16}"
                                     for c in cols))
    ns = run_namespaces(args.namespaces)
    print()
    print("".join(f"{c:>20}" for c in ns))
    print("".join(f"{v:>20.2f}" if isinstance(v, float) else f"{v:>20}" for v in ns.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
