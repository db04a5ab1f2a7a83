"""What storing the MLA latent and the indexer cache as separate object groups costs on the
load and save paths, for the plugin's layout (one cache row per token holds both).

    python -m validation.bench_split [--tp 4] [--blocks 2] [--reps 20]

The real GLM-5.3-Flash cache as vLLM groups and places it (``testing/glm_flash_kv_layouts.py``,
plugin layout), on this machine's CPU. Two geometries of the same KV buffer:

* split (what the connector does): the rows' parts the plugin declares
  (``kv_cache_row_parts``) are two object groups, each read and written column by column
  (a part of every row: 768 strided pieces per page at TP 4);
* whole rows: one object group of whole pages (what the connector did before: contiguous
  page copies).

Each is timed reading a chunk's attention objects out of the buffer (save path) and writing
them back (load path), the same bytes either way; figures are GB/s of object bytes and the
split/whole ratio, side by side. Native vLLM keeps the latent and the indexer in separate
layers already (whole pages for both), so the split costs it nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from connector.geometry import resolve_geometry
from connector.kv_pages import PagedKVCache
from testing import glm_flash_kv_layouts as L


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(tp: int, blocks: int, reps: int) -> list[tuple[str, int, float, float]]:
    """(geometry, object bytes per chunk, read s, write s) for split and whole rows."""
    built = L.build("plugin", tp, num_blocks=2 * blocks + 1)
    raw, views = L.allocate(built)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(0)))
    split = L.resolve(built)
    whole = resolve_geometry(built.vllm_config, built.kv_cache_config)
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    out = []
    for label, geo in (("split", split), ("whole rows", whole)):
        pages = PagedKVCache(views, built.kv_cache_config, geo.groups)
        attn = geo.attn_groups
        payloads = {g.group_id: pages.read(g.group_id, src) for g in attn}
        nbytes = sum(len(p) for p in payloads.values())
        t_read = _best(lambda: [pages.read(g.group_id, src) for g in attn], reps)
        t_write = _best(lambda: [pages.write(g.group_id, dst, payloads[g.group_id]) for g in attn], reps)
        out.append((label, nbytes, t_read, t_write))
    # both geometries load the same bytes: the split objects restore the whole rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2, help="blocks a chunk (the attention object of one chunk)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.tp, args.blocks, args.reps)
    print(f"plugin layout, TP {args.tp}, {args.blocks} block(s) a chunk, best of {args.reps}, 1 thread")
    print(f"{'geometry':12} {'MB a chunk':>10} {'save GB/s':>10} {'load GB/s':>10}")
    for label, nbytes, t_read, t_write in rows:
        print(f"{label:12} {nbytes / 1e6:10.1f} {nbytes / t_read / 1e9:10.2f} {nbytes / t_write / 1e9:10.2f}")
    (_, n, r_s, w_s), (_, _, r_w, w_w) = rows
    print(f"split / whole: save {r_w / r_s:.2f}x the speed, load {w_w / w_s:.2f}x the speed")


if __name__ == "__main__":
    main()
