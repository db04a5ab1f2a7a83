"""Sparse-MLA decode step at long context: pooled indexer keys stored vs rebuilt every step.

Row format 2 (``glm5next_plugin.mla_layer.CACHE_ROW_FORMAT``) stores each pool's key in
its closing row, so a step reads ``P * index_head_dim`` values. Format 1 (stored rows
without pool keys; its decode step is :func:`step_rebuilding`) reads the key and gate
columns of every complete pool's tokens (``2 * S * index_head_dim`` values) and recomputes
the softmax-weighted pool keys for the whole context, every step.

One sparse-MLA layer at GLM-5.3-Flash's real sizes (``transformers.Glm5NextTextConfig``
defaults: 64 heads, kv_lora_rank 512, index 32 heads x 128, kpool 16, top-k 2048;
random weights) or ``--tiny`` sizes (``glm5next_tiny``'s), over a paged cache of S
tokens (random rows, shuffled blocks), one query token, one thread. For each S and dtype
it prints, best of ``--repeats``:

- the whole layer step (write the new row, store a completed pool key if the token
  closes one, select, attend, project), format 1 vs format 2, and the ratio;
- the pooled-key read alone (format 1: gather 2 x S x Dk and ``pool_keys``; format 2:
  gather P x Dk);
- the step when the new token closes a pool (format 2 then also builds that pool's key
  from kpool rows, once per kpool steps);
- max |diff| between the two formats' outputs (the same keys, so ~0).

    python -m validation.bench_pool_keys [--contexts 4096 32768] [--tiny]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from glm5next_plugin import sparse_mla
from glm5next_plugin.mla_layer import SparseMLAMetadata, SparseMLAProjections


def real_config():
    import transformers

    c = transformers.Glm5NextTextConfig()
    keys = ("hidden_size", "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_topk", "index_kpool", "index_n_heads", "index_head_dim",
            "index_kpool_always_select_tail", "attention_bias", "rms_norm_eps")
    return SimpleNamespace(**{k: getattr(c, k) for k in keys})


def tiny_config():
    # glm5next_tiny's defaults
    return SimpleNamespace(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
                           qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16, index_topk=128, index_kpool=16,
                           index_n_heads=4, index_head_dim=16, index_kpool_always_select_tail=True,
                           attention_bias=False, rms_norm_eps=1e-5)


def step_rebuilding(layer: SparseMLAProjections, x: torch.Tensor, cache: torch.Tensor, md: SparseMLAMetadata):
    """Row format 1's decode step (no stored pool keys): every step gathers the index
    columns of all complete pools and rebuilds their keys."""
    bs = cache.shape[1]
    n = md.num_actual_tokens
    rows = layer.cache_rows(x[:n]).to(cache.dtype)
    slots = md.slot_mapping.long()
    cache[slots // bs, slots % bs] = rows
    out = torch.zeros_like(x)
    ix, r = layer.indexer, layer.kv_lora_rank
    for i in range(md.num_reqs):
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        seq_len, row = md.seq_lens[i], md.block_table[i].long()
        positions = torch.arange(seq_len - (end - start), seq_len, device=x.device)
        xq = x[start:end]
        t = xq.shape[0]
        q_resid = layer.q_a_layernorm(layer.q_a_proj(xq))
        q = layer.q_b_proj(q_resid).view(t, layer.num_heads, layer.qk_head_dim)
        w = layer.kv_b_proj.weight.view(layer.num_heads, layer.qk_head_dim + layer.v_head_dim, r)
        pooled = rebuild_pooled(layer, cache, row, seq_len, xq.dtype)
        index_q = ix.wq_b(q_resid).view(t, ix.n_heads, ix.head_dim)
        head_w = ix.weights_proj(xq).float() * ix.n_heads**-0.5
        o = sparse_mla.sparse_mla_absorbed(
            q, w[:, : layer.qk_head_dim], w[:, layer.qk_head_dim :], index_q, head_w, pooled, positions,
            layer.kpool, layer.index_topk, lambda idx: cache[row[idx // bs], idx % bs, :r])
        out[start:end] = layer.project_out(o.reshape(t, -1))
    return out


def rebuild_pooled(layer, cache, row, seq_len, dtype):
    """Format 1's pooled keys: whole blocks of index columns, then ``pool_keys``."""
    bs = cache.shape[1]
    n_full = (seq_len // layer.kpool) * layer.kpool
    picked = cache[row[: -(-n_full // bs)], :, layer.index_cols]
    cols = picked.reshape(-1, picked.shape[-1])[:n_full].to(dtype)
    keys, gates = cols.split([layer.indexer.head_dim] * 2, dim=-1)
    return sparse_mla.pool_keys(keys, gates, layer.indexer.index_kpool_compress_ape)


def stored_pooled(layer, cache, row, seq_len, dtype):
    """Format 2's pooled keys: one stored row slice per pool."""
    bs = cache.shape[1]
    closing = sparse_mla.closing_positions(0, seq_len, layer.kpool, cache.device)
    return cache[row[closing // bs], closing % bs, layer.pool_key_cols].to(dtype)


def best(fn, repeats: int, dev: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def run(cfg, s_len: int, dtype: torch.dtype, repeats: int, block: int, dev: torch.device) -> dict:
    torch.manual_seed(s_len)
    layer = SparseMLAProjections(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 if p.dim() > 1 else torch.randn(p.shape))
    layer = layer.to(dev, dtype).eval()
    total = s_len + cfg.index_kpool  # room for the query tokens
    n_blocks = -(-total // block)
    table = torch.randperm(n_blocks + 2)[:n_blocks][None].to(dev)
    raw = torch.randn(total, layer.row_size).to(dev, dtype)
    pos = torch.arange(total, device=dev)
    with torch.no_grad():
        fin = layer.close_pools(raw)
    old_cache = torch.zeros(n_blocks + 2, block, layer.row_size, dtype=dtype, device=dev)
    new_cache = old_cache.clone()
    old_cache[table[0, pos // block], pos % block] = raw
    new_cache[table[0, pos // block], pos % block] = fin
    x = torch.randn(1, cfg.hidden_size).to(dev, dtype)

    def md(p: int) -> SparseMLAMetadata:
        slot = table[0, p // block] * block + p % block
        return SparseMLAMetadata(query_start_loc=[0, 1], seq_lens=[p + 1], block_table=table,
                                 slot_mapping=slot.view(1), num_reqs=1, num_actual_tokens=1)

    # the query at position s_len closes no pool unless s_len + 1 is a multiple of kpool
    p_open = s_len if (s_len + 1) % cfg.index_kpool else s_len + 1
    p_close = p_open + (cfg.index_kpool - 1 - p_open) % cfg.index_kpool
    res = dict(s=s_len, dtype=str(dtype).removeprefix("torch."))
    with torch.no_grad():
        m = md(p_open)
        a, b = step_rebuilding(layer, x, old_cache, m), layer.forward_paged(x, new_cache, m)
        res["max_diff"] = (a.float() - b.float()).abs().max().item()
        res["old_step"] = best(lambda: step_rebuilding(layer, x, old_cache, m), repeats, dev)
        res["new_step"] = best(lambda: layer.forward_paged(x, new_cache, m), repeats, dev)
        row = table[0].long()
        res["old_pool"] = best(lambda: rebuild_pooled(layer, old_cache, row, p_open + 1, dtype), repeats, dev)
        res["new_pool"] = best(lambda: stored_pooled(layer, new_cache, row, p_open + 1, dtype), repeats, dev)
        mc = md(p_close)
        # format 2's closing step overwrites the closing row's z: restore it before each run
        saved = new_cache[table[0, p_close // block], p_close % block].clone()

        def closing_step():
            new_cache[table[0, p_close // block], p_close % block] = saved
            layer.forward_paged(x, new_cache, mc)

        res["old_close"] = best(lambda: step_rebuilding(layer, x, old_cache, mc), repeats, dev)
        res["new_close"] = best(closing_step, repeats, dev)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--tiny", action="store_true", help="glm5next-tiny sizes instead of GLM-5.3-Flash's")
    p.add_argument("--block", type=int, default=1024, help="tokens per cache block")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="torch device (cuda on a GPU machine)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = tiny_config() if args.tiny else real_config()
    print(f"sparse-MLA decode step, {'tiny' if args.tiny else 'GLM-5.3-Flash'} sizes (heads {cfg.num_attention_heads}, "
          f"kv_lora_rank {cfg.kv_lora_rank}, index {cfg.index_n_heads} x {cfg.index_head_dim}, kpool "
          f"{cfg.index_kpool}, top-k {cfg.index_topk}), block {args.block}, device {dev}, {args.threads} thread(s), "
          f"ms best of {args.repeats}; format 1 = pool keys rebuilt each step, format 2 = stored")
    head = (f"{'S':>6} {'dtype':>8} | {'step f1':>8} {'step f2':>8} {'x':>5} | {'keys f1':>8} {'keys f2':>8} "
            f"{'x':>6} | {'closing f1':>10} {'closing f2':>10} | {'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    for s in args.contexts:
        for name in args.dtypes:
            r = run(cfg, s, getattr(torch, name), args.repeats, args.block, dev)
            print(f"{s:>6} {r['dtype']:>8} | {r['old_step'] * 1e3:>8.2f} {r['new_step'] * 1e3:>8.2f} "
                  f"{r['old_step'] / r['new_step']:>5.2f} | {r['old_pool'] * 1e3:>8.3f} {r['new_pool'] * 1e3:>8.3f} "
                  f"{r['old_pool'] / r['new_pool']:>6.1f} | {r['old_close'] * 1e3:>10.2f} {r['new_close'] * 1e3:>10.2f} "
                  f"| {r['max_diff']:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
