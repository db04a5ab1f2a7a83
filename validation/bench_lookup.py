"""What a router's query costs (issue 33, item 2): a 100k-token ``POST /query`` and protocol
``query`` against a real glm-cache-server, prefix stored as the connector names it.

    .venv/bin/python -m validation.bench_lookup [--tokens 100000] [--chunk 256] [--repeat 30] [--l2]

Prints median and p90 milliseconds, client to answer, for: the whole prefix in L1; a miss
(another salt: every chunk hashed, nothing found; with ``--l2`` one EXISTS round trip of
the first chunk's objects); and with ``--l2`` (a real redis-server) the prefix in L2 only
(L1 cleared: two pipelined EXISTS round trips, the second of every chunk's objects). Also,
in this process, the server's JSON parse and checks alone and its hashing alone (blake3
chain, :func:`cache_server.chunk_keys.chunk_hashes`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time

from cache_server.chunk_keys import chunk_hashes, parent_of
from cache_server.client import CacheClient
from cache_server.prefix_query import parse_query
from testing.server_process import ServerProcess

TOKEN = "bench-lookup-token"
NS = "bench-glm-0123456789abcdef"
ATTN, STATE = [0, 1], [2]


def post(port: int, body: bytes) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/query", body=body, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {TOKEN}"})
        reply = conn.getresponse()
        doc = json.loads(reply.read())
        assert reply.status == 200, doc
        return doc
    finally:
        conn.close()


def timed(fn, repeat: int) -> tuple[float, float, object]:
    out, times = None, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--l2", action="store_true", help="also a real redis-server L2, and the prefix in L2 only")
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(151_000) for _ in range(args.tokens)]
    C = args.chunk
    extra: list[str] = []
    nodes = None
    if args.l2:
        from testing.l2_fixtures import l2_args, wait_written
        from testing.redis_nodes import RedisNodes

        nodes = RedisNodes(1, cluster=False, maxmemory_mb=256).start()
        extra = l2_args(nodes.url)
    try:
        with ServerProcess("--separate-object-groups", "--chunk-size", str(C), *extra, auth_token=TOKEN) as server, \
                CacheClient(server.url, timeout_s=30.0, auth_token=TOKEN, shm=False) as client:
            client.hello(NS, 16, 1, [], attn_groups=ATTN, state_groups=STATE,
                         chunk_keys={"scheme": "lmcache", "lookahead": 0})
            keys = chunk_hashes(tokens, C)
            for at in range(0, len(keys), 64):
                part = keys[at:at + 64]
                items = [(h, g, 0, b"x" * 64) for h in part for g in (*ATTN, *STATE)]
                client.put(NS, items, parent=[parent_of(keys, at + i) for i, _ in enumerate(part) for _ in range(3)])
            print(f"{args.tokens} tokens, chunk {C}: {len(keys)} chunks x {len(ATTN) + len(STATE)} objects stored")
            whole = len(keys) * C
            body = json.dumps({"model": "bench-glm", "token_ids": tokens}).encode()
            salted = json.dumps({"model": "bench-glm", "token_ids": tokens, "cache_salt": "other"}).encode()
            rows = []
            med, p90, doc = timed(lambda: post(server.http_port, body), args.repeat)
            assert doc["default"][NS]["CPU"] == whole, doc
            rows.append(("HTTP /query, whole prefix in L1", med, p90, len(body)))
            med, p90, doc = timed(lambda: post(server.http_port, salted), args.repeat)
            assert doc["default"][NS]["longest_matched"] == 0, doc
            rows.append(("HTTP /query, miss (other salt)", med, p90, len(salted)))
            med, p90, doc = timed(lambda: client.query("bench-glm", tokens), args.repeat)
            assert doc["default"][NS]["CPU"] == whole, doc
            rows.append(("protocol query, whole prefix in L1", med, p90, 4 * len(tokens)))
            med, p90, _ = timed(lambda: parse_query(json.loads(body), False), args.repeat)
            rows.append(("JSON parse and checks alone (in process)", med, p90, 0))
            med, p90, _ = timed(lambda: chunk_hashes(tokens, C), args.repeat)
            rows.append(("hashing alone (blake3 chain, in process)", med, p90, 0))
            if nodes is not None:
                wait_written(lambda: json.loads(_status(server.http_port)), 3 * len(keys), timeout_s=60)
                conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
                conn.request("POST", f"/cache/clear?ns={NS}", body=b'{"tier": "l1", "force": true}',
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
                assert conn.getresponse().status == 200
                conn.close()
                med, p90, doc = timed(lambda: post(server.http_port, body), args.repeat)
                assert doc["default"][NS] == {"longest_matched": whole, "CPU": 0, "STORAGE": whole}, doc
                rows.append(("HTTP /query, prefix in L2 only (EXISTS probe)", med, p90, len(body)))
                med, p90, doc = timed(lambda: post(server.http_port, salted), args.repeat)
                assert doc["default"][NS] == {"longest_matched": 0, "CPU": 0, "STORAGE": 0}, doc
                rows.append(("HTTP /query, miss in both tiers", med, p90, len(salted)))
    finally:
        if nodes is not None:
            nodes.stop()
    print(f"{'case':46s} {'median ms':>10s} {'p90 ms':>8s} {'request bytes':>14s}")
    for name, med, p90, nbytes in rows:
        print(f"{name:46s} {med:10.2f} {p90:8.2f} {nbytes:14d}")


def _status(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/status", headers={"Authorization": f"Bearer {TOKEN}"})
        return conn.getresponse().read()
    finally:
        conn.close()


if __name__ == "__main__":
    main()
