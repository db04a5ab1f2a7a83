"""The sparse-MLA layer's FP8 KV cache (``--kv-cache-dtype fp8``), without an engine: the
row quantiser and dequantiser, what a paged step writes into a ``uint8`` page and reads
back, the page vLLM is told to allocate, the connector's geometry over it, and the
namespace an fp8 engine gets. The engine itself: ``tests/engine/test_fp8_kv_e2e.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from glm5next_plugin import sparse_mla
from glm5next_plugin.mla_layer import (
    FP8_MAX,
    SparseMLAMetadata,
    SparseMLAProjections,
    dequantize_rows,
    kv_cache_refusal,
    quantize_rows,
)

F8 = torch.float8_e4m3fn


def test_every_fp8_byte_round_trips_and_dequantises_to_its_e4m3_value():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = dequantize_rows(raw, torch.float32)
    finite = ~values.isnan()
    assert finite.sum() == 254  # e4m3fn: 0x7f and 0xff are NaN, no infinities
    assert torch.equal(values[finite], raw[finite].view(F8).float())
    back = quantize_rows(values[finite])
    assert back.dtype == torch.uint8
    assert torch.equal(back, raw[finite])  # -0.0 included (0x80)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(quantize_rows(values[finite].to(dtype)), back)


def test_quantise_rounds_to_nearest_saturates_and_applies_the_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 20
    q = quantize_rows(x)
    assert q.shape == x.shape and q.dtype == torch.uint8 and q.element_size() == 1
    y = dequantize_rows(q, torch.float32)
    normal = x.abs() >= 2.0**-6  # e4m3's smallest normal; 3 mantissa bits: half an ulp is 2^-4 relative
    assert ((y - x).abs() <= x.abs() * 2.0**-4)[normal].all()
    assert ((y - x).abs() <= 2.0**-10)[~normal].all()  # subnormal spacing 2^-9
    # nearest: no other e4m3 value is closer
    grid = dequantize_rows(torch.arange(256, dtype=torch.int32).to(torch.uint8), torch.float32)
    grid = grid[~grid.isnan()]
    nearest = (x[:256, None] - grid[None]).abs().min(dim=1).values
    assert torch.equal((y[:256] - x[:256]).abs(), nearest)
    # beyond e4m3's range: saturated to +-448 (vLLM's fp8 cache kernels saturate), never NaN
    big = dequantize_rows(quantize_rows(torch.tensor([1e4, -1e4, 449.0, float("inf")])), torch.float32)
    assert big.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX, FP8_MAX]
    # a per-tensor scale: the stored value is x / scale, read back times scale
    assert torch.equal(quantize_rows(x, 4.0), quantize_rows(x / 4.0))
    assert torch.equal(dequantize_rows(q, torch.float32, 4.0), 4.0 * y)
    assert dequantize_rows(q, torch.bfloat16).dtype == torch.bfloat16


def _mla_config(**over):
    cfg = dict(
        hidden_size=48, num_attention_heads=4, kv_lora_rank=24, q_lora_rank=20, qk_nope_head_dim=12,
        qk_rope_head_dim=0, v_head_dim=10, index_topk=16, index_kpool=4, index_n_heads=3, index_head_dim=8,
        index_kpool_always_select_tail=True, attention_bias=False, rms_norm_eps=1e-5,
    )
    cfg.update(over)
    return SimpleNamespace(**cfg)


def _mla(seed: int, dtype: torch.dtype, **over) -> SparseMLAProjections:
    torch.manual_seed(seed)
    layer = SparseMLAProjections(_mla_config(**over))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5 if p.dim() > 1 else torch.randn(p.shape))
    return layer.to(dtype)


def _paged(layer, x, steps, cache, block):
    """One request through ``forward_paged`` in steps of ``steps`` tokens, its blocks
    shuffled; returns (outputs, the request's rows as the cache holds them)."""
    n = x.shape[0]
    nblocks = -(-n // block)
    table = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(1))[:nblocks][None]
    outs, done = [], 0
    for t in steps:
        pos = torch.arange(done, done + t)
        md = SparseMLAMetadata(query_start_loc=[0, t], seq_lens=[done + t], block_table=table,
                               slot_mapping=table[0, pos // block] * block + pos % block, num_reqs=1,
                               num_actual_tokens=t)
        with torch.no_grad():
            outs.append(layer.forward_paged(x[pos], cache, md))
        done += t
    pos = torch.arange(n)
    return torch.cat(outs), cache[table[0, pos // block], pos % block]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [0, 6])
def test_fp8_page_holds_quantised_rows_and_attention_reads_them_dequantised(dtype, rope):
    """Chunked steps (pools split across steps and 16-token blocks) over a ``uint8`` page:
    every row is the quantised cache row, every closing row's pool key is the quantised key
    of its pool computed from the dequantised rows, and each step's output is exactly the
    layer's attention over the dequantised rows (nothing reads unquantised values)."""
    layer = _mla(7, dtype, qk_rope_head_dim=rope)
    block, n, steps = 16, 70, [23, 16, 30, 1]
    x = torch.randn(n, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    cache = torch.full((8, block, layer.row_size), 0x7F, dtype=torch.uint8)  # NaN until written
    out, raw = _paged(layer, x, steps, cache, block)
    assert raw.dtype == torch.uint8 and raw.shape == (n, layer.row_size)
    with torch.no_grad():
        fresh = layer.cache_rows(x)
    closing = sparse_mla.closing_positions(0, n, layer.kpool, x.device)
    others = torch.ones(n, dtype=torch.bool)
    others[closing] = False
    expect = quantize_rows(fresh)
    assert torch.equal(raw[others], expect[others])
    assert torch.equal(raw[:, : layer.pool_key_cols.start], expect[:, : layer.pool_key_cols.start])
    rows = dequantize_rows(raw, dtype)
    with torch.no_grad():
        keys = layer.pool_keys_at(closing, lambda idx, cols: dequantize_rows(expect, dtype)[idx, cols], dtype)
    assert torch.equal(raw[closing, layer.pool_key_cols], quantize_rows(keys))
    done = 0
    with torch.no_grad():
        for t in steps:
            want = layer.attend(x[done : done + t], rows[: done + t], torch.arange(done, done + t))
            assert torch.equal(out[done : done + t], want)
            done += t
        # and it is the same layer: against an unquantised page the output moves by fp8's
        # rounding (3 mantissa bits) and the pool choices near a tie it flips; measured 9-17%
        full, _ = _paged(layer, x, steps, torch.full((8, block, layer.row_size), float("nan"), dtype=dtype), block)
    assert out.isfinite().all()
    assert (out - full).float().norm() <= 0.25 * full.float().norm()


def test_fp8_page_uses_the_layers_scale():
    layer = _mla(3, torch.float32)
    layer.k_scale.fill_(0.5)
    x = torch.randn(20, 48, generator=torch.Generator().manual_seed(4))
    _, raw = _paged(layer, x, [20], torch.zeros(4, 16, layer.row_size, dtype=torch.uint8), 16)
    with torch.no_grad():
        rows = layer.cache_rows(x)
    closing = sparse_mla.closing_positions(0, 20, layer.kpool, x.device)
    assert torch.equal(raw[:, : layer.pool_key_cols.start], quantize_rows(rows, 0.5)[:, : layer.pool_key_cols.start])
    assert not torch.equal(raw[:, : layer.key_size], quantize_rows(rows)[:, : layer.key_size])
    assert closing.numel() == 5


def test_kv_cache_dtypes_served_and_refused():
    for ok in ("auto", "fp8", "fp8_e4m3"):
        assert kv_cache_refusal(ok) is None
    assert "only the e4m3" in kv_cache_refusal("fp8_e5m2")
    assert "FlashMLA" in kv_cache_refusal("fp8_ds_mla")
    why = kv_cache_refusal("int8_per_token_head")
    assert "not supported by the sparse-MLA layers" in why and "supported: auto, fp8, fp8_e4m3" in why


def test_the_plugin_refuses_other_kv_cache_dtypes_before_loading_weights(ckpt):
    from transformers import AutoConfig

    from glm5next_plugin.model import check_supported

    cfg = AutoConfig.from_pretrained(ckpt)
    engine = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
                             cache_config=SimpleNamespace(cache_dtype="fp8_e5m2"))
    with pytest.raises(NotImplementedError, match="'fp8_e5m2' is not supported by the sparse-MLA layers"):
        check_supported(cfg, engine)
    for ok in ("auto", "fp8", "fp8_e4m3"):
        engine.cache_config.cache_dtype = ok
        check_supported(cfg, engine)


class _OneLayer(nn.Module):
    """``model.language_model.layers.0.self_attn``: one sparse-MLA layer under its
    checkpoint name."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.language_model = nn.Module()
        self.model.language_model.layers = nn.ModuleList([nn.Module()])
        self.model.language_model.layers[0].self_attn = _mla(5, torch.float32)


@pytest.mark.parametrize("stored", [None, torch.tensor(0.25), torch.tensor([0.25])])
def test_checkpoint_k_scale_is_optional_and_loaded_when_present(stored):
    from glm5next_plugin.weight_loading import cast_for_inference, load_by_name

    src, dst = _OneLayer(), _OneLayer()
    weights = {n: p.detach().clone() for n, p in src.named_parameters()}
    if stored is not None:
        weights["model.language_model.layers.0.self_attn.k_scale"] = stored
    loaded = load_by_name(dst, iter(weights.items()), num_layers=1)
    assert "model.language_model.layers.0.self_attn.k_scale" in loaded
    scale = dst.model.language_model.layers[0].self_attn.k_scale
    assert scale.shape == () and float(scale) == (1.0 if stored is None else 0.25)
    cast_for_inference(dst, torch.bfloat16)  # the scale stays float32 in a bf16 model
    scale = dst.model.language_model.layers[0].self_attn.k_scale
    assert scale.dtype == torch.float32 and float(scale) == (1.0 if stored is None else 0.25)


# --- what vLLM allocates, what the connector resolves, what the namespace names ----------


@pytest.fixture(scope="module")
def layouts():
    """The plugin's KV cache for the real GLM-5.3-Flash at TP 1 as vLLM builds it, bf16 and
    fp8 (``testing/glm_flash_kv_layouts.py``: the layers' own ``get_kv_cache_spec``, vLLM's
    grouping and placement), with the connector's geometry of each."""
    from testing import glm_flash_kv_layouts as L

    out = {}
    for cache_dtype in ("auto", "fp8", "fp8_e4m3"):
        built = L.build("plugin", 1, num_blocks=2, cache_dtype=cache_dtype)
        out[cache_dtype] = (built, L.resolve(built))
    return out


def test_fp8_page_is_half_the_bf16_bytes_per_token_and_the_geometry_reads_it(layouts):
    from testing import glm_flash_kv_layouts as L

    (auto, geo_auto), (fp8, geo_fp8) = layouts["auto"], layouts["fp8"]
    name = "model.language_model.layers.3.self_attn"  # an MLA layer (layer_types: KDA x3, MLA)
    spec_auto, spec_fp8 = L.layer_spec(auto.kv_cache_config, name), L.layer_spec(fp8.kv_cache_config, name)
    assert spec_auto.dtype == torch.bfloat16 and spec_fp8.dtype == torch.uint8
    per_token = {k: s.real_page_size_bytes / s.block_size for k, s in (("auto", spec_auto), ("fp8", spec_fp8))}
    assert per_token["fp8"] * 2 == per_token["auto"] == 2 * L.plugin_row_size(L.text_config())
    # the KDA state is not fp8: vLLM takes a longer block so the attention page still covers it
    assert fp8.block_size > auto.block_size
    attn = {k: {g.name: g for g in geo.attn_groups} for k, geo in (("auto", geo_auto), ("fp8", geo_fp8))}
    for part in ("mla_latent", "indexer_cache"):
        a, f = attn["auto"][part], attn["fp8"][part]
        assert f.object_bytes_per_block / f.block_size * 2 == a.object_bytes_per_block / a.block_size
        assert {p.dtype for p in f.layers} == {"uint8"} and f.replicated_across_tp
    state = {k: [g.object_bytes_per_block for g in geo.state_groups] for k, geo in (("auto", geo_auto), ("fp8", geo_fp8))}
    assert state["auto"] == state["fp8"]  # one snapshot a block, same bytes
    # the views vLLM's runner makes over the page: uint8 [blocks, 1, block, row] per MLA layer
    _, views = L.allocate(fp8)
    assert views[name].dtype == torch.uint8 and views[name].shape[-1] == L.plugin_row_size(L.text_config())


def test_fp8_and_bf16_engines_never_share_a_namespace(layouts):
    """The namespace digests the cache dtype and every page's bytes and element type, so an
    fp8 engine's objects are never looked up by a bf16 (or fp32) one, nor the reverse;
    ``fp8`` and its alias ``fp8_e4m3`` (the same bytes) are kept apart too, conservatively."""
    from connector.namespace import engine_fingerprint
    from glm5next_plugin.mla_layer import CACHE_ROW_FORMAT

    def name(built, geo, cache_dtype=None):
        cfg = built.vllm_config
        engine = SimpleNamespace(  # the built config with the model a served engine names
            model_config=SimpleNamespace(model="zai-org/GLM-5.3-Flash", revision=None, dtype=torch.bfloat16,
                                         served_model_name=None),
            parallel_config=cfg.parallel_config,
            cache_config=SimpleNamespace(cache_dtype=cache_dtype or cfg.cache_config.cache_dtype,
                                         mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"))
        return engine_fingerprint(engine, built.kv_cache_config, geo, CACHE_ROW_FORMAT)

    names = {k: name(b, geo) for k, (b, geo) in layouts.items()}
    assert len(set(names.values())) == 3, names
    # the cache dtype alone moves it: the bf16 geometry described as fp8 is another namespace
    assert name(*layouts["auto"], cache_dtype="fp8") != names["auto"]
