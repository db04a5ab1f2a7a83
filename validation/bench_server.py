"""Benchmark glm-cache-server: put/get throughput and latency over real sockets.

Object sizes follow GLM-5.3-Flash at TP 4: about 10 MB of attention (MLA latent + indexer)
and 40 MB of KDA state per rank per 1152-token chunk, plus small objects. Each is set side
by side with an in-process memcpy of the same bytes, the limit any transport can reach.

    python validation/bench_server.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cache_server.process import ServerProcess  # noqa: E402
from connector.client import CacheClient  # noqa: E402

MB = 1_000_000
NS = "bench"


@dataclass
class Case:
    name: str
    nbytes: int
    iters: int


@dataclass
class Result:
    gbps: float
    p50_ms: float
    p99_ms: float


def summarize(times: list[float], nbytes: int) -> Result:
    times_sorted = sorted(times)
    p99 = times_sorted[min(len(times_sorted) - 1, int(round(0.99 * (len(times_sorted) - 1))))]
    return Result(nbytes * len(times) / sum(times) / 1e9, statistics.median(times) * 1e3, p99 * 1e3)


def bench_memcpy(case: Case, bar: tqdm) -> Result:
    src = np.frombuffer(os.urandom(case.nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(case.iters):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
        bar.update()
    return summarize(times, case.nbytes)


def bench_socket(client: CacheClient, case: Case, bar: tqdm) -> tuple[Result, Result]:
    payload = os.urandom(case.nbytes)
    keys = [(os.urandom(32), 0, 0) for _ in range(case.iters)]
    put_times, get_times = [], []
    for key in keys:
        t0 = time.perf_counter()
        result = client.put(NS, [(*key, payload)])
        put_times.append(time.perf_counter() - t0)
        assert result == ["stored"], result
        bar.update()
    for key in keys:
        t0 = time.perf_counter()
        got = client.get(NS, [key])[0]
        get_times.append(time.perf_counter() - t0)
        assert got is not None and got.nbytes == case.nbytes
        bar.update()
    client.clear(NS)
    return summarize(put_times, case.nbytes), summarize(get_times, case.nbytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = ap.parse_args()
    scale = 0.2 if args.quick else 1.0
    cases = [Case("attention 10 MB", 10 * MB, max(3, int(40 * scale))),
             Case("KDA state 40 MB", 40 * MB, max(3, int(20 * scale))),
             Case("small 4 KB", 4096, max(20, int(2000 * scale)))]
    total = sum(c.iters * 3 for c in cases)
    rows = []
    with ServerProcess("--separate-object-groups", "--l1-size-gb", "2", "--log-level", "WARNING") as server, \
            CacheClient(server.url, timeout_s=30.0) as client, \
            tqdm(total=total, desc="benchmark", unit="op", file=sys.stderr) as bar:
        client.hello(NS, 1152)
        for case in cases:
            bar.set_postfix_str(case.name)
            mem = bench_memcpy(case, bar)
            put, get = bench_socket(client, case, bar)
            rows.append((case, mem, put, get))

    print()
    print(f"glm-cache-server over TCP loopback vs in-process memcpy ({os.cpu_count()} cores; server and client "
          "share them)")
    header = (f"{'object':<17}{'n':>6} | {'memcpy GB/s':>11} {'p50 ms':>8} | {'put GB/s':>9} {'p50 ms':>8} "
              f"{'p99 ms':>8} {'vs memcpy':>9} | {'get GB/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'vs memcpy':>9}")
    print(header)
    print("-" * len(header))
    for case, mem, put, get in rows:
        print(f"{case.name:<17}{case.iters:>6} | {mem.gbps:>11.2f} {mem.p50_ms:>8.3f} | {put.gbps:>9.2f} "
              f"{put.p50_ms:>8.3f} {put.p99_ms:>8.3f} {put.gbps / mem.gbps:>8.1%} | {get.gbps:>9.2f} "
              f"{get.p50_ms:>8.3f} {get.p99_ms:>8.3f} {get.gbps / mem.gbps:>8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
