"""Benchmark glm-cache-server: put/get throughput and latency over real sockets.

Object sizes follow GLM-5.3-Flash at TP 4: about 10 MB of attention (MLA latent + indexer)
and 40 MB of KDA state per rank per 1152-token chunk, plus small objects. In one run, for
each size, side by side:

* ``memcpy``: an in-process copy of the same bytes into a buffer already touched, the
  limit any transport can reach;
* ``checksum``: the object checksum (``protocol.checksum``, XXH3-128) of the same bytes,
  which every get verifies on the client: a shared-memory get costs about a memcpy (the
  server's copy into the segment) plus this;
* ``copy_verify``: that memcpy, then that checksum of the copy: the floor of a
  shared-memory get by this design (the server copies, then the client verifies every
  byte), without the round trip. Doing both at once does not beat it on a 2-core machine
  (measured: copying in 2-8 MB slices on one thread while another hashes the slices done,
  4.7-4.9 ms against 4.5-4.9 ms in turn for 40 MB: both are bound by memory bandwidth);
* ``raw_zmq_get``: a bare pyzmq ROUTER in another process answering a DEALER with the
  same bytes over TCP loopback (no msgpack, no store, no checksum): the socket's limit;
* ``tcp_put`` / ``tcp_get``: a real ``glm-cache-server`` process (``ServerProcess``) and a
  ``CacheClient(shm=False)``: frames over TCP loopback, checksums verified;
* ``shm_put`` / ``shm_get``: the same server and a ``CacheClient`` that agreed on shared
  memory at hello: payloads through /dev/shm, checksums verified. ``shm_get`` returns views
  of the segment (no client-side copy);
* ``shm_get_into``: that get, then one copy of the payload from the segment view into a
  buffer already touched, as the connector's load path copies it into the paged KV cache:
  what a same-host load of one object costs, end to end (the server's copy, the checksum
  pass, the copy out).

The modes are interleaved iteration by iteration (the cores are shared with whatever else
runs), and GB/s is taken from the median time.

Then the aggregate of N concurrent clients (separate processes, as engines are), each
getting 40 MB objects over and over, for N = 1, 8, 16, over TCP, through shared memory
(the server copies into each client's segment, the client checksums it there) and read in
place from the server's arena (``cache_server.arena``: ``get_in_place``, no copy; the same
result as a shm get, a verified view: the server verified each object once as it placed it,
and where it could not say so the client hashes the arena bytes), with the
p99 latency of a ``ping`` sent meanwhile; ``--compare-workers`` repeats that against a
server with one worker thread (a single request loop).

    python -m validation.bench_server [--quick] [--json] [--workers N] [--clients 1,8,16] [--compare-workers]

With ``--json`` the last line is one JSON object: GB/s per object size and mode, and the
concurrent aggregates under ``"concurrent"``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import zmq
from tqdm import tqdm

from cache_server import protocol as p
from cache_server.client import CacheClient
from testing.server_process import ServerProcess, free_port

MB = 1_000_000
NS = "bench"


@dataclass
class Case:
    name: str
    label: str  # the JSON key
    nbytes: int
    iters: int


@dataclass
class Result:
    gbps: float
    p50_ms: float
    p99_ms: float


def summarize(times: list[float], nbytes: int) -> Result:
    """GB/s from the median time (this machine's cores are shared: the median is what a
    transfer costs, the mean mostly what the neighbours did), p50 and p99 in ms."""
    times_sorted = sorted(times)
    p99 = times_sorted[min(len(times_sorted) - 1, int(round(0.99 * (len(times_sorted) - 1))))]
    p50 = statistics.median(times)
    return Result(nbytes / p50 / 1e9, p50 * 1e3, p99 * 1e3)


def _raw_router(port: int, nbytes: int, ready: mp.Event) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    data = os.urandom(nbytes)
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            break
        sock.send_multipart([frames[0], b"h", data], copy=False)
    sock.close(linger=0)
    ctx.term()


class RawZmq:
    """A bare ROUTER in another process that answers every request with the same bytes:
    what TCP loopback and ZMQ allow, with no msgpack, store or checksum."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        port = free_port()
        spawn = mp.get_context("spawn")
        ready = spawn.Event()
        self.proc = spawn.Process(target=_raw_router, args=(port, nbytes, ready), daemon=True)
        self.proc.start()
        ready.wait(60)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def get(self) -> None:
        self.sock.send(b"get")
        frames = self.sock.recv_multipart(copy=False)
        assert frames[-1].buffer.nbytes == self.nbytes

    def close(self) -> None:
        self.sock.send(b"stop")
        self.proc.join(10)
        self.sock.close(linger=0)
        self.ctx.term()


def bench_case(case: Case, tcp: CacheClient, shm: CacheClient) -> dict[str, Result]:
    """Every mode of one object size, interleaved iteration by iteration so that each sees
    the same load from whatever else runs on the machine."""
    payload = os.urandom(case.nbytes)
    src = np.frombuffer(payload, dtype=np.uint8)
    dst = np.empty_like(src)
    into = np.zeros_like(src)  # the engine's cache, already touched
    raw = RawZmq(case.nbytes)
    times: dict[str, list[float]] = {m: [] for m in ("memcpy", "checksum", "copy_verify", "raw_zmq_get", "tcp_put",
                                                      "tcp_get", "shm_put", "shm_get", "shm_get_into")}
    keys = {c: [(os.urandom(32), 0, 0) for _ in range(case.iters + 2)] for c in ("tcp", "shm")}
    clients = {"tcp": tcp, "shm": shm}

    def timed(mode: str, i: int, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        if i >= 2:  # the first two pay connections, first touches and allocations
            times[mode].append(time.perf_counter() - t0)
        return out

    for i in range(case.iters + 2):
        for c, client in clients.items():
            result = timed(f"{c}_put", i, lambda: client.put(NS, [(*keys[c][i], payload)]))
            assert result == ["stored"], result
    for i in range(case.iters + 2):
        timed("memcpy", i, lambda: np.copyto(dst, src))
        timed("checksum", i, lambda: p.checksum(payload, NS, keys["tcp"][i]))
        timed("copy_verify", i, lambda: (np.copyto(dst, src), p.checksum(dst, NS, keys["tcp"][i])))
        timed("raw_zmq_get", i, raw.get)
        for c, client in clients.items():
            got = timed(f"{c}_get", i, lambda: client.get(NS, [keys[c][i]])[0])
            assert got is not None and got.nbytes == case.nbytes
            del got  # an engine copies the payload into its cache and lets go of it
        timed("shm_get_into", i, lambda: _get_into(shm, keys["shm"][i], into))
    raw.close()
    tcp.clear(NS)
    return {mode: summarize(t, case.nbytes) for mode, t in times.items()}


MODES = ("tcp", "shm", "arena")


def _get_into(client: CacheClient, key: tuple[bytes, int, int], into: np.ndarray) -> None:
    """Get one object and copy it from the returned view into ``into``, then let the view go."""
    got = client.get(NS, [key])[0]
    assert got is not None and got.nbytes == into.nbytes
    np.copyto(into, np.frombuffer(got, dtype=np.uint8))


def _arena_get(client: CacheClient, key: tuple[bytes, int, int]) -> int:
    """Get one object read in place from the server's arena, verified (by the server when it
    placed it, else here: its checksum over the arena bytes), then hand the pin back; its
    size."""
    got = client.get_in_place(NS, [key])
    view, check = got.payloads[0], got.unverified[0]
    assert view is not None and view.readonly and got.pin, "not in the arena"
    if check is not None:
        h = xxhash.xxh3_128(check[0])
        h.update(view)
        assert h.digest() == check[1]
    client.release_pin(got.pin)
    return view.nbytes


def _concurrent_client(url: str, mode: str, keys: list[bytes], rounds: int, nbytes: int,
                       barrier: mp.Barrier, out: mp.Queue) -> None:
    with CacheClient(url, timeout_s=120.0, shm=mode != "tcp") as client:
        client.hello(NS, 1152)
        assert client.transport == ("tcp" if mode == "tcp" else "shm"), (client.transport, client.shm_refusal)
        key_list = [(k, 0, 0) for k in keys]
        got = client.get(NS, key_list[:1])[0]  # warm up: connection, segment
        assert got is not None
        del got
        if mode == "arena":
            for key in key_list:  # and the arena mapping's first-touch faults
                _arena_get(client, key)
        barrier.wait()
        t0 = time.perf_counter()
        moved = 0
        for _ in range(rounds):
            for key in key_list:
                if mode == "arena":
                    moved += _arena_get(client, key)
                    continue
                got = client.get(NS, [key])[0]
                assert got is not None and got.nbytes == nbytes
                moved += got.nbytes
                del got
        out.put((t0, time.perf_counter(), moved))
        client.unpin()


def bench_concurrent(url: str, mode: str, clients: int, nbytes: int, keys: list[bytes], rounds: int,
                     probe: CacheClient) -> tuple[float, float]:
    """Aggregate GB/s of ``clients`` processes getting ``keys`` over and over, and the p99
    in ms of a ``ping`` sent meanwhile (does a small request wait behind the transfers?)."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(clients + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=_concurrent_client, args=(url, mode, keys, rounds, nbytes, barrier, out))
             for _ in range(clients)]
    for proc in procs:
        proc.start()
    barrier.wait()
    results, pings = [], []
    deadline = time.monotonic() + 600
    while len(results) < clients and time.monotonic() < deadline:
        try:
            results.append(out.get(timeout=0.01))
            continue
        except queue.Empty:
            pass
        t0 = time.perf_counter()
        probe.ping()
        pings.append(time.perf_counter() - t0)
    for proc in procs:
        proc.join(60)
        if proc.exitcode != 0:
            raise RuntimeError(f"a concurrent client exited with {proc.exitcode}")
    start = min(r[0] for r in results)
    end = max(r[1] for r in results)
    pings.sort()
    p99 = pings[min(len(pings) - 1, int(round(0.99 * (len(pings) - 1))))] * 1e3 if pings else float("nan")
    return sum(r[2] for r in results) / (end - start) / 1e9, p99


def run_concurrency(url: str, counts: list[int], rounds: int, nbytes: int, bar: tqdm, tag: str
                    ) -> dict[str, dict[str, float]]:
    """Every client count over TCP, through shared memory and in place from the arena
    against the server at ``url``."""
    out: dict[str, dict[str, float]] = {f"{m}_{x}": {} for m in MODES for x in ("get", "ping_p99_ms")}
    keys = [os.urandom(32) for _ in range(4)]
    payload = os.urandom(nbytes)
    with CacheClient(url, timeout_s=60.0, shm=False) as probe, CacheClient(url, timeout_s=60.0) as saver:
        saver.hello(NS, 1152)  # put through shared memory: into the server's arena
        assert saver.put(NS, [(k, 0, 0, payload) for k in keys]) == ["stored"] * len(keys)
        for mode in MODES:
            for n in counts:
                bar.set_postfix_str(f"{tag}: {n} {mode} clients")
                gbps, p99 = bench_concurrent(url, mode, n, nbytes, keys, rounds, probe)
                out[f"{mode}_get"][str(n)], out[f"{mode}_ping_p99_ms"][str(n)] = gbps, p99
                bar.update()
        probe.clear(NS)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    ap.add_argument("--workers", type=int, default=None, help="the server's --workers (default: its default)")
    ap.add_argument("--clients", default="1,8,16", help="concurrent client counts (default 1,8,16)")
    ap.add_argument("--compare-workers", action="store_true",
                    help="run the concurrent clients against a --workers 1 server too")
    args = ap.parse_args()
    scale = 0.25 if args.quick else 1.0
    cases = [Case("KDA state 40 MB", "40MB", 40 * MB, max(4, int(20 * scale))),
             Case("attention 10 MB", "10MB", 10 * MB, max(4, int(40 * scale))),
             Case("small 4 KB", "4KB", 4096, max(20, int(1000 * scale)))]
    counts = [int(x) for x in args.clients.split(",") if x]
    server_args = ["--separate-object-groups", "--l1-size-gb", "4", "--log-level", "WARNING"]
    if args.workers is not None:
        server_args += ["--workers", str(args.workers)]
    figures: dict[str, dict[str, float]] = {}
    rows = []
    load = os.getloadavg()  # the cores may be shared: say how busy they were
    steps = len(cases) * 4 + len(MODES) * len(counts) * (2 if args.compare_workers else 1)
    with ServerProcess(*server_args) as server, \
            CacheClient(server.url, timeout_s=60.0, shm=False) as tcp, \
            CacheClient(server.url, timeout_s=60.0) as shm, \
            tqdm(total=steps, desc="benchmark", unit="step", file=sys.stderr) as bar:
        tcp.hello(NS, 1152)
        shm.hello(NS, 1152)
        if shm.transport != "shm":
            raise RuntimeError(f"the server refused shared memory: {shm.shm_refusal}")
        for case in cases:
            bar.set_postfix_str(case.name)
            res = bench_case(case, tcp, shm)
            bar.update(4)
            rows.append((case, res["memcpy"], res["checksum"], res["copy_verify"], res["raw_zmq_get"], res["tcp_put"],
                         res["tcp_get"], res["shm_put"], res["shm_get"], res["shm_get_into"]))
            figures[case.label] = {mode: r.gbps for mode, r in res.items()}
        rounds = 2 if args.quick else 4
        concurrent = run_concurrency(server.url, counts, rounds, 40 * MB, bar, "server")
        stats = shm.stats()
        single: dict[str, dict[str, float]] | None = None
        if args.compare_workers:  # the same clients against a server with one worker thread
            with ServerProcess(*server_args, "--workers", "1") as one:
                single = run_concurrency(one.url, counts, rounds, 40 * MB, bar, "1 worker")

    print()
    print(f"glm-cache-server (real process, loopback) vs in-process memcpy and a bare pyzmq ROUTER/DEALER; "
          f"{os.cpu_count()} cores shared by server and clients; server workers "
          f"{stats['config']['workers']}, ZMQ I/O threads {stats['config']['io_threads']}; load average "
          f"{load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("copy+sum: memcpy, then the checksum of the copy, a shared-memory get's floor by this design; "
          "get/floor: the shm get against it; +copy: the shm get, then one copy of the payload out of the "
          "segment (what a load into the KV cache costs)")
    header = (f"{'object':<16}{'n':>5} | {'memcpy':>7} {'checksum':>8} {'copy+sum':>8} {'raw zmq':>8} | {'tcp put':>8} "
              f"{'tcp get':>8} {'p50 ms':>7} {'p99 ms':>7} {'get/raw':>8} | {'shm put':>8} {'shm get':>8} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'get/memcpy':>10} {'get/floor':>9} | {'+copy':>6} {'/memcpy':>7}")
    print("GB/s" + " " * (len(header) - 4))
    print(header)
    print("-" * len(header))
    for case, mem, csum, floor, raw, tput, tget, sput, sget, sinto in rows:
        print(f"{case.name:<16}{case.iters:>5} | {mem.gbps:>7.2f} {csum.gbps:>8.2f} {floor.gbps:>8.2f} "
              f"{raw.gbps:>8.2f} | {tput.gbps:>8.2f} {tget.gbps:>8.2f} {tget.p50_ms:>7.2f} {tget.p99_ms:>7.2f} "
              f"{tget.gbps / raw.gbps:>7.2f}x | "
              f"{sput.gbps:>8.2f} {sget.gbps:>8.2f} {sget.p50_ms:>7.2f} {sget.p99_ms:>7.2f} "
              f"{sget.gbps / mem.gbps:>9.2f}x {sget.gbps / floor.gbps:>8.2f}x | "
              f"{sinto.gbps:>6.2f} {sinto.gbps / mem.gbps:>6.2f}x")
    print()
    print(f"aggregate GB/s of N concurrent client processes, each getting 40 MB objects ({rounds * 4} gets per "
          "client), and the p99 of a ping sent meanwhile; arena: a view of the server's arena, verified (once, "
          "by the server as it placed the object; no copy by the server, none by the client)")
    sides = [(f"{stats['config']['workers']} workers", concurrent)] + ([("1 worker", single)] if single else [])
    print(f"{'':>8} | " + " | ".join(f"{name:^64}" for name, _ in sides))
    print(f"{'clients':>8} | " + " | ".join(" ".join(f"{m + ' get':>9} {'vs 1':>6} {'ping p99':>8}" for m in MODES)
                                             for _ in sides))
    first = str(counts[0])
    for n in map(str, counts):
        cells = []
        for _, d in sides:
            cells.append(" ".join(f"{d[m + '_get'][n]:>9.2f} {d[m + '_get'][n] / d[m + '_get'][first]:>5.2f}x "
                                  f"{d[m + '_ping_p99_ms'][n]:>6.1f}ms" for m in MODES))
        print(f"{n:>8} | " + " | ".join(cells))
    if args.json:
        print(json.dumps({**{k: {m: round(v, 3) for m, v in d.items()} for k, d in figures.items()},
                          "concurrent": {m: {n: round(v, 3) for n, v in d.items()} for m, d in concurrent.items()},
                          **({"concurrent_1_worker": {m: {n: round(v, 3) for n, v in d.items()}
                                                      for m, d in single.items()}} if single else {}),
                          "cores": os.cpu_count(), "server_workers": stats["config"]["workers"],
                          "loadavg_start": round(load[0], 2), "loadavg_end": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
