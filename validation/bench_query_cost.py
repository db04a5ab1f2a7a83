"""What a worst-case router query costs the engines sharing its server (issue 47, item 3).

    python -m validation.bench_query_cost [--tokens 65536] [--namespaces 4] [--seconds 10]

A real glm-cache-server with two models of ``--namespaces`` namespaces each, 16 groups on
as many ranks as it takes, chunk size 16: model ``over``, as many objects per chunk as one
lookup may name (``MAX_LOOKUP_OBJECTS`` over the query's chunks: the query the issue timed,
3.4 s there); model ``largest``, the largest query accepted (``MAX_QUERY_OBJECTS`` over every
namespace together). Printed: each query's own time (client to answer, or to its refusal),
and an engine's L1 gets of one small object, p50 / p99 / max milliseconds, alone and while
three clients send the largest accepted query in a loop.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from cache_server import protocol as p
from cache_server.client import CacheClient
from cache_server.client.errors import CacheServerError
from testing.server_process import ServerProcess

MODELS = ("over", "largest")
C = 16


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"p50 {statistics.median(xs) * 1e3:8.2f}  p99 {xs[int(len(xs) * 0.99) - 1] * 1e3:8.2f}  "
            f"max {xs[-1] * 1e3:8.2f}  (n {len(xs)})")


def _gets(url: str, seconds: float) -> list[float]:
    out = []
    with CacheClient(url, timeout_s=60, shm=False) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            assert c.get("engine", [(bytes(32), 0, 0)])[0] is not None
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--namespaces", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    chunks = args.tokens // C
    worlds = {"over": max(1, p.MAX_LOOKUP_OBJECTS // chunks // 16),  # 16 groups on ``world`` ranks
              "largest": max(1, p.MAX_QUERY_OBJECTS // args.namespaces // chunks // 16)}
    attn, state = list(range(15)), [15]
    tokens = list(range(args.tokens))
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        with CacheClient(srv.url, timeout_s=60, shm=False) as c:
            c.hello("engine", C)
            c.put("engine", [(bytes(32), 0, 0, b"x" * 4096)])
            for model in MODELS:
                for i in range(args.namespaces):
                    c.hello(f"{model}-{i:016x}", C, worlds[model], attn_groups=attn, state_groups=state)
                t0 = time.perf_counter()
                try:
                    c.query(model, tokens)
                    outcome = "answered"
                except CacheServerError as e:
                    outcome = f"refused ({e.code})"
                print(f"{model}: one query of {args.tokens} tokens over {args.namespaces} namespaces x {chunks} "
                      f"chunks x {16 * worlds[model]} objects: {outcome} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        print(f"engine gets alone:          {_ms(_gets(srv.url, args.seconds))}")
        stop = threading.Event()
        answered = [0, 0]

        def loop() -> None:
            with CacheClient(srv.url, timeout_s=60, shm=False) as q:
                while not stop.is_set():
                    try:
                        q.query("largest", tokens)
                        answered[0] += 1
                    except CacheServerError:
                        answered[1] += 1

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        busy = _gets(srv.url, args.seconds)
        stop.set()
        for t in threads:
            t.join(120)
        print(f"engine gets beside queries: {_ms(busy)}   (queries answered {answered[0]}, refused {answered[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
