"""The plugin's fast paths at real GLM-5.3-Flash layer dimensions on one GPU (CPU fallback).

Self-contained: imports only torch and the plugin's pure-torch math modules
(``glm5next_plugin.kda``, ``glm5next_plugin.sparse_mla``); no vLLM, no transformers.
Random inputs at the real layer sizes (``transformers.Glm5NextTextConfig()`` defaults,
written out below), batch 1:

(a) KDA (64 heads x 128): the chunked WY/UT form against the token loop, max |diff| of
    outputs and final state, for fp32 and bf16 inputs (both accumulate in fp32), and
    their times at 4k and 32k tokens;
(b) sparse MLA (64 heads, q/k/v head dim 256, kv_lora_rank 512, indexer 32 heads x 128,
    kpool 16, index_topk 2048): the absorbed path the layers run against the
    dense-masked formulation (every latent expanded, ``[T, S]`` mask, full logits) as a
    4k-token prefill, with every third query's indexer input zeroed so its pool scores
    tie exactly; and one decode query at 32k context, timed both ways.

fp32 matmuls run without TF32. Prints a table and, last, one JSON line. ``--small``
shrinks every size (a CPU smoke run). Run: ``PYTHONPATH=. python -m validation.gpu_plugin_check``
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from glm5next_plugin import kda, sparse_mla

REAL = dict(kda_heads=64, kda_dim=128, heads=64, qk_dim=256, v_dim=256, rank=512, index_heads=32,
            index_dim=128, kpool=16, topk=2048, lower_bound=-5.0, kda_lengths=(4096, 32768),
            mla_prefill=4096, mla_decode_ctx=32768)
SMALL = dict(kda_heads=4, kda_dim=32, heads=4, qk_dim=32, v_dim=32, rank=64, index_heads=4,
             index_dim=16, kpool=16, topk=128, lower_bound=-5.0, kda_lengths=(256, 1024),
             mla_prefill=512, mla_decode_ctx=2048)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device):
    sync(dev)
    t0 = time.perf_counter()
    res = fn()
    sync(dev)
    return time.perf_counter() - t0, res


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------
# (a) KDA
# ----------------------------------------------------------------------------------------


def kda_inputs(t: int, c: dict, dev: torch.device, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, d = c["kda_heads"], c["kda_dim"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    q = kda.l2_normalize(rnd(t, h, d)) * d**-0.5
    k = kda.l2_normalize(rnd(t, h, d))
    v = rnd(t, h, d)
    gate = c["lower_bound"] * torch.sigmoid(rnd(t, h, d))
    beta = torch.sigmoid(rnd(t, h))
    s0 = rnd(h, d, d) * 0.1
    return [x.to(dtype) for x in (q, k, v, gate, beta)] + [s0]


def check_kda(c: dict, dev: torch.device, rows: list, summary: dict) -> None:
    for t in c["kda_lengths"]:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, g, beta, s0 = kda_inputs(t, c, dev, dtype, seed=t)
            kda.kda_chunked(q[:64], k[:64], v[:64], g[:64], beta[:64], s0)  # warm-up
            t_loop, (ref_o, ref_s) = timed(lambda: kda.kda_reference(q, k, v, g, beta, s0), dev)
            t_chunk, (out, st) = timed(lambda: kda.kda_chunked(q, k, v, g, beta, s0), dev)
            d_out, d_state = max_diff(out, ref_o), max_diff(st, ref_s)
            name = f"kda T={t} {str(dtype)[6:]}"
            rows.append((name, t_loop, t_chunk, f"out {d_out:.1e} state {d_state:.1e}"))
            summary[name] = dict(loop_s=t_loop, chunked_s=t_chunk, speedup=t_loop / t_chunk,
                                 max_diff_out=d_out, max_diff_state=d_state)
            del q, k, v, g, beta, ref_o, ref_s, out, st


# ----------------------------------------------------------------------------------------
# (b) sparse MLA
# ----------------------------------------------------------------------------------------


def mla_inputs(s_len: int, t_len: int, c: dict, dev: torch.device, dtype: torch.dtype, seed: int):
    """A sequence of ``s_len`` cached tokens and the last ``t_len`` of them as queries."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    h, r = c["heads"], c["rank"]
    w_k = rnd(h, c["qk_dim"], r, scale=r**-0.5)
    w_v = rnd(h, c["v_dim"], r, scale=r**-0.5)
    latents = rnd(s_len, r)
    q = rnd(t_len, h, c["qk_dim"])
    keys, gates = rnd(s_len, c["index_dim"]), rnd(s_len, c["index_dim"])
    ape = rnd(c["kpool"], c["index_dim"])
    index_q = rnd(t_len, c["index_heads"], c["index_dim"])
    index_q[::3] = 0  # these queries' pool scores all tie at 0: lower pool index wins
    head_w = rnd(t_len, c["index_heads"]).float() * c["index_heads"] ** -0.5
    pooled = sparse_mla.pool_keys(keys, gates, ape)
    positions = torch.arange(s_len - t_len, s_len, device=dev)
    return w_k, w_v, latents, q, index_q, head_w, pooled, positions


def dense_masked(w_k, w_v, latents, q, index_q, head_w, pooled, positions, c):
    s_len = latents.shape[0]
    k = torch.einsum("sr,hdr->shd", latents, w_k)
    v = torch.einsum("sr,hdr->shd", latents, w_v)
    mask = sparse_mla.select_tokens(index_q, head_w, pooled, positions, s_len, c["kpool"], c["topk"])
    return sparse_mla.masked_attention(q, k, v, mask, q.shape[-1] ** -0.5)


def absorbed(w_k, w_v, latents, q, index_q, head_w, pooled, positions, c):
    return sparse_mla.sparse_mla_absorbed(q, w_k, w_v, index_q, head_w, pooled, positions, c["kpool"], c["topk"],
                                          lambda idx: latents[idx])


def check_mla(c: dict, dev: torch.device, rows: list, summary: dict) -> None:
    cases = [("prefill", c["mla_prefill"], c["mla_prefill"]), ("decode", c["mla_decode_ctx"], 1)]
    for kind, s_len, t_len in cases:
        for dtype in (torch.float32, torch.bfloat16):
            args = mla_inputs(s_len, t_len, c, dev, dtype, seed=s_len + t_len)
            t_dense, ref = timed(lambda: dense_masked(*args, c), dev)
            t_abs, out = timed(lambda: absorbed(*args, c), dev)
            t_abs2, out = timed(lambda: absorbed(*args, c), dev)  # warm second run
            t_dense2, ref = timed(lambda: dense_masked(*args, c), dev)
            d = max_diff(out, ref)
            scale = ref.float().abs().max().item()
            name = f"mla {kind} S={s_len} T={t_len} {str(dtype)[6:]}"
            rows.append((name, min(t_dense, t_dense2), min(t_abs, t_abs2), f"max|diff| {d:.1e} (|ref| max {scale:.1f})"))
            summary[name] = dict(dense_s=min(t_dense, t_dense2), absorbed_s=min(t_abs, t_abs2),
                                 speedup=min(t_dense, t_dense2) / min(t_abs, t_abs2), max_diff=d, ref_absmax=scale)
            del args, ref, out
    # what building every pool's key from its rows costs at this context (rebuilding keys
    # would pay it every step; the cache stores each key once, in the pool's closing row)
    g = torch.Generator(device="cpu").manual_seed(1)
    keys, gates, ape = (torch.randn(*shape, generator=g).to(dev) for shape in
                        ((c["mla_decode_ctx"], c["index_dim"]), (c["mla_decode_ctx"], c["index_dim"]),
                         (c["kpool"], c["index_dim"])))
    sparse_mla.pool_keys(keys, gates, ape)
    t_pool, _ = timed(lambda: sparse_mla.pool_keys(keys, gates, ape), dev)
    summary[f"pool_keys rebuild S={c['mla_decode_ctx']} s"] = t_pool


def t_pool_msg(summary: dict) -> str:
    (v,) = [v for k, v in summary.items() if k.startswith("pool_keys")]
    return f"{v * 1e3:.2f} ms"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small sizes (CPU smoke run)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is there")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    c = SMALL if args.small else REAL
    rows: list = []
    summary: dict = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                         torch=torch.__version__, sizes="small" if args.small else "real",
                         kda_chunk=kda.DEFAULT_CHUNK)
    t0 = time.perf_counter()
    check_kda(c, dev, rows, summary)
    check_mla(c, dev, rows, summary)
    print(f"{'case':<34} {'reference s':>12} {'fast s':>10} {'speedup':>8}  agreement")
    for name, t_ref, t_fast, agree in rows:
        print(f"{name:<34} {t_ref:>12.4f} {t_fast:>10.4f} {t_ref / t_fast:>8.1f}  {agree}")
    summary["total_s"] = time.perf_counter() - t0
    # agreement: fp32 fast paths within 1e-4 of their references (relative to |ref| for MLA)
    summary["ok_fp32"] = all(
        (v["max_diff_out"] < 1e-4 and v["max_diff_state"] < 1e-4) if k.startswith("kda") else
        v["max_diff"] < 1e-4 * max(1.0, v["ref_absmax"])
        for k, v in summary.items() if isinstance(v, dict) and k.endswith("float32")
    )
    if dev.type == "cuda":
        summary["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(f"pool_keys rebuild at {c['mla_decode_ctx']} tokens: {t_pool_msg(summary)}; fp32 agreement ok: {summary['ok_fp32']}")
    print(f"reference = token loop (KDA) / dense-masked (MLA); total {summary['total_s']:.1f} s"
          + (f", peak GPU memory {summary['peak_gpu_gib']:.1f} GiB" if dev.type == "cuda" else ""))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
