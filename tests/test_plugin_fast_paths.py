"""The plugin's fast paths against their readable references, on random inputs (no vLLM).

- sparse MLA: the absorbed path the layers run (chosen pools + tail gathered per query,
  queries folded into the latent space through ``kv_b_proj``'s K part, values out through
  its V part) equals the dense-masked formulation (every row expanded, ``[T, S]`` mask,
  full logits), with random and with exactly tied indexer scores;
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
def test_absorbed_sparse_mla_equals_dense_masked(seq_len, index_heads):
    layer = _mla(seq_len + index_heads, index_n_heads=index_heads)
    x = torch.randn(seq_len, 48, dtype=torch.float64)
    rows = layer.cache_rows(x)
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
    rows = layer.cache_rows(x)
    positions = torch.arange(100)
    with torch.no_grad():
        dense = layer.attend_dense(x, rows, positions)
        fast = layer.attend(x, rows, positions)
    torch.testing.assert_close(fast, dense, atol=1e-6, rtol=1e-5)
    chosen = sparse_mla.select_pools(
        torch.zeros(1, 3, 8), torch.ones(1, 3), torch.randn(25, 8), torch.tensor([99]), 4, 32
    )
    assert chosen.tolist() == [list(range(8))]


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
