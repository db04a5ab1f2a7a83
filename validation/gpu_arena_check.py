"""Reload on a GPU host: the server's arena straight into device KV pages, against raw pinned H2D.

A same-host reload reads objects where glm-cache-server holds them, its arena (one sealed
memfd the engine maps read-only, :mod:`cache_server.arena`), and copies them into vLLM's KV
pages once (:meth:`connector.kv_pages.PagedKVCache.write_verified`; on a GPU the CPU hashes
the bytes while the copies run). On a GPU the worker page-locks its arena mapping for CUDA
(``cudaHostRegister``, read-only: :meth:`cache_server.client.CacheClient.register_arena_cuda`),
so each host-to-device copy is a DMA from the server's own pages, with no staging copy.

This measures, on the GLM-5.3-Flash TP 4 page layout (one rank, the attention groups, one
chunk = one block of 1152 tokens: 13.4 MB an object), for ``--chunks`` chunks:

* ``pinned H2D``: one copy of the same bytes from a pinned host buffer to the device (the
  bound);
* ``arena, locked``: gets answered in place (a real glm-cache-server process), every object
  written into the device pages and verified, the mapping page-locked;
* ``arena, pageable``: the same before the mapping is locked (what an engine gets where
  ``cudaHostRegister`` is refused);

then reads every page back and compares it with the bytes stored. The last line is JSON
with ``locked_vs_pinned_h2d`` (the reload's throughput over the bound).

Two steps, as ``validation/gpu_pages_check.py`` (the layout comes from vLLM, which the GPU
machine may not have; the server needs pyzmq, msgpack, blake3, xxhash, prometheus-client,
numpy and torch there):

    python -m validation.gpu_pages_check export layouts.json --num-blocks 64  # here, with vLLM
    python -m validation.gpu_arena_check layouts.json [--chunks 64]           # there

Without a CUDA device it runs on the CPU (the page writes of the CPU path; for testing the
script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cache_server.client import CacheClient
from testing.server_process import ServerProcess
from validation.gpu_pages_check import _layout, _sync

NS = "gpu-arena-check"


def _median_s(fn: Any, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(spec: dict[str, Any], chunks: int, reps: int, batch_objects: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    chunks = min(chunks, spec["num_blocks"])  # the export's --num-blocks bounds it
    pages, _raw, groups = _layout(spec, device)
    attn = [g for g in groups if not g.is_state]
    per_chunk = sum(pages.object_bytes(g.group_id, 1) for g in attn)
    nbytes = chunks * per_chunk
    print(f"device: {name}; torch {torch.__version__}; {chunks} chunks x {len(attn)} attention groups, "
          f"{per_chunk / 1e6:.2f} MB a chunk, {nbytes / 1e9:.3f} GB")
    gen = torch.Generator().manual_seed(0)
    objects = {(k, g.group_id): torch.randint(0, 256, (pages.object_bytes(g.group_id, 1),), dtype=torch.uint8,
                                              generator=gen).numpy().tobytes()
               for k in range(chunks) for g in attn}
    key = {k: k.to_bytes(4, "little") * 8 for k in range(chunks)}
    moves = [(k, g.group_id) for k in range(chunks) for g in attn]
    l1_gb = nbytes * 1.2 / (1 << 30) + 0.1
    with ServerProcess("--separate-object-groups", "--chunk-size", str(spec["block_size"]),
                       "--l1-size-gb", f"{l1_gb:.2f}") as srv, CacheClient(srv.url, timeout_s=60.0) as cli:
        cli.hello(NS, spec["block_size"])
        for i in range(0, len(moves), 8):  # through shared memory: large objects land in the arena
            part = moves[i:i + 8]
            assert cli.put(NS, [(key[k], gid, 0, objects[(k, gid)]) for k, gid in part]) == ["stored"] * len(part)

        def reload() -> None:
            for i in range(0, len(moves), batch_objects):
                part = moves[i:i + batch_objects]
                got = cli.get_in_place(NS, [(key[k], gid, 0) for k, gid in part])
                for (k, gid), payload, check in zip(part, got.payloads, got.unverified):
                    assert payload is not None, "an object did not arrive"
                    if check is None:  # not in the arena (it was full): verified by the client
                        pages.write(gid, [k], payload)
                    else:
                        assert pages.write_verified(gid, [k], payload, *check), "checksum mismatch"
                assert time.monotonic() <= got.deadline, "copied after the read pin ended"
                cli.release_pin(got.pin)

        reload()  # maps the arena; first touch of its pages
        in_arena = cli.stats()["shm"].get("arena")
        pageable_s = _median_s(reload, device, reps)
        why = cli.register_arena_cuda() if device.type == "cuda" else "no CUDA device (CPU run)"
        locked_s = _median_s(reload, device, reps) if why is None else None
        exact = all(pages.read(gid, [k]) == objects[(k, gid)] for k, gid in moves)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned_s = _median_s(lambda: dev.copy_(host, non_blocking=True), device, reps)
    gb = nbytes / 1e9
    out = {"device": name, "chunks": chunks, "bytes": nbytes, "exact": exact, "arena": in_arena,
           "pinned_h2d_gbps": round(gb / pinned_s, 2), "pageable_gbps": round(gb / pageable_s, 2),
           "locked_gbps": round(gb / locked_s, 2) if locked_s else None, "not_locked_because": why,
           "locked_vs_pinned_h2d": round(pinned_s / locked_s, 3) if locked_s else None,
           "pageable_vs_pinned_h2d": round(pinned_s / pageable_s, 3)}
    print(f"pinned H2D        {pinned_s:7.3f} s  {gb / pinned_s:6.2f} GB/s  (one copy from a pinned buffer: the bound)")
    if locked_s:
        print(f"arena, locked     {locked_s:7.3f} s  {gb / locked_s:6.2f} GB/s  "
              f"({out['locked_vs_pinned_h2d']:.2f}x the bound; gets in place, pages written and verified)")
    else:
        print(f"arena, locked     not measured: {why}")
    print(f"arena, pageable   {pageable_s:7.3f} s  {gb / pageable_s:6.2f} GB/s  (the mapping not page-locked)")
    print(f"pages byte-exact: {exact}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("layouts", type=Path, help="from python -m validation.gpu_pages_check export")
    ap.add_argument("--layout", default="native")
    ap.add_argument("--chunks", type=int, default=64, help="chunks of one block (1152 tokens at TP 4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-objects", type=int, default=4, help="objects per get (the worker's batch)")
    args = ap.parse_args(argv)
    out = run(json.loads(args.layouts.read_text())[args.layout], args.chunks, args.reps, args.batch_objects)
    print(json.dumps(out))
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
