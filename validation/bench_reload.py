"""Reload of a long prompt at GLM-5.3-Flash TP 4 sizes through the real worker load path.

One TP rank's share of a ``--tokens`` prompt (default 300k) is loaded from a real
glm-cache-server process into a real :class:`~connector.kv_pages.PagedKVCache` over the
KV cache vLLM builds for GLM-5.3-Flash (native layout, TP 4, the served checkpoint's
``index_kpool`` 4: unified block 1152 tokens as seed 003 logs it, MLA latent 11,264 B and
kpool indexer 363 B per token, each its own object group, a 36.9 MB KDA state snapshot in 4
groups; see ``testing/glm_flash_kv_layouts.py``). The chunk is one block, 1152 tokens,
as production runs it (C == N): 13.39 MB of attention a chunk, about 3.5 GB per rank at
300k tokens.

Steps: populate the server (puts, not timed), then time ``WorkerSide``'s load of the whole
hit (streamed in ``batch_bytes`` batches, fetch of batch i+1 overlapping the page writes
of batch i, checksums checked) until it reports the request finished, and verify every
page against what was stored.

The main line is the same-host path: the server keeps the objects in its arena
(``cache_server.arena``), verified once by the server as it placed them (the puts below), the
worker maps it read-only once and copies each object straight into the pages: one pass
(an object the server could not vouch for is hashed on the way,
``PagedKVCache.write_verified``). One worker does every timed reload, as in an engine: the first reload also pays the
first-touch faults of the arena mapping and is reported apart from the median of the
others. Next to it: the copy path of before (the server copies into the client's segment,
the client checksums it there, the page write copies it out; arena refused), TCP, the
gets alone through that copy path, the page scatter alone (``PagedKVCache.write`` from
memory, no network), and memcpy: one contiguous copy of the same number of bytes from a
distinct source of that size into the cache buffer (the figure the ratio is taken
against), plus the figure of before, one 13 MB chunk copied again and again (its source
stays in cache, so it is faster than memory). With ``--json`` the last line is one JSON
object; ``reload_vs_memcpy`` is memcpy's time over the reload's (higher is better).

When memory is short (the server, the paged cache and the source each hold the bytes),
the chunk count is scaled down and the output says so (``scaled_down``).

    python -m validation.bench_reload [--tokens 300000] [--batch-mb 16] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from connector.config import Settings
from connector.metadata import GlmConnectorMetadata, LoadJob, ObjectMove
from connector.worker import batches
from testing.server_process import ServerProcess


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=300_000)
    ap.add_argument("--batch-mb", type=float, default=16.0, help="worker batch_bytes in MiB")
    ap.add_argument("--compare-batch-mb", type=float, nargs="*", default=[],
                    help="also time these batch sizes (MiB), interleaved with the main one")
    ap.add_argument("--repeat", type=int, default=3, help="reloads to time (median reported)")
    ap.add_argument("--old-path", action="store_true",
                    help="also time an unstreamed load: one get of every object under timeout_s "
                         "(holds all payloads at once: needs the bytes again in memory)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line (reload_vs_memcpy and the rest)")
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="use at most this fraction of MemAvailable (default 0.5)")
    args = ap.parse_args(argv)

    from testing.glm_flash_kv_layouts import allocate, build, resolve

    probe = build("native", 4, num_blocks=8)
    geo = resolve(probe)
    attns = list(geo.attn_groups)  # the MLA latent and the kpool indexer: each its own object group
    attn_ids = [a.group_id for a in attns]
    states = list(geo.state_groups)
    C = geo.scheduler_block_size
    chunk_bytes = sum(a.object_bytes(1) for a in attns)
    state_bytes = sum(g.object_bytes(1) for g in states)
    want_chunks = args.tokens // C
    total = want_chunks * chunk_bytes + state_bytes
    # Server copy + paged cache (all groups share the blocks) + one chunk of source.
    per_block = probe.kv_cache_config.kv_cache_tensors[0].size // probe.kv_cache_config.num_blocks
    budget = int(mem_available() * args.mem_fraction)
    chunks = want_chunks
    while chunks > 1 and chunks * chunk_bytes * 1.15 + (chunks + len(states) + 1) * per_block > budget:
        chunks = int(chunks * 0.8)
    scaled = chunks != want_chunks
    if scaled:
        print(f"scaled down: {want_chunks} chunks ({total / 1e9:.2f} GB) do not fit in "
              f"{budget / 1e9:.1f} GB ({args.mem_fraction:.0%} of MemAvailable); using {chunks}")
    tokens = chunks * C
    nbytes = chunks * chunk_bytes + state_bytes
    print(f"GLM-5.3-Flash native TP 4, one rank: {chunks} chunks of {C} tokens ({tokens} tokens), "
          f"attention {chunk_bytes / 1e6:.2f} MB/chunk, KDA state {state_bytes / 1e6:.2f} MB "
          f"({len(states)} groups), {nbytes / 1e9:.3f} GB to load")

    built = build("native", 4, num_blocks=chunks + len(states) + 1)
    geo = resolve(built).with_chunk_size(C)
    raw, views = allocate(built)
    from connector.kv_pages import PagedKVCache
    from connector.worker import WorkerSide

    l1_gb = nbytes * 1.1 / (1 << 30) + 0.1
    settings = Settings(batch_bytes=int(args.batch_mb * (1 << 20)), timeout_s=2.0)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=g)
    cuts = [0]
    for a in attns:
        cuts.append(cuts[-1] + a.object_bytes(1))
    state_src = {s.group_id: torch.randint(0, 256, (s.object_bytes(1),), dtype=torch.uint8, generator=g)
                 for s in states}

    def chunk_payload(k: int, i: int = 0) -> torch.Tensor:
        """Chunk ``k``'s object of attention group ``attns[i]``."""
        t = base[cuts[i]:cuts[i + 1]].clone()
        t[: 8] = torch.tensor(list(k.to_bytes(8, "little")), dtype=torch.uint8)
        t[-8:] = t[:8]
        return t

    rng = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, 150_000, (tokens,), generator=rng).tolist()
    hashes = chunk_hashes(token_ids, C)
    state_blocks = {s.group_id: chunks + i for i, s in enumerate(states)}

    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb",
                       f"{l1_gb:.2f}") as srv:
        ns = "bench-reload"
        with CacheClient(srv.url, timeout_s=60.0) as cli:
            cli.hello(ns, C, world_size=1, replicated_groups=attn_ids, attn_groups=attn_ids,
                      state_groups=[s.group_id for s in states])
            t0 = time.perf_counter()
            per_put = max(1, (64 << 20) // chunk_bytes)
            for k0 in range(0, chunks, per_put):
                ks = range(k0, min(chunks, k0 + per_put))
                items = [(hashes[k], a.group_id, 0, chunk_payload(k, i).numpy().tobytes())
                         for k in ks for i, a in enumerate(attns)]
                res = cli.put(ns, items, parent=[hashes[k - 1] if k else None for k in ks for _ in attns])
                assert all(r == "stored" for r in res), res
            res = cli.put(ns, [(hashes[-1], s.group_id, 0, state_src[s.group_id].numpy().tobytes()) for s in states],
                          parent=[hashes[-2] if chunks > 1 else None] * len(states))
            assert all(r == "stored" for r in res), res
            populate_s = time.perf_counter() - t0
            depth, lease = cli.lookup(ns, hashes, attn_ids, [s.group_id for s in states], 1,
                                      replicated_groups=attn_ids)
            assert depth == chunks, (depth, chunks)

        settings = replace(settings, url=srv.url)
        moves = [ObjectMove(hashes[k], a.group_id, [k]) for k in range(chunks) for a in attns]
        moves += [ObjectMove(hashes[-1], s.group_id, [state_blocks[s.group_id]]) for s in states]

        import cache_server.client.segments as client_segments
        map_arena = client_segments.map_arena

        def reload(cfg: Settings, worker: WorkerSide | None = None, arena: bool = True) -> float | None:
            """Seconds for WorkerSide to load the hit and report it finished (None: failed);
            a fresh worker unless one is given; ``arena`` False: its client maps no arena
            (objects are served by copy, as before it)."""
            keep = worker is not None
            if worker is None:
                worker = WorkerSide(built.vllm_config, built.kv_cache_config, cfg, geo, None)
                worker.register_kv_caches(views)
            client_segments.map_arena = map_arena if arena else (lambda spec: (None, "refused by the benchmark"))
            try:
                return timed_load(worker, keep)
            finally:
                client_segments.map_arena = map_arena

        def timed_load(worker: WorkerSide, keep: bool) -> float | None:
            raw.zero_()
            t0 = time.perf_counter()
            worker.start_load_kv(GlmConnectorMetadata(namespace=ns, loads=[LoadJob("r0", list(moves))]))
            while True:
                res = worker.get_transfer_results()
                if "r0" in res.finished_recving:
                    break
                time.sleep(0.001)
            took = time.perf_counter() - t0
            if not keep:
                worker.shutdown()
            return None if "r0" in res.failed_recving else took

        def get_only(cfg: Settings) -> float:
            """Seconds for the worker's gets alone (same batches, order, deadlines; fresh
            client): the server's copies and the checksums, no page writes."""
            order = sorted(moves, key=lambda m: m.group_id in attn_ids)  # states first
            sizes = [next(x for x in geo.groups if x.group_id == m.group_id).object_bytes(1) for m in order]
            with CacheClient(cfg.url, timeout_s=cfg.timeout_s, shm=cfg.shm) as c:
                t0 = time.perf_counter()
                for idx in batches(sizes, cfg.batch_bytes):
                    got = c.get(ns, [(order[j].chunk_hash, order[j].group_id, 0) for j in idx],
                                timeout_s=cfg.deadline_s(sum(sizes[j] for j in idx)))
                    assert all(g is not None for g in got)
                    del got  # the region is free for the next get, as after a page write
                return time.perf_counter() - t0

        # Interleaved over the batch sizes compared, so that the machine's load (shared
        # cores) falls on all of them alike; a failed run (deadline missed) is counted.
        sizes_mb = [args.batch_mb, *args.compare_batch_mb]
        by_size: dict[float, list[float]] = {mb: [] for mb in sizes_mb}
        failed_by_size: dict[float, int] = {mb: 0 for mb in sizes_mb}
        tcp_runs: list[float] = []
        get_runs: list[float] = []
        copy_runs: list[float] = []
        # The engine's worker: one for every arena reload (its mapping is made once).
        engine = WorkerSide(built.vllm_config, built.kv_cache_config, settings, geo, None)
        engine.register_kv_caches(views)
        first = reload(settings, engine)  # maps the arena: first-touch faults
        # memcpy of the same bytes: the stored objects lie one after another in the arena, so
        # one contiguous copy of nbytes from there (the source the reload reads, already
        # mapped) into the cache buffer; timed between the reloads, on the loader's kind of
        # thread, so that the machine's load falls on both alike.
        got = engine._load_client.get_in_place(ns, [(m.chunk_hash, m.group_id, 0) for m in moves], timeout_s=60)
        arena_lo = None
        if got.pin and all(v is not None and v.readonly for v in got.payloads):  # all in the arena
            addrs = [np.frombuffer(v, dtype=np.uint8).ctypes.data for v in got.payloads]
            lo, hi = min(addrs), max(a + v.nbytes for a, v in zip(addrs, got.payloads))
            arena_lo = lo if hi - lo < nbytes + 64 * len(moves) else None
        engine._load_client.release_pin(got.pin)
        del got
        flat = raw.view(torch.uint8)
        copier = ThreadPoolExecutor(1)

        def memmove() -> float:  # glibc's, one call: non-temporal stores at this size
            t0 = time.perf_counter()
            ctypes.memmove(flat.data_ptr(), arena_lo, nbytes)
            return time.perf_counter() - t0

        memcpy_runs: list[float] = []
        for _ in range(args.repeat):
            if arena_lo is not None:
                memcpy_runs.append(copier.submit(memmove).result())
            get_runs.append(get_only(settings))
            took = reload(replace(settings, shm=False))  # the same, with shared memory refused
            if took is not None:
                tcp_runs.append(took)
            took = reload(settings, arena=False)  # the copy path of before: through the segment
            if took is not None:
                copy_runs.append(took)
            for mb in sizes_mb:
                took = reload(settings, engine) if mb == args.batch_mb else \
                    reload(replace(settings, batch_bytes=int(mb * (1 << 20))))
                if took is None:
                    failed_by_size[mb] += 1
                    print(f"a reload ({mb:g} MiB batches) missed its deadline (the worker fell back "
                          "to recompute)", file=sys.stderr)
                else:
                    by_size[mb].append(took)
        runs, failed_runs = by_size[args.batch_mb], failed_by_size[args.batch_mb]
        if not runs:
            print("every reload FAILED", file=sys.stderr)
            return 1
        load_s = sorted(runs)[len(runs) // 2]
        get_s = sorted(get_runs)[len(get_runs) // 2]
        in_place = engine._load_client._shm.arena is not None
        # The last reload may have been another batch size: load once more to verify.
        if sizes_mb[-1] != args.batch_mb and reload(settings, engine) is None:
            print("verification reload FAILED", file=sys.stderr)
            return 1
        # Every page must be the bytes stored.
        pages = PagedKVCache(views, built.kv_cache_config, geo.groups)
        for k in range(chunks):
            for i, a in enumerate(attns):
                assert pages.read(a.group_id, [k]) == chunk_payload(k, i).numpy().tobytes(), f"chunk {k}"
        for s in states:
            assert pages.read(s.group_id, [state_blocks[s.group_id]]) == state_src[s.group_id].numpy().tobytes()
        old = None
        if args.old_path:
            # --old-path: one get of every object under one timeout_s, over TCP, no batches.
            old = reload(replace(settings, batch_bytes=1 << 62, min_rate_mb_s=1e15, shm=False))
        engine.shutdown()
        engine._load_client._shm.arena = None  # unmapped now: the server's memory goes with it
        del engine

    # Same bytes, no network: the page scatter from memory, and a plain memcpy.
    payloads = [[chunk_payload(k, i).numpy().tobytes() for i in range(len(attns))] for k in range(min(chunks, 4))]
    state_bytes_src = {s.group_id: state_src[s.group_id].numpy().tobytes() for s in states}

    def scatter() -> float:
        t0 = time.perf_counter()
        for k in range(chunks):
            for i, a in enumerate(attns):
                pages.write(a.group_id, [k], payloads[k % len(payloads)][i])
        for s in states:
            pages.write(s.group_id, [state_blocks[s.group_id]], state_bytes_src[s.group_id])
        return time.perf_counter() - t0

    copier.shutdown()
    source = None
    if arena_lo is None:  # no arena (served by copy): a distinct source of nbytes, faulted in
        source = torch.empty(nbytes, dtype=torch.uint8)
        source.fill_(7)
        arena_lo = source.data_ptr()

    def memcpy() -> float:  # torch's copy, from a distinct source of nbytes
        src = torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(7)
        t0 = time.perf_counter()
        flat[:nbytes].copy_(src)
        return time.perf_counter() - t0

    def memcpy_hot() -> float:
        t0 = time.perf_counter()
        pos = 0
        for _ in range(chunks):
            flat[pos: pos + chunk_bytes].copy_(base)
            pos = (pos + chunk_bytes) % (flat.numel() - chunk_bytes)
        for s in states:
            flat[: state_src[s.group_id].numel()].copy_(state_src[s.group_id])
        return time.perf_counter() - t0

    # On a thread of their own, as the worker's copies run: on the main thread torch's
    # copies fan out to its OpenMP team, which on a loaded 2-core machine measured 2-10x
    # slower and far noisier than the same copies on a plain thread.
    with ThreadPoolExecutor(1) as pool:
        scatter_s = sorted(pool.submit(scatter).result() for _ in range(args.repeat))[args.repeat // 2]
        torch_copy_s = min(pool.submit(memcpy).result() for _ in range(2))  # best of two: for reference only
        if not memcpy_runs:
            memcpy_runs = [pool.submit(memmove).result() for _ in range(args.repeat)]
        memmove_s = sorted(memcpy_runs)[len(memcpy_runs) // 2]
        memcpy_s = memmove_s
        hot_s = sorted(pool.submit(memcpy_hot).result() for _ in range(args.repeat))[args.repeat // 2]

    gb = nbytes / 1e9
    out = {
        "tokens": tokens, "requested_tokens": args.tokens, "scaled_down": scaled, "chunk_tokens": C,
        "chunks": chunks, "bytes": nbytes, "batch_bytes": settings.batch_bytes,
        "populate_s": round(populate_s, 3),
        "reload_runs_s": [round(r, 3) for r in runs], "reload_failed_runs": failed_runs,
        "reload_s": round(load_s, 3), "reload_gbps": round(gb / load_s, 3),
        "reload_tcp_runs_s": [round(r, 3) for r in tcp_runs],
        "get_only_s": round(get_s, 3), "get_only_gbps": round(gb / get_s, 3),
        "get_only_runs_s": [round(r, 3) for r in get_runs],
        "scatter_s": round(scatter_s, 3), "scatter_gbps": round(gb / scatter_s, 3),
        "memcpy_s": round(memcpy_s, 3), "memcpy_gbps": round(gb / memcpy_s, 3),
        "memcpy_torch_copy_s": round(torch_copy_s, 3), "memcpy_libc_memmove_s": round(memmove_s, 3),
        "memcpy_hot_source_s": round(hot_s, 3), "memcpy_hot_source_gbps": round(gb / hot_s, 3),
        "reload_vs_memcpy": round(memcpy_s / load_s, 3), "in_place": in_place,
        "first_reload_s": round(first, 3) if first is not None else None,
        "first_reload_gbps": round(gb / first, 3) if first is not None else None,
        "reload_copy_path_runs_s": [round(r, 3) for r in copy_runs],
        "reload_copy_path_s": round(sorted(copy_runs)[len(copy_runs) // 2], 3) if copy_runs else None,
        "reload_by_batch_mb": {f"{mb:g}": {"median_s": round(sorted(r)[len(r) // 2], 3) if r else None,
                                           "gbps": round(gb / sorted(r)[len(r) // 2], 3) if r else None,
                                           "runs_s": [round(x, 3) for x in r], "failed": failed_by_size[mb]}
                               for mb, r in by_size.items()},
        "old_single_get_deadline_s": settings.timeout_s,
        "old_single_get_s": None if not args.old_path else (round(old, 3) if old is not None else "failed"),
        "new_deadline_per_batch_s": round(settings.deadline_s(settings.batch_bytes), 3),
    }
    print(f"machine load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"reload  {load_s:7.3f} s  {gb / load_s:6.2f} GB/s  (server -> worker -> paged cache, verified; "
          + ("in place from the server's arena, one pass (verified by the server when placed); median of "
                "the reloads after the first)" if in_place
             else "NO ARENA: served by copy)"))
    if first is not None:
        print(f"  first   {first:7.3f} s  {gb / first:6.2f} GB/s  (the first reload: maps the arena, first-touch faults)")
    if copy_runs:
        copy_s = sorted(copy_runs)[len(copy_runs) // 2]
        print(f"  by copy {copy_s:7.3f} s  {gb / copy_s:6.2f} GB/s  (arena refused: server -> segment -> checksum "
              "-> pages, the path of before)")
    if tcp_runs:
        tcp_s = sorted(tcp_runs)[len(tcp_runs) // 2]
        print(f"  over TCP {tcp_s:7.3f} s  {gb / tcp_s:6.2f} GB/s  (same path, shm=false: "
              f"{len(tcp_runs)} of {args.repeat} in time)")
    print(f"get only {get_s:6.3f} s  {gb / get_s:6.2f} GB/s  (the same gets, no page writes: the server's "
          "copy into the segment and the checksum in place)")
    print(f"scatter {scatter_s:7.3f} s  {gb / scatter_s:6.2f} GB/s  (PagedKVCache.write from memory)")
    print(f"memcpy  {memcpy_s:7.3f} s  {gb / memcpy_s:6.2f} GB/s  (one libc memmove of the same {nbytes} bytes, "
          + ("from the arena where the reload reads them, timed between the reloads)" if in_place
             else "from a distinct source)"))
    print(f"  torch {torch_copy_s:7.3f} s  {gb / torch_copy_s:6.2f} GB/s  (torch copy_ of {nbytes} bytes from a "
          "distinct source, after the server has gone: for reference)")
    print(f"  hot   {hot_s:7.3f} s  {gb / hot_s:6.2f} GB/s  (the figure of before: one {chunk_bytes / 1e6:.1f} MB "
          "chunk copied again and again, its source in cache)")
    for mb, r in by_size.items():
        if mb != args.batch_mb and r:
            med = sorted(r)[len(r) // 2]
            print(f"  reload with {mb:g} MiB batches: {med:.3f} s  {gb / med:.2f} GB/s "
                  f"({failed_by_size[mb]} missed deadlines)")
    print(f"reload / memcpy throughput: {memcpy_s / load_s:.2f}x (goal >= 0.8)")
    if args.old_path:
        print("unstreamed (one get, one 2 s timeout): " + (f"{old:.3f} s" if old is not None else "FAILED (recompute)"))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
