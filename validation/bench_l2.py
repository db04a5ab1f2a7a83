"""Get throughput of the L2 candidates for 13 MB and 40 MB objects (one attention chunk's and
one KDA state's size at TP 4), on this machine, over loopback TCP.

    python -m validation.bench_l2                      # Redis: one node and a 3-node cluster
    python -m validation.bench_l2 --mooncake-python /path/to/venv/bin/python

Redis is measured through the L2 tier's own code (``cache_server.l2``: its client, its
value encoding, pipelined GET, and the checksum verification a promotion does), and as a
raw ``GET`` alone. Mooncake Store (``mooncake-transfer-engine-non-cuda``, TCP transport) runs
in the interpreter given (it is not a dependency of this project): a master with its HTTP
metadata server, one process mounting a 1.5 GiB segment (the storage node), and a client
process that puts and gets. Each figure is the median of ``--repeats`` gets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

from cache_server import protocol as p
from cache_server.l2 import L2Tier
from cache_server.l2_config import L2Config
from cache_server.l2_values import decode_value, encode_value, mac_key
from testing.redis_nodes import RedisNodes
from testing.server_process import free_port

SIZES_MB = (13, 40)


def bench_redis(nodes: RedisNodes, repeats: int) -> dict[int, tuple[float, float]]:
    """size -> (GB/s of a raw GET, GB/s of a verified L2 fetch)."""
    secret = os.urandom(32).hex().encode()  # what --l2-secret-file holds
    tier = L2Tier(L2Config.from_url(nodes.url, secret=secret))
    key_bytes = mac_key(secret)
    client = tier.link.make_client()
    out = {}
    for mb in SIZES_MB:
        payload = os.urandom(mb * 1_000_000)
        key = ("bench-ns", os.urandom(32), 0, 0)
        rkey = tier.link.redis_key(key)
        client.set(rkey, encode_value(key, payload, p.checksum(payload, key[0], key[1:]), None, key_bytes=key_bytes))
        raw, verified = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            value = client.get(rkey)
            raw.append(time.perf_counter() - t)
            t = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            pipe.get(rkey)
            (value,) = pipe.execute()
            decoded = decode_value(key, value, key_bytes=key_bytes)
            verified.append(time.perf_counter() - t)
            assert not isinstance(decoded, str) and decoded[0] == payload
        client.delete(rkey)
        out[mb] = (len(payload) / statistics.median(raw) / 1e9, len(payload) / statistics.median(verified) / 1e9)
    tier.close()
    return out


_MOONCAKE_HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], 1536 << 20, 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"setup failed {rc}", flush=True)
time.sleep(3600)
"""

_MOONCAKE_CLIENT = """
import os, statistics, sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", sys.argv[1], 0, 256 << 20, "tcp", "", sys.argv[2]) == 0
for mb in (13, 40):
    data = os.urandom(mb * 1_000_000)
    assert s.put(f"bench-{mb}", data) == 0
    times = []
    for _ in range(int(sys.argv[3])):
        t = time.perf_counter(); got = s.get(f"bench-{mb}"); times.append(time.perf_counter() - t)
        assert got == data
    print(mb, len(data) / statistics.median(times) / 1e9, flush=True)
"""


def bench_mooncake(python: str, repeats: int) -> dict[int, float] | str:
    """size -> GB/s of Mooncake Store's get over TCP, or why it could not run."""
    bindir = Path(python).parent
    master = bindir / "mooncake_master"
    if not master.exists():
        return f"no {master}"
    work = Path(tempfile.mkdtemp(prefix="bench-mooncake-"))
    rpc, http, metrics = free_port(), free_port(), free_port()
    meta, addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
    procs = []
    try:
        procs.append(subprocess.Popen([str(master), f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                       "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
                                       f"--metrics_port={metrics}"], stdout=open(work / "master.log", "wb"),
                                      stderr=subprocess.STDOUT))
        time.sleep(2)
        (work / "holder.py").write_text(textwrap.dedent(_MOONCAKE_HOLDER))
        (work / "client.py").write_text(textwrap.dedent(_MOONCAKE_CLIENT))
        holder = subprocess.Popen([python, str(work / "holder.py"), meta, addr], stdout=subprocess.PIPE,
                                  stderr=open(work / "holder.log", "wb"), text=True)
        procs.append(holder)
        line = holder.stdout.readline().strip()
        if line != "ready":
            return f"storage node: {line or 'exited'} (see {work})"
        run = subprocess.run([python, str(work / "client.py"), meta, addr, str(repeats)], capture_output=True,
                             text=True, timeout=300)
        if run.returncode:
            return f"client failed: {run.stderr.strip().splitlines()[-1:]}"
        return {int(mb): float(gbs) for mb, gbs in (ln.split() for ln in run.stdout.split("\n") if ln.strip())}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--mooncake-python", help="an interpreter with mooncake-transfer-engine-non-cuda installed")
    args = ap.parse_args()
    rows: list[tuple[str, dict[int, float] | str]] = []
    for label, n, cluster in (("redis 7 one node", 1, False), ("redis 7 cluster of 3", 3, True)):
        with RedisNodes(n, cluster=cluster, maxmemory_mb=1024) as nodes:
            got = bench_redis(nodes, args.repeats)
        rows.append((f"{label}: GET (redis-py + hiredis)", {mb: g[0] for mb, g in got.items()}))
        rows.append((f"{label}: L2 fetch (GET + verify)", {mb: g[1] for mb, g in got.items()}))
    if args.mooncake_python:
        rows.append(("mooncake store, TCP: get", bench_mooncake(args.mooncake_python, args.repeats)))
    print(f"get GB/s, median of {args.repeats}, loopback, {os.cpu_count()} cores")
    print(f"{'candidate':<52}" + "".join(f"{f'{mb} MB':>10}" for mb in SIZES_MB))
    for label, figures in rows:
        if isinstance(figures, str):
            print(f"{label:<52}  not run: {figures}")
        else:
            print(f"{label:<52}" + "".join(f"{figures[mb]:>10.2f}" for mb in SIZES_MB))


if __name__ == "__main__":
    main()
