"""Sparse MLA math: kpool-compressed indexer, top-k pool selection, masked attention.

Per sequence, every cached token ``j`` carries three vectors: the MLA latent ``c_j``
(``kv_lora_rank``), the indexer key ``k_j`` and the kpool gate score ``z_j`` (both
``index_head_dim``). A *pool* is a complete run of ``index_kpool`` tokens starting at a
multiple of ``index_kpool``; its key is a per-channel softmax-weighted mean of its tokens::

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

Pools are rebuilt from the cached per-token keys on every step rather than stored, so the
cache holds whole tokens only: any block-aligned prefix of it is valid on its own, and
nothing per-request (no tail buffer) has to live outside the prefix-cacheable pages.
"""

from __future__ import annotations

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


def top_pools(index_scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` best pools per row of ``index_scores`` ``[T, P]``; equal
    scores rank the lower pool index first (see the module docstring)."""
    return index_scores.sort(dim=-1, descending=True, stable=True).indices[:, :keep]


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
