"""The real GLM-5.3-Flash KV cache (native and plugin layouts, TP 1/2/4), as vLLM groups,
places and views it on CPU: the connector's per-layer geometry matches vLLM's pages, and a
save then load round trip is byte-exact for every cached group while every other byte
(neighbouring pages, other blocks, padding) keeps its canary value.

Fixture and the source of every shape: ``validation/glm_flash_kv_layouts.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("transformers")

from connector.kv_pages import PagedKVCache  # noqa: E402
from validation import glm_flash_kv_layouts as L  # noqa: E402

CASES = [(layout, tp) for layout in L.LAYOUTS for tp in L.TP_SIZES]


@pytest.fixture(scope="module")
def cfg():
    return L.text_config()


def test_config_defaults_are_the_real_model(cfg):
    kinds = cfg.layer_types
    assert len(kinds) == cfg.num_hidden_layers == 45
    assert kinds.count("linear_attention") == 34
    assert (cfg.linear_num_heads, cfg.linear_head_dim) == (64, 128)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_kpool, cfg.index_head_dim) == (512, 0, 16, 128)


@pytest.mark.parametrize(
    ("layout", "tp", "block"),
    [("native", 1, 4608), ("native", 2, 2560), ("native", 4, 1536),
     ("plugin", 1, 2944), ("plugin", 2, 1536), ("plugin", 4, 768)],
)
def test_unified_block_size(cfg, layout, tp, block):
    assert L.block_size(layout, cfg, tp) == block
    # The attention page of a block holds the KDA state: what the alignment is for.
    per_token = L.native_attn_page_per_token(cfg) if layout == "native" else L.plugin_attn_page_per_token(cfg)
    assert block * per_token >= L.kda_page_bytes(cfg, tp)


def _page_ranges(views: dict[str, torch.Tensor], raw: torch.Tensor, name: str, block: int) -> tuple[int, int]:
    """The bytes vLLM's own view of this layer reads for ``block`` (independent of the
    connector's placement arithmetic)."""
    view = views[name][block]
    assert view.is_contiguous()
    start = view.data_ptr() - raw.data_ptr()
    return start, start + view.numel() * view.element_size()


@pytest.mark.parametrize(("layout", "tp"), CASES)
def test_geometry_pages_are_each_layers_own(cfg, layout, tp):
    built = L.build(layout, tp, num_blocks=2, cfg=cfg)
    raw, views = L.allocate(built)
    geo = L.resolve(built)
    kv = built.kv_cache_config
    assert geo.scheduler_block_size == built.block_size
    for g in geo.groups:
        for p in g.layers:
            start, end = _page_ranges(views, raw, p.name, 0)
            assert p.page_bytes == end - start, p.name
            assert p.tokens_per_page == built.block_size
    mla = [g for g in geo.attn_groups]
    assert len(mla) == 1 and len(geo.state_groups) == 4
    assert sum(len(g.layers) for g in geo.state_groups) == 34
    assert all(g.replicated_across_tp for g in mla)
    assert not any(g.replicated_across_tp for g in geo.state_groups)
    kda = geo.state_groups[0].layers[0]
    assert kda.page_bytes == L.kda_page_bytes(cfg, tp)
    if layout == "native":
        # One vLLM group, two page sizes: latent (bf16, 1 KiB a token) and kpool indexer
        # (fp8 + scale bytes, one 132-byte state per 16 tokens).
        pages = {p.name.rsplit(".", 1)[-1]: p for p in mla[0].layers}
        assert len(mla[0].layers) == 22
        assert pages["attn"].page_bytes == built.block_size * 1024
        assert pages["attn"].dtype == "bfloat16"
        assert pages["k_cache"].page_bytes == built.block_size // 16 * 132
        assert (pages["k_cache"].dtype, pages["k_cache"].states_per_page) == ("uint8", built.block_size // 16)
        # The tail ring is a scratch group: present in vLLM's config, never cached.
        tail = [i for i, grp in enumerate(kv.kv_cache_groups) if "tail_cache" in grp.layer_names[0]]
        assert len(tail) == 1 and geo.group_tokens_per_block[tail[0]] == 0
        assert tail[0] not in {g.group_id for g in geo.groups}
    else:
        assert len(mla[0].layers) == 11
        assert {p.page_bytes for p in mla[0].layers} == {built.block_size * 768 * 2}


@pytest.mark.parametrize(("layout", "tp"), CASES)
def test_round_trip_is_byte_exact_and_leaves_neighbours(cfg, layout, tp):
    built = L.build(layout, tp, num_blocks=4, cfg=cfg)
    raw, views = L.allocate(built)
    geo = L.resolve(built)
    pages = PagedKVCache(views, built.kv_cache_config, geo.groups)
    gen = torch.Generator().manual_seed(tp)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=gen))
    for g in geo.groups:
        # Save blocks [1, 2] (a chunk of two blocks; a state snapshot: block 1), load
        # them into [3, 0]; one attention load skips a locally held block (None).
        moves = [([1], [2])] if g.is_state else [([1, 2], [3, 0]), ([2, 1], [None, 3])]
        for src, dst in moves:
            before = raw.clone()
            payload = pages.read(g.group_id, src)
            assert len(payload) == g.object_bytes(len(src)) == sum(
                _page_ranges(views, raw, p.name, 0)[1] - _page_ranges(views, raw, p.name, 0)[0]
                for p in g.layers
            ) * len(src)
            pages.write(g.group_id, dst, payload)
            expected = before.clone()
            for p in g.layers:
                for s, d in zip(src, dst):
                    if d is None:
                        continue
                    s0, s1 = _page_ranges(views, raw, p.name, s)
                    d0, d1 = _page_ranges(views, raw, p.name, d)
                    expected[d0:d1] = before[s0:s1]
            assert torch.equal(raw, expected), (layout, tp, g.group_id, src, dst)
            kept = [(s, d) for s, d in zip(src, dst) if d is not None]
            assert pages.read(g.group_id, [d for _, d in kept]) == pages.read(g.group_id, [s for s, _ in kept])
