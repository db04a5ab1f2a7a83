"""The connector's page reader/writer on a GPU, at GLM-5.3-Flash TP 4 page geometry.

The worker side moves cache objects between vLLM's paged KV buffer and bytes with
``connector.kv_pages.PagedKVCache``, the same code on CPU and CUDA. This checks it on a
CUDA buffer laid out exactly as vLLM 0.32 lays out the real model at TP 4 (one rank):
every group's objects read out and written into other blocks come back byte-exact and
leave neighbouring pages untouched; and it times both directions next to plain copies of
the same bytes (device to pinned host, device to pageable host, host to device).

Two steps, because the layout comes from vLLM's own functions (``validation/
glm_flash_kv_layouts.py``) while the GPU machine may have no vLLM:

    python -m validation.gpu_pages_check export layouts.json     # here, with vLLM
    python -m validation.gpu_pages_check run layouts.json        # there (torch only)

``run`` falls back to the CPU when there is no CUDA device (for testing the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from connector.geometry import CacheGroup, LayerPage
from connector.kv_pages import PagedKVCache


def export(path: Path, tp: int, num_blocks: int) -> None:
    from testing import glm_flash_kv_layouts as layouts

    out = {}
    for layout in layouts.LAYOUTS:
        built = layouts.build(layout, tp, num_blocks=num_blocks)
        kv = built.kv_cache_config
        geo = layouts.resolve(built)
        out[layout] = {
            "tp": tp,
            "block_size": built.block_size,
            "num_blocks": kv.num_blocks,
            "tensors": [
                {"offset": t.offset, "layer_stride": t.layer_stride, "block_stride": t.block_stride,
                 "size": t.size, "layers": list(t.layers)}
                for t in kv.kv_cache_tensors
            ],
            "groups": [
                {"group_id": g.group_id, "is_state": g.is_state, "block_size": g.block_size,
                 "replicated_across_tp": g.replicated_across_tp,
                 "layers": [vars(p) for p in g.layers]}
                for g in geo.groups
            ],
        }
    path.write_text(json.dumps(out))
    print(f"wrote {path}: layouts {list(out)}, TP {tp}, {num_blocks} blocks")


def _layout(spec: dict[str, Any], device: torch.device) -> tuple[PagedKVCache, torch.Tensor, tuple[CacheGroup, ...]]:
    groups = tuple(
        CacheGroup(g["group_id"], g["is_state"], g["block_size"],
                   tuple(LayerPage(**p) for p in g["layers"]), g["replicated_across_tp"])
        for g in spec["groups"]
    )
    tensors = [SimpleNamespace(**t) for t in spec["tensors"]]
    size = max(t.size for t in tensors)
    raw = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    views = {}
    for t in tensors:
        for i, name in enumerate(t.layers):
            start = t.offset + i * t.layer_stride
            views[name] = raw[start:]
    kv_config = SimpleNamespace(kv_cache_tensors=tensors, num_blocks=spec["num_blocks"])
    return PagedKVCache(views, kv_config, groups), raw, groups


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn: Any, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(path: Path, reps: int) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    results: dict[str, Any] = {"device": name}
    for layout, spec in json.loads(path.read_text()).items():
        pages, raw, groups = _layout(spec, device)
        nb = spec["num_blocks"]
        exact = True
        rows = []
        for g in groups:
            # An attention object spans a chunk's blocks (here: one block = one chunk at
            # the production chunk of one block); a state object is one block.
            src, dst = [1], [nb - 2]
            before = raw.clone()
            data = pages.read(g.group_id, src)
            pages.write(g.group_id, dst, data)
            # The written pages equal the read ones; every other byte is unchanged.
            again = pages.read(g.group_id, dst)
            changed = (raw != before).nonzero().flatten()
            allowed = torch.zeros_like(raw, dtype=torch.bool)
            for p in g.layers:
                lp = pages._layers[p.name]
                s = lp.base + dst[0] * lp.block_stride
                allowed[s:s + p.page_extent] = True
            ok = again == data and bool(allowed[changed].all())
            exact &= ok
            nbytes = len(data)
            t_read = _time(lambda: pages.read(g.group_id, src), device, reps)
            t_write = _time(lambda: pages.write(g.group_id, dst, data), device, reps)
            flat = raw[:nbytes]
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            pageable = torch.empty(nbytes, dtype=torch.uint8)
            host_bytes = bytes(data)
            t_d2h_pinned = _time(lambda: pinned.copy_(flat), device, reps)
            t_d2h_pageable = _time(lambda: pageable.copy_(flat), device, reps)
            t_h2d = _time(lambda: flat.copy_(torch.frombuffer(bytearray(host_bytes), dtype=torch.uint8).to(device)),
                          device, reps)
            gb = nbytes / 1e9
            row = {"group": g.group_id, "kind": "state" if g.is_state else "attention", "layers": len(g.layers),
                   "object_MB": round(nbytes / 1e6, 2), "exact": ok,
                   "read_GBps": round(gb / t_read, 2), "write_GBps": round(gb / t_write, 2),
                   "d2h_pinned_GBps": round(gb / t_d2h_pinned, 2), "d2h_pageable_GBps": round(gb / t_d2h_pageable, 2),
                   "h2d_from_bytes_GBps": round(gb / t_h2d, 2)}
            rows.append(row)
        print(f"\n{layout} layout, TP {spec['tp']} (one rank), block {spec['block_size']}: byte-exact {exact}")
        print(f"{'group':>5} {'kind':>9} {'layers':>6} {'MB':>7} | {'read':>6} {'write':>6} | "
              f"{'d2h pin':>7} {'d2h page':>8} {'h2d':>6}  (GB/s; read = device pages -> bytes)")
        for r in rows:
            print(f"{r['group']:>5} {r['kind']:>9} {r['layers']:>6} {r['object_MB']:>7} | {r['read_GBps']:>6} "
                  f"{r['write_GBps']:>6} | {r['d2h_pinned_GBps']:>7} {r['d2h_pageable_GBps']:>8} "
                  f"{r['h2d_from_bytes_GBps']:>6}")
        results[layout] = {"exact": exact, "groups": rows}
        del pages, raw
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the layouts (needs vLLM)")
    e.add_argument("path", type=Path)
    e.add_argument("--tp", type=int, default=4)
    e.add_argument("--num-blocks", type=int, default=16)
    r = sub.add_parser("run", help="check and time on CUDA (torch only)")
    r.add_argument("path", type=Path)
    r.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.cmd == "export":
        export(args.path, args.tp, args.num_blocks)
    else:
        res = run(args.path, args.reps)
        ok = all(v["exact"] for k, v in res.items() if k != "device")
        print(json.dumps(res))
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
