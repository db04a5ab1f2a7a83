"""Connector geometry without an engine: strict prefix, negotiation, group resolution,
start-up refusals, namespace fingerprint. Hand-built vLLM KV cache configs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector.geometry import (
    GeometryError,
    UnsupportedLayout,
    resolve_geometry,
    strict_prefix_chunks,
)
from connector.namespace import engine_fingerprint
from connector.vllm_compat import align_mode_flags, mamba_cache_mode_flag_honoured

vkv = pytest.importorskip("vllm.v1.kv_cache_interface")


def _attn(block: int = 1152) -> object:
    return vkv.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)


def _state(block: int = 1152, mode: str = "align") -> object:
    return vkv.MambaSpec(
        block_size=block,
        shapes=((3, 512), (2, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        page_size_padded=2 * block * 64 * 2,
    )


def _tail() -> object:
    return vkv.CircularBufferSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)


def _config(groups, prefix_caching: bool = True, model: str = "/ckpt/GLM-5.3-Flash", tp: int = 4):
    kv = vkv.KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec([f"layers.{i}"], s) for i, s in enumerate(groups)],
    )
    vllm = SimpleNamespace(
        cache_config=SimpleNamespace(
            enable_prefix_caching=prefix_caching,
            cache_dtype="auto",
            mamba_cache_dtype="auto",
            mamba_ssm_cache_dtype="auto",
        ),
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=1, tensor_parallel_size=tp, pipeline_parallel_size=1
        ),
        model_config=SimpleNamespace(
            model=model, revision=None, dtype=torch.bfloat16, served_model_name=None
        ),
    )
    return vllm, kv


@pytest.mark.parametrize(
    ("n", "c", "chunks"),
    [(1, 256, 0), (255, 256, 0), (256, 256, 0), (257, 256, 1), (511, 256, 1), (512, 256, 1),
     (513, 256, 2), (8507, 1152, 7), (2304, 1152, 1), (2305, 1152, 2)],
)
def test_full_hit_resumes_at_previous_chunk(n, c, chunks):
    assert strict_prefix_chunks(n, c) == chunks
    assert strict_prefix_chunks(n, c) * c < n  # never the whole prompt


def test_geometry_skips_scratch_group_and_takes_lcm():
    vllm, kv = _config([_state(), _state(), _attn(1152), _tail()])
    geo = resolve_geometry(vllm, kv)
    assert geo.group_tokens_per_block == (1152, 1152, 1152, 0)
    assert geo.scheduler_block_size == 1152
    assert [g.group_id for g in geo.state_groups] == [0, 1]
    assert [g.group_id for g in geo.attn_groups] == [2]
    # State pages count their content, not the padding vLLM adds to match attention.
    assert geo.state_groups[0].page_bytes == (3 * 512 * 2 + 2 * 128 * 128 * 4,)
    assert geo.with_chunk_size(2304).chunk_size == 2304
    assert "group_tokens_per_block=[1152, 1152, 1152, 0], scheduler_block_size=1152" in (
        geo.with_chunk_size(1152).log_line()
    )
    with pytest.raises(GeometryError):
        geo.with_chunk_size(1000)


def test_mixed_block_spans_use_lcm():
    vllm, kv = _config([_state(384), _attn(128)])
    assert resolve_geometry(vllm, kv).scheduler_block_size == 384


def test_prefix_caching_off_is_refused_naming_the_flag():
    vllm, kv = _config([_state(), _attn()], prefix_caching=False)
    with pytest.raises(GeometryError, match="--enable-prefix-caching"):
        resolve_geometry(vllm, kv)


def test_state_groups_without_align_snapshots_are_refused():
    """Naming the flags that select align mode on the installed vLLM: 0.32 honours
    ``--mamba-cache-mode align``; 0.33 ignores that flag and follows --enable-prefix-caching."""
    vllm, kv = _config([_state(mode="none"), _attn()])
    with pytest.raises(GeometryError, match="without per-block snapshots") as e:
        resolve_geometry(vllm, kv)
    assert f"start vLLM with {align_mode_flags()} " in str(e.value)
    assert ("--mamba-cache-mode align" in str(e.value)) == mamba_cache_mode_flag_honoured()


@pytest.mark.parametrize(
    ("version", "flags"),
    [("0.32.0", "--enable-prefix-caching --mamba-cache-mode align"),
     ("0.32.0+cpu", "--enable-prefix-caching --mamba-cache-mode align"),
     ("0.33.0", "--enable-prefix-caching"),
     ("0.33.1.dev4+g1234abc", "--enable-prefix-caching")],
)
def test_align_mode_flags_per_vllm_version(version, flags):
    assert align_mode_flags(version) == flags


def test_the_flags_named_are_what_the_installed_vllm_does():
    """vLLM 0.33 says so itself: ``--mamba-cache-mode`` "has no effect" there."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    deprecation = getattr(arg_utils, "_MAMBA_CACHE_MODE_DEPRECATION_MESSAGE", "")
    assert mamba_cache_mode_flag_honoured() == ("no effect" not in deprecation)


def test_pipeline_parallel_is_refused_at_start_up():
    """Stages would store their layers' objects under their own ranks while lookups and
    leases name the first stage's: refused, naming the flag, rather than half served."""
    vllm, kv = _config([_state(), _attn()], tp=2)
    vllm.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(GeometryError, match="--pipeline-parallel-size 2"):
        resolve_geometry(vllm, kv)


def test_namespace_fingerprints_model_tp_and_geometry():
    def ns(**kw):
        groups = kw.pop("groups", [_state(), _attn()])
        vllm, kv = _config(groups, **kw)
        return engine_fingerprint(vllm, kv, resolve_geometry(vllm, kv))

    base = ns()
    assert base == ns()
    assert base.startswith("GLM-5.3-Flash-")
    assert ns(tp=2) != base
    assert ns(model="/ckpt/other") != base
    assert ns(groups=[_state(), _attn(), _attn()]) != base
    assert ns(groups=[_state(2304), _attn(2304)]) != base


def test_namespace_fingerprints_the_cache_row_format():
    """Same geometry, other row format (the plugin's pool keys in its rows): another
    namespace, so objects of another format are never loaded. No format (vLLM's own
    models) leaves the fingerprint as it is without one."""
    vllm, kv = _config([_state(), _attn()])
    geo = resolve_geometry(vllm, kv)
    plain = engine_fingerprint(vllm, kv, geo)
    assert engine_fingerprint(vllm, kv, geo, None) == plain == "GLM-5.3-Flash-a89936cf9c8ab564"
    v1 = engine_fingerprint(vllm, kv, geo, "glm5next-plugin-sparse-mla-rows/1")
    v2 = engine_fingerprint(vllm, kv, geo, "glm5next-plugin-sparse-mla-rows/2")
    assert len({plain, v1, v2}) == 3


def test_plugin_model_declares_its_row_format_to_the_connector(tmp_path):
    """The format the connector reads from the engine's model class is the plugin's
    current one (what its sparse-MLA backend writes)."""
    from vllm.config import ModelConfig
    from vllm.plugins import load_general_plugins

    import glm5next_tiny
    from connector.namespace import model_cache_row_format
    from glm5next_plugin.mla_layer import CACHE_ROW_FORMAT, sparse_mla_backend

    load_general_plugins()
    glm5next_tiny.main([str(tmp_path / "ckpt"), "--seed", "3"])
    vllm = SimpleNamespace(model_config=ModelConfig(model=str(tmp_path / "ckpt"), dtype="float32"))
    assert model_cache_row_format(vllm) == CACHE_ROW_FORMAT == sparse_mla_backend(64).cache_row_format
    assert CACHE_ROW_FORMAT.endswith("/2")
    # and the row's parts, which tile the row the layer writes (rope key with the latent)
    from connector.geometry import model_row_parts
    from glm5next_plugin.mla_layer import SparseMLAProjections

    text = vllm.model_config.hf_config.text_config
    parts = model_row_parts(vllm)
    assert parts == (("mla_latent", 32), ("indexer_cache", 32))
    assert sum(v for _, v in parts) == SparseMLAProjections(text).row_size == 64


def test_declared_row_parts_split_each_row_and_must_describe_the_page():
    """A one-row-per-token page (the plugin's) becomes one object group per declared part:
    the part's columns of every row; parts that do not add up to the row refuse the layout
    (fail closed) rather than store a guess."""
    row = vkv.FullAttentionSpec(block_size=1152, num_kv_heads=1, head_size=768, head_size_v=0,
                                dtype=torch.bfloat16)
    vllm, kv = _config([_state(), row])
    geo = resolve_geometry(vllm, kv, row_parts=(("mla_latent", 512), ("indexer_cache", 256)))
    assert [(g.group_id, g.name, g.vllm_group, g.is_state) for g in geo.groups] == [
        (0, "kda_state", 0, True), (1, "mla_latent", 1, False), (2, "indexer_cache", 1, False)]
    latent, indexer = (g.layers[0] for g in geo.attn_groups)
    assert (latent.rows, latent.row_stride, latent.row_offset, latent.page_bytes) == (1152, 1536, 0, 1152 * 1024)
    assert (indexer.rows, indexer.row_stride, indexer.row_offset, indexer.page_bytes) == (1152, 1536, 1024, 1152 * 512)
    assert geo.group_tokens_per_block == (1152, 1152)  # vLLM's groups, as vLLM logs them
    with pytest.raises(UnsupportedLayout, match="declared cache-row parts"):
        resolve_geometry(vllm, kv, row_parts=(("mla_latent", 512), ("indexer_cache", 128)))


def test_unknown_spec_kind_is_refused_naming_group_and_class():
    local = vkv.ChunkedLocalAttentionSpec(
        block_size=1152, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, attention_chunk_size=8192
    )
    vllm, kv = _config([_state(), _attn(), local])
    with pytest.raises(UnsupportedLayout, match=r"KV cache group 2 \(ChunkedLocalAttentionSpec\)"):
        resolve_geometry(vllm, kv)


def test_connector_serves_without_cache_on_unknown_layout(monkeypatch):
    from connector import glm_connector

    logged: list[str] = []
    monkeypatch.setattr(glm_connector.logger, "error", lambda msg, *a: logged.append(msg % a))
    sw = vkv.SlidingWindowSpec(block_size=1152, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                               sliding_window=4096)
    vllm, kv = _config([_state(), _attn(), sw])
    geo, reason = glm_connector.resolve_or_disable(vllm, kv)
    assert not geo.enabled and geo.groups == () and geo.group_tokens_per_block == (0, 0, 0)
    assert reason is not None and "group 2 (SlidingWindowSpec)" in reason
    assert len(logged) == 1 and "serving without the external cache" in logged[0]
    # A fixable misconfiguration still stops vLLM at start-up.
    vllm, kv = _config([_state(), _attn()], prefix_caching=False)
    with pytest.raises(GeometryError, match="--enable-prefix-caching"):
        glm_connector.resolve_or_disable(vllm, kv)
    # A known layout still resolves.
    geo, reason = glm_connector.resolve_or_disable(*_config([_state(), _attn()]))
    assert geo.enabled and reason is None


def test_mla_style_groups_are_replicated_across_tp_and_state_is_not():
    mla = vkv.MLAAttentionSpec(block_size=1152, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    row = vkv.FullAttentionSpec(block_size=1152, num_kv_heads=1, head_size=768, head_size_v=0,
                                dtype=torch.bfloat16)  # the plugin's one-row sparse-MLA spec
    vllm, kv = _config([_state(), mla, row, _attn()])
    geo = resolve_geometry(vllm, kv)
    assert [g.replicated_across_tp for g in geo.groups] == [False, True, True, False]
