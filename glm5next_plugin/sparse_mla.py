"""Sparse MLA math: kpool-compressed indexer, top-k pool selection, masked attention.

Per sequence, every cached token ``j`` carries the MLA latent ``c_j`` (``kv_lora_rank``),
its rope key part ``r_j`` (``qk_rope_head_dim`` values, none in GLM-5.3-Flash), the indexer
key ``k_j`` and the kpool gate score ``z_j`` (both ``index_head_dim``). A *pool* is a
complete run of ``index_kpool`` tokens starting at a multiple of ``index_kpool``; its key
is a per-channel softmax-weighted mean of its tokens::

    pool_key[p, d] = sum_slot softmax_slot(z[slot, d] + ape[slot, d]) * k[slot, d]

A query at position ``i`` may pick pools that end at or before ``i``. Score per pool::

    score[i, p] = sum_h w[i, h] * relu(q_idx[i, h] . pool_key[p] / sqrt(index_head_dim))

and keeps the best ``index_topk // index_kpool`` pools, plus the tokens of its own
incomplete pool (the "tail": ``[i + 1 - (i + 1) % kpool, i]``).

Ties: scores are sums of ReLU'd products, so pools tie exactly (at 0) whenever every
indexer head's dot product is negative; with few heads and signed head weights that is
common. Among equal scores the *lower pool index* wins (a stable descending sort), so the
chosen pools depend only on the query position, the pool scores and the pool indices: the
same whether the prompt runs in one step, in 128-token steps, batched, or resumed from a
checkpoint (``torch.topk`` alone picks among ties by how many pools the tensor holds).
transformers' reference uses ``torch.topk`` (order among ties unspecified), and vLLM's
native CUDA path selects with its ``top_k_per_row_prefill`` / decode kernels
(``vllm/models/glm5next/sparse_indexer.py``), which document no tie order either; on
tie-free scores all three agree. Attention then runs over
exactly those tokens. Until a query sees more pools than it may keep, that is plain
causal attention; past it, the selection matters.

Each pool's key is computed once, in the step that writes the pool's last token (its
*closing* token, position ``i`` with ``(i + 1) % kpool == 0``), from its ``kpool`` rows' raw
``k`` and ``z`` (earlier rows read back from the cache), and stored in the closing token's
row in place of that token's gate ``z``, which nothing reads once the pool is complete.
Every row is still a function of the prefix up to its own token, so every block-aligned
prefix of the cache is valid on its own (prefix caching and a connector move blocks as
bytes) and nothing per-request lives outside the prefix-cacheable pages. A step then reads
one stored key per pool (``P * index_head_dim`` values) instead of rebuilding all pools
from ``2 * S * index_head_dim`` values and a softmax; scoring one query against the pools
stays ``O(P * index_head_dim)`` per indexer head, which no layout avoids. The key is a pure
function of its ``kpool`` cached rows, so it is the same bytes however the prompt was split
into steps. :func:`pool_keys` is that function; :func:`closing_positions` names the rows.

Two formulations of the attention live here:

- the dense-masked one (:func:`select_tokens` + :func:`masked_attention`): a ``[T, S]``
  mask and full ``[H, T, S]`` logits over K/V expanded through ``kv_b_proj``. Readable,
  quadratic; kept as the reference the fast path is tested against.
- the sparse absorbed one the layers run (:func:`select_pools` + :func:`gather_index` +
  :func:`absorbed_attention`): each query gathers only its chosen pools and its tail
  (at most ``index_topk + index_kpool`` latents) and attends in the latent space, with
  ``kv_b_proj``'s K part folded into the query and its V part applied to the output
  (``q.k_j = (W_k^T q_nope) . c_j + q_rot . r_j``, ``sum_j p_j W_v c_j = W_v sum_j p_j c_j``).
  Work and memory per query are bounded by the top-k, not the context.

The rope part ``r_j`` is what transformers' ``Glm5NextTextAttention`` calls ``k_rot``: the
last ``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``, not normalized, shared by all
heads and placed after each head's ``k_nope``; the query has ``qk_nope_head_dim +
qk_rope_head_dim`` values per head and the scale is ``(qk_nope_head_dim +
qk_rope_head_dim) ** -0.5``. The text model applies no rotary embedding to it (NoPE), so it
is a plain position-free key part. vLLM's native model (``vllm/models/glm5next/common/``)
differs: it rotates ``q_rot`` and ``k_rot`` with RoPE unless the config sets
``mla_use_nope``; with ``mla_use_nope`` it pads the checkpoint's ``kv_a_proj_with_mqa`` with
zero rows for the rope part (``k_rot`` is then 0 and only the scale keeps the rope dims);
and its indexer rotates the first ``qk_rope_head_dim`` values of its query and key, which
transformers and this plugin leave as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def pool_keys(keys: torch.Tensor, gate_scores: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Compress complete pools. ``keys``, ``gate_scores``: ``[S, Dk]``; ``ape``: ``[kpool, Dk]``.

    Returns ``[S // kpool, Dk]`` pool keys (the incomplete last pool is left out).
    """
    kpool, dk = ape.shape
    n_pools = keys.shape[0] // kpool
    k = keys[: n_pools * kpool].view(n_pools, kpool, dk)
    z = gate_scores[: n_pools * kpool].view(n_pools, kpool, dk).float() + ape.float()
    weights = z.softmax(dim=1).to(k.dtype)
    return (weights * k).sum(dim=1)


def closing_positions(start: int, end: int, kpool: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions in ``[start, end)`` that close a pool (``(i + 1) % kpool == 0``): the rows
    whose gate columns hold their pool's key once written."""
    first = start + (kpool - 1 - start) % kpool
    return torch.arange(first, max(first, end), kpool, device=device)


def top_pools(index_scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` best pools per row of ``index_scores`` ``[T, P]``; equal
    scores rank the lower pool index first (see the module docstring)."""
    return index_scores.sort(dim=-1, descending=True, stable=True).indices[:, :keep]


def block_budget(device: torch.device) -> int:
    """Values a query block's intermediate may hold: small enough on a CPU to stay in its
    caches (one MLA layer's 32k-token selection at tiny sizes, one thread: 2.2 s with
    2**24, 0.7 s with 2**20), large on an accelerator so launches stay few."""
    return 1 << 20 if device.type == "cpu" else 1 << 26


def top_pool_set(index_scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The same pools as :func:`top_pools` (ties to the lower pool index), in ascending
    pool order, from a partial selection instead of a full sort: everything above the
    ``keep``-th best score, then as many of the pools equal to it as fit, lowest first."""
    rows = index_scores.shape[0]
    kth = index_scores.topk(keep, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above = index_scores > kth
    at = index_scores == kth
    room = keep - above.sum(dim=-1, keepdim=True)
    take = above | (at & (at.cumsum(dim=-1) <= room))
    return take.nonzero()[:, 1].view(rows, keep)


def select_tokens(
    index_q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    positions: torch.Tensor,
    seq_len: int,
    kpool: int,
    topk: int,
) -> torch.Tensor:
    """Boolean mask ``[T, seq_len]`` of the tokens each query attends to.

    ``index_q``: ``[T, Hi, Dk]`` indexer queries; ``head_weights``: ``[T, Hi]`` (already
    scaled by ``Hi ** -0.5``); ``pooled``: ``[P, Dk]``; ``positions``: ``[T]`` absolute
    positions of the queries in the sequence.
    """
    n_pools = pooled.shape[0]
    t_len = index_q.shape[0]
    dev = index_q.device
    token = torch.arange(seq_len, device=dev)
    mask = torch.zeros(t_len, seq_len, dtype=torch.bool, device=dev)
    # the query's own incomplete pool is always attended
    tail_start = positions + 1 - (positions + 1) % kpool
    mask |= (token[None, :] >= tail_start[:, None]) & (token[None, :] <= positions[:, None])
    if n_pools == 0:
        return mask
    dk = index_q.shape[-1]
    scores = torch.einsum("thd,pd->thp", index_q.float(), pooled.float())
    scores = F.relu(scores * dk**-0.5)
    index_scores = torch.einsum("th,thp->tp", head_weights.float(), scores)
    pool_end = torch.arange(n_pools, device=dev) * kpool + kpool - 1
    visible = pool_end[None, :] <= positions[:, None]  # [T, P]
    index_scores = index_scores.masked_fill(~visible, torch.finfo(index_scores.dtype).min)
    keep = min(topk // kpool, n_pools)
    chosen = top_pools(index_scores, keep)  # [T, keep]
    chosen_ok = visible.gather(1, chosen)
    pool_mask = torch.zeros(t_len, n_pools, dtype=torch.bool, device=dev)
    pool_mask.scatter_(1, chosen, chosen_ok)
    token_pool = (token // kpool).clamp(max=n_pools - 1)
    in_full_pool = token < n_pools * kpool
    mask |= pool_mask[:, token_pool] & in_full_pool[None, :]
    return mask


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    query_block: int = 512,
) -> torch.Tensor:
    """Softmax attention of ``q`` ``[T, H, Dq]`` over ``k`` ``[S, H, Dq]`` / ``v`` ``[S, H, Dv]``
    restricted to ``mask`` ``[T, S]``; queries in blocks to bound memory. Returns ``[T, H, Dv]``.
    """
    out = []
    for start in range(0, q.shape[0], query_block):
        qb = q[start : start + query_block]
        logits = torch.einsum("thd,shd->hts", qb, k) * scale
        logits = logits.masked_fill(~mask[start : start + query_block][None], float("-inf"))
        probs = logits.float().softmax(dim=-1).to(v.dtype)
        out.append(torch.einsum("hts,shd->thd", probs, v))
    return torch.cat(out, dim=0)


def select_pools(
    index_q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    topk: int,
    block_elems: int | None = None,
) -> torch.Tensor:
    """The pools each query attends to: ``[T, topk // kpool]`` pool indices, ``-1`` in
    unused slots. Same choice as :func:`select_tokens` (visible pools only, ties to the
    lower pool index via :func:`top_pools`), computed in query blocks so the
    ``[block, Hi, P]`` scores stay under ``block_elems`` values (default
    :func:`block_budget`).

    Queries that see no more complete pools than they may keep take all of them (no
    scoring needed: the chosen set does not depend on the scores).
    """
    t_len = index_q.shape[0]
    keep = topk // kpool
    dev = index_q.device
    chosen = torch.full((t_len, keep), -1, dtype=torch.long, device=dev)
    if t_len == 0 or keep == 0:
        return chosen
    n_pools = pooled.shape[0]
    visible_count = ((positions + 1) // kpool).clamp(max=n_pools)  # [T]
    slot = torch.arange(keep, device=dev)
    # the causal regime: every visible pool is kept
    chosen = torch.where(slot[None, :] < visible_count[:, None], slot[None, :].expand(t_len, keep), chosen)
    sparse_rows = (visible_count > keep).nonzero().flatten()
    if sparse_rows.numel() == 0:
        return chosen
    hi, dk = index_q.shape[1], index_q.shape[2]
    block_elems = block_elems or block_budget(dev)
    pooled_t = pooled.float().t()  # [Dk, P]
    block = max(1, block_elems // max(1, hi * n_pools))
    pool_ids = torch.arange(n_pools, device=dev)
    for start in range(0, sparse_rows.numel(), block):
        rows = sparse_rows[start : start + block]
        n_vis = int(visible_count[rows].max())
        b = rows.numel()
        # relu(q . p / sqrt(Dk)), weighted over heads: one matmul, relu in place, one bmm
        scores = torch.mm(index_q[rows].float().reshape(b * hi, dk) * dk**-0.5, pooled_t[:, :n_vis])
        scores = scores.relu_().view(b, hi, n_vis)
        idx = torch.bmm(head_weights[rows].float().unsqueeze(1), scores).squeeze(1)  # [b, n_vis]
        hidden = pool_ids[None, :n_vis] >= visible_count[rows][:, None]
        idx = idx.masked_fill_(hidden, torch.finfo(idx.dtype).min)
        chosen[rows] = top_pool_set(idx, keep)  # every row here sees more than `keep` pools
    return chosen


def gather_index(chosen: torch.Tensor, positions: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices each query attends to: its chosen pools' tokens then its tail.

    Returns ``tokens`` ``[T, (keep + 1) * kpool]`` and ``valid`` of the same shape (False
    for unused pool slots and tail slots past the query). Invalid slots point at the query's
    own token: a row already written, so a masked slot never reads a row this sequence has
    not written yet (whatever an unwritten slot holds, even NaN, cannot leak through
    ``0 * x``).
    """
    t_len, keep = chosen.shape
    dev = chosen.device
    within = torch.arange(kpool, device=dev)
    own = positions[:, None]
    pool_tok = (chosen.clamp(min=0)[:, :, None] * kpool + within).reshape(t_len, keep * kpool)
    pool_ok = (chosen >= 0)[:, :, None].expand(t_len, keep, kpool).reshape(t_len, keep * kpool)
    tail_start = positions + 1 - (positions + 1) % kpool
    tail_tok = tail_start[:, None] + within[None, :]
    tail_ok = tail_tok <= own
    tokens = torch.cat([torch.where(pool_ok, pool_tok, own), torch.where(tail_ok, tail_tok, own)], dim=1)
    return tokens, torch.cat([pool_ok, tail_ok], dim=1)


def absorbed_attention(
    q_latent: torch.Tensor,
    latent_rows: Callable[[torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    block_elems: int | None = None,
    value_dim: int | None = None,
) -> torch.Tensor:
    """Attention in the latent space over each query's own tokens.

    ``q_latent``: ``[T, H, Dk]`` queries already multiplied into the latent space (the
    latent query, then the rope query if any); ``latent_rows(idx)`` returns the key rows
    ``[..., Dk]`` of token indices ``idx`` (the latent, then the rope key part);
    ``tokens``/``valid``: ``[T, K]`` from :func:`gather_index`. The values are the first
    ``value_dim`` columns of the key rows (the latent; default all). Returns the
    probability-weighted values ``[T, H, value_dim]``; queries in blocks so the gathered
    ``[block, K, Dk]`` rows stay under ``block_elems`` values (default :func:`block_budget`).
    """
    t_len, heads, key_dim = q_latent.shape
    value_dim = value_dim or key_dim
    width = tokens.shape[1]
    block_elems = block_elems or block_budget(q_latent.device)
    out = q_latent.new_empty(t_len, heads, value_dim)
    block = max(1, block_elems // max(1, width * key_dim))
    for start in range(0, t_len, block):
        end = min(start + block, t_len)
        lat = latent_rows(tokens[start:end]).to(q_latent.dtype)  # [b, K, Dk]
        logits = torch.bmm(q_latent[start:end], lat.transpose(1, 2)) * scale  # [b, H, K]
        logits = logits.masked_fill(~valid[start:end, None, :], float("-inf"))
        probs = logits.float().softmax(dim=-1).to(lat.dtype)
        out[start:end] = torch.bmm(probs, lat[..., :value_dim])
    return out


def sparse_mla_absorbed(
    q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    index_q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    topk: int,
    key_rows: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The whole sparse MLA core as the layers run it: select, gather, attend in latent space.

    ``q``: ``[T, H, Dn + Dr]`` (``qk_nope_head_dim`` then ``qk_rope_head_dim`` values per
    head); ``w_k``: ``[H, Dn, R]`` and ``w_v``: ``[H, Dv, R]`` (``kv_b_proj``'s K and V parts
    per head); indexer inputs as in :func:`select_pools`; ``key_rows(idx)`` returns the
    latents then rope key parts ``[..., R + Dr]`` of token indices ``idx``. Returns
    ``[T, H, Dv]``, equal to :func:`masked_attention` over ``k = [c W_k^T, r]``,
    ``v = c W_v^T`` with the :func:`select_tokens` mask (scale ``(Dn + Dr) ** -0.5``).
    """
    nope, rank = w_k.shape[1], w_k.shape[2]
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_k).transpose(0, 1)  # [T, H, R]
    q_key = torch.cat([q_latent, q[..., nope:]], dim=-1)  # [T, H, R + Dr]
    chosen = select_pools(index_q, head_weights, pooled, positions, kpool, topk)
    tokens, valid = gather_index(chosen, positions, kpool)
    out_latent = absorbed_attention(q_key, key_rows, tokens, valid, q.shape[-1] ** -0.5, value_dim=rank)
    return torch.bmm(out_latent.transpose(0, 1), w_v.transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
