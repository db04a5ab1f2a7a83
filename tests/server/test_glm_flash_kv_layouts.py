"""The real GLM-5.3-Flash KV cache (native and plugin layouts, TP 1/2/4), as vLLM groups,
places and views it on CPU: the connector's per-layer geometry matches vLLM's pages, and a
save then load round trip is byte-exact for every cached group while every other byte
(neighbouring pages, other blocks, padding) keeps its canary value.

Fixture and the source of every shape: ``testing/glm_flash_kv_layouts.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_interface")
pytest.importorskip("transformers")

from connector.kv_pages import PagedKVCache  # noqa: E402
from testing import glm_flash_kv_layouts as L  # noqa: E402

CASES = [(layout, tp) for layout in L.LAYOUTS for tp in L.TP_SIZES]


@pytest.fixture(scope="module")
def cfg():
    return L.text_config()


def test_config_is_the_served_checkpoint(cfg):
    kinds = cfg.layer_types
    assert len(kinds) == cfg.num_hidden_layers == 45
    assert kinds.count("linear_attention") == 34
    assert (cfg.linear_num_heads, cfg.linear_head_dim) == (64, 128)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.index_topk) == (512, 0, 128, 2048)
    # the served checkpoint pools 4 tokens per indexer slot (transformers' default: 16)
    assert cfg.index_kpool == 4


@pytest.mark.parametrize(
    ("layout", "tp", "block"),
    [("native", 1, 4352), ("native", 2, 2176), ("native", 4, 1152),
     ("plugin", 1, 2944), ("plugin", 2, 1536), ("plugin", 4, 768)],
)
def test_unified_block_size(cfg, layout, tp, block):
    assert L.block_size(layout, cfg, tp) == block
    # The attention page of a block holds the KDA state: what the alignment is for.
    per_token = L.native_attn_page_per_token(cfg) if layout == "native" else L.plugin_attn_page_per_token(cfg)
    assert block * per_token >= L.kda_page_bytes(cfg, tp)


def test_tp4_native_reproduces_the_served_engines_log(cfg):
    """Seed 003 (the LMCache GLM-5.3-Flash recipe: vLLM 0.33, native model, 4 x H200, TP 4)
    logs ``Setting attention block size to 1152 tokens`` and ``group_tokens_per_block=[1152,
    1152, 1152, 1152, 1152, 0], scheduler_block_size=1152``: four KDA state groups, the
    sparse-MLA latent with the compressed indexer cache (``slots_per_block=288``, one slot
    per four tokens), and the per-request kpool-tail scratch group, not cached."""
    built = L.build("native", 4, num_blocks=2, cfg=cfg)
    geo = L.resolve(built)
    assert built.block_size == geo.scheduler_block_size == 1152
    assert list(geo.group_tokens_per_block) == [1152] * 5 + [0]
    assert "group_tokens_per_block=[1152, 1152, 1152, 1152, 1152, 0], scheduler_block_size=1152" in (
        geo.with_chunk_size(1152).log_line())
    kinds = [{type(s).__name__ for s in g.kv_cache_spec.kv_cache_specs.values()}
             for g in built.kv_cache_config.kv_cache_groups]
    assert kinds == [{"MambaSpec"}] * 4 + [{"MLAAttentionSpec"}, {"CircularBufferSpec"}]
    assert [len(g.layer_names) for g in built.kv_cache_config.kv_cache_groups] == [9, 9, 8, 8, 22, 11]
    group4 = {n.split(".self_attn.")[1] for n in built.kv_cache_config.kv_cache_groups[4].layer_names}
    assert group4 == {"attn", "indexer.k_cache"}
    assert all(n.endswith(".indexer.tail_cache") for n in built.kv_cache_config.kv_cache_groups[5].layer_names)
    # 288 indexer rows per block: the connector's geometry and vLLM's own view of the cache
    indexer = next(g for g in geo.attn_groups if g.name == "indexer_cache")
    assert {(p.states_per_page, p.tokens_per_page) for p in indexer.layers} == {(288, 1152)}
    _, views = L.allocate(built)
    assert {tuple(views[p.name].shape) for p in indexer.layers} == {(2, 1, 288, 132)}


def test_latent_sets_topk_buffer_width_as_the_native_model_does(cfg):
    """vLLM 0.33's latent spec carries the width of the sparse top-k index buffer; the
    fixture sets it as the native model computes it (where the field exists)."""
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    assert L.topk_buffer_width(cfg) == 2176  # 2048 + 4 - 1, up to a multiple of 128
    latent = L.native_specs(cfg, 4, 1152)["model.layers.3.self_attn.attn"]
    if not any(f.name == "topk_buffer_width" for f in fields(MLAAttentionSpec)):
        pytest.skip("this vLLM's MLAAttentionSpec has no topk_buffer_width (added in vLLM 0.33)")
    assert latent.topk_buffer_width == L.topk_buffer_width(cfg)
    try:
        from vllm.models.glm5next.common.model import get_sparse_topk_buffer_width
    except ImportError:
        return  # the native model does not import on this build: the formula above stands
    assert L.topk_buffer_width(cfg) == get_sparse_topk_buffer_width(cfg)


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
    row_cover: dict[str, int] = {}
    for g in geo.groups:
        for p in g.layers:
            start, end = _page_ranges(views, raw, p.name, 0)
            assert p.page_extent == end - start, p.name
            assert p.tokens_per_page == built.block_size
            row_cover[p.name] = row_cover.get(p.name, 0) + p.row_width
            if p.rows > 1:  # one part of each of the page's rows
                assert p.rows == built.block_size and p.row_offset + p.row_width <= p.row_stride
    # the object groups' parts of a page tile its rows exactly: nothing left out, nothing twice
    for g in geo.groups:
        for p in g.layers:
            assert row_cover[p.name] == (p.row_stride if p.rows > 1 else p.page_bytes), p.name
    # three object groups: KDA state (4 vLLM groups), MLA latent, indexer cache
    assert [g.name for g in geo.state_groups] == ["kda_state"] * 4
    assert sorted(g.name for g in geo.attn_groups) == ["indexer_cache", "mla_latent"]
    assert len({g.vllm_group for g in geo.attn_groups}) == 1
    latent, indexer = (next(g for g in geo.attn_groups if g.name == n) for n in ("mla_latent", "indexer_cache"))
    assert sum(len(g.layers) for g in geo.state_groups) == 34
    assert len(latent.layers) == len(indexer.layers) == 11
    assert latent.replicated_across_tp and indexer.replicated_across_tp
    assert not any(g.replicated_across_tp for g in geo.state_groups)
    kda = geo.state_groups[0].layers[0]
    assert kda.page_bytes == L.kda_page_bytes(cfg, tp)
    kv_lora, pool, idx_dim = cfg.kv_lora_rank, cfg.index_kpool, cfg.index_head_dim
    if layout == "native":
        # One vLLM group, two page sizes, one object group each: latent (bf16, 1 KiB a
        # token) and kpool indexer (fp8 + scale bytes, one 132-byte state per pool).
        assert all(p.name.endswith(".attn") for p in latent.layers)
        assert all(p.name.endswith(".indexer.k_cache") for p in indexer.layers)
        assert {p.page_bytes for p in latent.layers} == {built.block_size * kv_lora * 2}
        assert {p.dtype for p in latent.layers} == {"bfloat16"}
        assert {p.page_bytes for p in indexer.layers} == {built.block_size // pool * (idx_dim + idx_dim // 128 * 4)}
        assert {(p.dtype, p.states_per_page) for p in indexer.layers} == {("uint8", built.block_size // pool)}
        # The tail ring is a scratch group: present in vLLM's config, never cached.
        tail = [i for i, grp in enumerate(kv.kv_cache_groups) if "tail_cache" in grp.layer_names[0]]
        assert len(tail) == 1 and geo.group_tokens_per_block[tail[0]] == 0
        assert tail[0] not in {g.vllm_group for g in geo.groups}
    else:
        # One row per token (latent, then the indexer's key and pool gate, bf16), split
        # by the parts the plugin declares: columns [0, 512) and [512, 768) of every row.
        row = 2 * (kv_lora + 2 * idx_dim)
        assert {(p.rows, p.row_stride, p.row_offset, p.row_width) for p in latent.layers} == {
            (built.block_size, row, 0, 2 * kv_lora)}
        assert {(p.rows, p.row_stride, p.row_offset, p.row_width) for p in indexer.layers} == {
            (built.block_size, row, 2 * kv_lora, 4 * idx_dim)}


def _part(region: torch.Tensor, p) -> torch.Tensor:
    """The bytes of ``region`` (one layer's page in one block) that object part ``p`` holds."""
    return region if p.rows == 1 else region.view(p.rows, p.row_stride)[:, p.row_offset : p.row_offset + p.row_width]


def _write_path(monkeypatch, path: str) -> None:
    """Make PagedKVCache write on CPU as it does with ``path``: ``table`` (connector/_streamcopy.c
    built: one table of copies in C), ``torch`` (not built: torch's strided copies), ``memmove``
    (not built, the engine under a low glibc non-temporal threshold: one memmove per whole page)."""
    from connector import kv_pages

    if path == "table" and not kv_pages.TABLE_COPIES:
        pytest.skip("connector._streamcopy is not built here")
    monkeypatch.setattr(kv_pages, "TABLE_COPIES", path == "table")
    monkeypatch.setattr(kv_pages, "NON_TEMPORAL_PAGES", path != "torch")


@pytest.mark.parametrize("path", ["table", "torch", "memmove"])
@pytest.mark.parametrize(("layout", "tp"), CASES)
def test_round_trip_is_byte_exact_and_leaves_neighbours(cfg, layout, tp, path, monkeypatch):
    """Every CPU write path (:func:`_write_path`)."""
    _write_path(monkeypatch, path)
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
                _part(raw[slice(*_page_ranges(views, raw, p.name, 0))], p).numel() for p in g.layers
            ) * len(src)
            pages.write(g.group_id, dst, payload)
            expected = before.clone()
            for p in g.layers:
                for s, d in zip(src, dst):
                    if d is None:
                        continue
                    s0, s1 = _page_ranges(views, raw, p.name, s)
                    d0, d1 = _page_ranges(views, raw, p.name, d)
                    _part(expected[d0:d1], p).copy_(_part(before[s0:s1], p))
            assert torch.equal(raw, expected), (layout, tp, g.group_id, src, dst)
            kept = [(s, d) for s, d in zip(src, dst) if d is not None]
            assert pages.read(g.group_id, [d for _, d in kept]) == pages.read(g.group_id, [s for s, _ in kept])


@pytest.mark.parametrize(("layout", "tp"), [("native", 4), ("plugin", 4), ("plugin", 1)])
def test_a_batch_written_at_once_lands_as_each_object_written_alone(cfg, layout, tp, monkeypatch):
    """``write_many`` (a load's batch: every group, one- and two-block objects, a skipped
    block) against ``write`` of each object with torch's strided copies, on the same buffer."""
    from connector import kv_pages

    if not kv_pages.TABLE_COPIES:
        pytest.skip("connector._streamcopy is not built here")
    built = L.build(layout, tp, num_blocks=6, cfg=cfg)
    raw, views = L.allocate(built)
    geo = L.resolve(built)
    pages = PagedKVCache(views, built.kv_cache_config, geo.groups)
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(tp)))
    batch = []
    for g in geo.groups:
        if g.is_state:
            batch.append((g.group_id, [4], pages.read(g.group_id, [1])))
        else:  # a two-block chunk into [3, 0], another object of the group into [5, None]
            batch += [(g.group_id, [3, 0], pages.read(g.group_id, [1, 2])),
                      (g.group_id, [5, None], pages.read(g.group_id, [2, 1]))]
    before = raw.clone()
    monkeypatch.setattr(kv_pages, "TABLE_COPIES", False)
    monkeypatch.setattr(kv_pages, "NON_TEMPORAL_PAGES", False)
    for gid, dst, payload in batch:
        pages.write(gid, dst, payload)
    expected = raw.clone()
    raw.copy_(before)
    monkeypatch.setattr(kv_pages, "TABLE_COPIES", True)
    pages.write_many(batch)
    assert torch.equal(raw, expected)
    assert not torch.equal(raw, before)
    # one object of the wrong size inside a batch: named, and no object of the batch written
    # (either path)
    gid, dst, payload = batch[2]
    short = batch[:2] + [(gid, dst, bytes(len(payload) - 1))] + batch[3:]
    for table in (True, False):
        monkeypatch.setattr(kv_pages, "TABLE_COPIES", table)
        raw.copy_(before)
        with pytest.raises(ValueError, match=f"group {gid}: object of {len(payload) - 1} bytes, expected {len(payload)}"):
            pages.write_many(short)
        assert torch.equal(raw, before)
