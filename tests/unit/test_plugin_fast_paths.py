"""The plugin's fast paths against their readable references, on random inputs (no vLLM).

- sparse MLA: the absorbed path the layers run (chosen pools + tail gathered per query,
  queries folded into the latent space through ``kv_b_proj``'s K part, values out through
  its V part) equals the dense-masked formulation (every row expanded, ``[T, S]`` mask,
  full logits), with random and with exactly tied indexer scores, with and without a rope
  key part (``qk_rope_head_dim``);
- KDA: the matmul chunked form equals the token loop for lengths that are not a multiple
  of the chunk, from a given initial state, for every chunk size, and also when the gate
  is too steep for the chosen chunk (the chunk shrinks instead of overflowing).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm5next_plugin import kda, sparse_mla
from glm5next_plugin.mla_layer import SparseMLAProjections


def _mla_config(**over):
    cfg = dict(
        hidden_size=48, num_attention_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_nope_head_dim=12,
        qk_rope_head_dim=0, v_head_dim=10, index_topk=32, index_kpool=4, index_n_heads=3, index_head_dim=8,
        index_kpool_always_select_tail=True, attention_bias=False, rms_norm_eps=1e-5,
    )
    cfg.update(over)
    return SimpleNamespace(**cfg)


def _mla(seed: int, **over) -> SparseMLAProjections:
    # float64, but both formulations take softmax (and pool weights) in float32: compare
    # to ~1e-6, far below what one differently chosen pool changes
    torch.manual_seed(seed)
    layer = SparseMLAProjections(_mla_config(**over))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 if p.dim() > 1 else torch.randn(p.shape))
    return layer.double()


@pytest.mark.parametrize("seq_len", [7, 33, 130])
@pytest.mark.parametrize("index_heads", [3, 1])
@pytest.mark.parametrize("rope", [0, 6])
def test_absorbed_sparse_mla_equals_dense_masked(seq_len, index_heads, rope):
    layer = _mla(seq_len + index_heads, index_n_heads=index_heads, qk_rope_head_dim=rope)
    x = torch.randn(seq_len, 48, dtype=torch.float64)
    rows = layer.close_pools(layer.cache_rows(x))
    positions = torch.arange(seq_len)
    with torch.no_grad():
        dense = layer.attend_dense(x, rows, positions)
        fast = layer.attend(x, rows, positions)
        # a later step: the last 5 queries against the whole sequence
        fast_tail = layer.attend(x[-5:], rows, positions[-5:])
    torch.testing.assert_close(fast, dense, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast_tail, dense[-5:], atol=1e-6, rtol=1e-5)


def test_absorbed_sparse_mla_equals_dense_masked_when_every_pool_ties():
    """All indexer queries zero: every pool scores exactly 0, so the lower pool indices
    must win in both formulations, and the output differs from picking other pools."""
    layer = _mla(5)
    with torch.no_grad():
        layer.indexer.wq_b.weight.zero_()
    x = torch.randn(100, 48, dtype=torch.float64)
    rows = layer.close_pools(layer.cache_rows(x))
    positions = torch.arange(100)
    with torch.no_grad():
        dense = layer.attend_dense(x, rows, positions)
        fast = layer.attend(x, rows, positions)
    torch.testing.assert_close(fast, dense, atol=1e-6, rtol=1e-5)
    chosen = sparse_mla.select_pools(
        torch.zeros(1, 3, 8), torch.ones(1, 3), torch.randn(25, 8), torch.tensor([99]), 4, 32
    )
    assert chosen.tolist() == [list(range(8))]


def test_closing_rows_hold_the_pool_keys_and_attention_reads_only_those():
    """Row format 2: a pool's key sits in its closing row's z columns and is what selection
    uses; the other rows' k and z are not read once the pool is complete."""
    layer = _mla(11)
    kpool, dk, r = 4, 8, 24
    x = torch.randn(130, 48, dtype=torch.float64)
    raw = layer.cache_rows(x)
    rows = layer.close_pools(raw)
    closing = torch.arange(kpool - 1, 130, kpool)
    assert closing.numel() == 32
    stored = rows[closing, r + dk :]
    assert torch.equal(stored, sparse_mla.pool_keys(raw[:, r : r + dk], raw[:, r + dk :],
                                                    layer.indexer.index_kpool_compress_ape))
    others = torch.ones(130, dtype=torch.bool)
    others[closing] = False
    assert torch.equal(rows[others], raw[others]) and torch.equal(rows[:, : r + dk], raw[:, : r + dk])
    positions = torch.arange(130)
    with torch.no_grad():
        base = layer.attend(x, rows, positions)
        # raw k/z of complete pools' other rows scrambled: nothing changes (keys are stored)
        scrambled = rows.clone()
        scrambled[others[:128].nonzero().flatten(), r:] = torch.randn(96, 2 * dk, dtype=torch.float64)
        torch.testing.assert_close(layer.attend(x, scrambled, positions), base, atol=0, rtol=0)
        # the stored key of pool 5 replaced: the selection and the output follow it
        corrupt = rows.clone()
        corrupt[closing[5], r + dk :] = 50 * torch.randn(dk, dtype=torch.float64)
        moved = layer.attend(x, corrupt, positions)
        torch.testing.assert_close(moved, layer.attend_dense(x, corrupt, positions), atol=1e-6, rtol=1e-5)
    assert (moved - base).abs().max() > 1e-3


def _paged_run(layer, xs, splits, block=10, seed=0):
    """Run requests ``xs`` (``[S_i, hidden]`` each) through ``forward_paged`` in lockstep
    steps (step k holds ``splits[i][k]`` tokens of request i) over a paged cache with
    shuffled blocks. Returns each request's outputs and its rows read back in order."""
    from glm5next_plugin.mla_layer import SparseMLAMetadata

    need = [-(-x.shape[0] // block) for x in xs]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(xs), max(need), dtype=torch.long)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at : at + n]
        at += n
    cache = torch.full((sum(need) + 3, block, layer.row_size), float("nan"), dtype=xs[0].dtype)
    done = [0] * len(xs)
    outs = [[] for _ in xs]
    for step in range(max(len(s) for s in splits)):
        takes = [s[step] if step < len(s) else 0 for s in splits]
        loc, xb, slots = [0], [], []
        for i, t in enumerate(takes):
            pos = torch.arange(done[i], done[i] + t)
            xb.append(xs[i][pos])
            slots.append(table[i, pos // block] * block + pos % block)
            loc.append(loc[-1] + t)
        md = SparseMLAMetadata(query_start_loc=loc, seq_lens=[d + t for d, t in zip(done, takes)],
                               block_table=table, slot_mapping=torch.cat(slots), num_reqs=len(xs),
                               num_actual_tokens=loc[-1])
        with torch.no_grad():
            y = layer.forward_paged(torch.cat(xb), cache, md)
        for i, t in enumerate(takes):
            outs[i].append(y[loc[i] : loc[i + 1]])
            done[i] += t
    rows = []
    for i, x in enumerate(xs):
        pos = torch.arange(x.shape[0])
        rows.append(cache[table[i, pos // block], pos % block])
    return [torch.cat(o) for o in outs], rows


@pytest.mark.parametrize("rope", [0, 6])
def test_paged_steps_split_mid_pool_store_the_same_rows_and_outputs_as_one_shot(rope):
    """Chunked prefill splitting pools across steps (and blocks of 10 tokens splitting
    pools of 4 across blocks), then decode, in a batch of two requests: the cache holds the
    same rows as a one-shot prefill (pool keys built from rows of earlier steps) and the
    outputs agree with one-shot and with the standalone path."""
    layer = _mla(21, qk_rope_head_dim=rope)
    assert layer.row_size == 24 + rope + 2 * 8
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(130, 48, dtype=torch.float64, generator=g), torch.randn(77, 48, dtype=torch.float64, generator=g)]
    one_out, one_rows = _paged_run(layer, xs, [[130], [77]])
    split_a = [5, 7, 1, 1, 30, 2, 50, 1, 1, 1, 31]  # decode-like single tokens in between
    split_b = [3, 0, 6, 13, 1, 2, 40, 1, 1, 1, 9]
    assert sum(split_a) == 130 and sum(split_b) == 77
    out, rows = _paged_run(layer, xs, [split_a, split_b], seed=1)
    # The pool weights' softmax runs in float32, as in serving (sparse_mla.py): bit-equal
    # across step splits on the AVX-512 CPUs this was written on, but on an AVX2-only CPU
    # (AMD EPYC, measured) torch's float32 kernels round a pool split across steps one
    # float32 ulp apart (up to 4.5e-8 of a 0.56 entry, 5 of 5200): rows agree to float32, not
    # bit for bit. With a rope part, kv_a_proj_with_mqa is 30 wide and its last columns (the
    # rope key) round by the step's batch size too (float64 ulps; BLAS tiles 24 columns
    # evenly, 30 not).
    row_tol = 2e-7
    for i, x in enumerate(xs):
        with torch.no_grad():
            ref_rows = layer.close_pools(layer.cache_rows(x))
            ref_out = layer.forward_sequence(x)
        assert not rows[i].isnan().any()
        torch.testing.assert_close(rows[i], one_rows[i], atol=row_tol, rtol=0)
        torch.testing.assert_close(one_rows[i], ref_rows, atol=row_tol, rtol=0)
        torch.testing.assert_close(out[i], one_out[i], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(one_out[i], ref_out, atol=1e-12, rtol=1e-10)


def test_paged_decode_uses_the_stored_pool_key():
    """A decode step over the paged cache equals the standalone path over rows in cache
    format, and replacing the stored pool keys (closing rows' z) changes it (the stored
    keys are read, not rebuilt from the pools' rows)."""
    layer = _mla(8)
    x = torch.randn(131, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out, _ = _paged_run(layer, [x], [[130, 1]])
    with torch.no_grad():
        rows = layer.close_pools(layer.cache_rows(x))
        corrupt = rows.clone()
        corrupt[3::4, 24 + 8 :] = torch.randn(32, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        pos = torch.tensor([130])
        clean = layer.attend(x[-1:], rows, pos)
        moved = layer.attend(x[-1:], corrupt, pos)
    torch.testing.assert_close(out[0][-1:], clean, atol=1e-12, rtol=1e-10)
    assert (moved - clean).abs().max() > 1e-3


def test_select_pools_matches_the_mask_and_keeps_memory_blocked():
    g = torch.Generator().manual_seed(1)
    kpool, topk, s = 4, 12, 90
    pooled = sparse_mla.pool_keys(torch.randn(s, 8, generator=g), torch.randn(s, 8, generator=g),
                                  torch.randn(kpool, 8, generator=g))
    q, w = torch.randn(s, 2, 8, generator=g), torch.randn(s, 2, generator=g)
    positions = torch.arange(s)
    mask = sparse_mla.select_tokens(q, w, pooled, positions, s, kpool, topk)
    # a tiny block budget forces one query per block
    chosen = sparse_mla.select_pools(q, w, pooled, positions, kpool, topk, block_elems=1)
    tokens, valid = sparse_mla.gather_index(chosen, positions, kpool)
    rebuilt = torch.zeros(s, s, dtype=torch.bool)
    rebuilt[torch.arange(s)[:, None].expand_as(tokens)[valid], tokens[valid]] = True
    assert torch.equal(rebuilt, mask)
    assert tokens.shape == (s, topk + kpool)  # bounded by the top-k, not the context


def _kda_inputs(t: int, h: int = 3, d: int = 16, seed: int = 0, bound: float = -5.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = kda.l2_normalize(torch.randn(t, h, d, generator=g)) * d**-0.5
    k = kda.l2_normalize(torch.randn(t, h, d, generator=g))
    v = torch.randn(t, h, d, generator=g)
    gate = bound * torch.sigmoid(torch.randn(t, h, d, generator=g))
    beta = torch.sigmoid(torch.randn(t, h, generator=g))
    state = torch.randn(h, d, d, generator=g)
    return [x.to(dtype) for x in (q, k, v, gate, beta, state)]


@pytest.mark.parametrize("chunk", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("t_len", [1, 15, 17, 100])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunked_kda_equals_token_loop(chunk, t_len, with_state):
    q, k, v, g, beta, s0 = _kda_inputs(t_len, seed=t_len + chunk)
    s0 = s0 if with_state else None
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, s0)
    out, state = kda.kda_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-5)


def test_chunked_kda_survives_gates_too_steep_for_the_chunk():
    """Log-decays near -40 a token: exp of a 64-token cumulative gate would overflow float32;
    the chunk shrinks so the result stays exact and finite."""
    q, k, v, g, beta, s0 = _kda_inputs(70, seed=9, bound=-40.0)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, s0)
    out, state = kda.kda_chunked(q, k, v, g, beta, s0, chunk_size=64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-5)


def test_chunked_kda_bf16_inputs_accumulate_in_float32():
    q, k, v, g, beta, s0 = _kda_inputs(50, seed=4, dtype=torch.bfloat16)
    ref_out, ref_state = kda.kda_reference(q, k, v, g, beta, s0)
    out, state = kda.kda_chunked(q, k, v, g, beta, s0)
    assert out.dtype == state.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_top_pool_set_is_top_pools_as_a_set_with_ties():
    g = torch.Generator().manual_seed(7)
    # coarse integer scores: many exact ties, incl. at the cut
    scores = torch.randint(-3, 4, (200, 37), generator=g).float().relu()
    for keep in (1, 5, 16, 37):
        fast = sparse_mla.top_pool_set(scores, keep)
        ref = sparse_mla.top_pools(scores, keep).sort(dim=-1).values
        assert torch.equal(fast, ref), keep
