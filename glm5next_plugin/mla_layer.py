"""Sparse MLA layer with its cache in vLLM's paged KV cache.

Cache row per token (one "head", ``kv_lora_rank + qk_rope_head_dim + 2 * index_head_dim``
values), row format :data:`CACHE_ROW_FORMAT`::

    [ MLA latent c (kv_lora_rank) | rope key r (qk_rope_head_dim) | indexer key k (index_head_dim)
      | kpool gate z (index_head_dim) ]

GLM-5.3-Flash has ``qk_rope_head_dim`` 0, so its rows are ``[c | k | z]``. With a rope part,
``r`` is the unnormalized tail of ``kv_a_proj_with_mqa`` (transformers' ``k_rot``, no rotary
embedding in this text model): a key part shared by all heads, scored against each head's
last ``qk_rope_head_dim`` query values; values come from the latent alone.

except that the row of a token closing a pool (position ``i``, ``(i + 1) % kpool == 0``)
holds its pool's key in place of ``z`` (see :mod:`glm5next_plugin.sparse_mla`). New rows
are written through ``slot_mapping``; then each pool the step completed gets its key
from its rows (earlier ones read through the block table). A request's rows are read
back through its block table, so prefix-cached blocks (or blocks a connector loaded) are
used as they are. The cache group is an ordinary full-attention group: each row depends
only on the prefix up to its token, so every block-aligned prefix is self-contained.

Tensor parallel: attention heads are split across ranks (``q_b_proj`` and ``kv_b_proj``
column-parallel by heads, ``o_proj`` row-parallel; its bias, if any, is added on rank 0
only, so the all-reduced sum holds it once). The latent path (``q_a_proj``,
``kv_a_proj_with_mqa`` and their norms) and the whole indexer are replicated: every rank
computes the same cache rows from the same (all-reduced) input with the same weights, so
the rows are the same bytes on every rank and pool selection is the same everywhere. An
external cache can therefore store the MLA group once for all ranks.

FP8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3``): the whole row (latent, rope key,
indexer key and gate / pool key) is stored as float8 e4m3 (``float8_e4m3fn``) bytes, one
byte per value, in a page vLLM allocates as ``uint8`` (its ``STR_DTYPE_TO_TORCH_DTYPE``
convention for fp8 caches), so a token's row takes a quarter of a float32 row's bytes and
half a bfloat16 row's. Rows are written by dividing by the layer's per-tensor scale,
clamping to e4m3's finite range (+-448, as vLLM's fp8 cache kernels saturate) and casting
(:func:`quantize_rows`); every read dequantises to the compute dtype and multiplies by the
scale (:func:`dequantize_rows`), pool keys included: a step's pool keys are computed from
the dequantised rows and stored quantised, so a row's bytes depend only on the bytes
before it, as in bf16. The scale is vLLM's for an uncalibrated fp8 cache, 1.0, unless
the checkpoint carries ``<layer>.self_attn.k_scale`` (one scalar per layer, vLLM's MLA
name), which is then used. ``fp8_e5m2`` and every other quantised format are refused at
start-up with the reason (:func:`kv_cache_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, NoReturn

import torch
from torch import nn

from . import sparse_mla
from .blocks import RMSNorm
from .tp import TP1, Shard, TPInfo, tp_info
from .vllm_layer import register_layer

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend, CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

Fetch = Callable[[torch.Tensor, slice], torch.Tensor]  # (token indices, columns) -> those cache values

# What the bytes of a sparse-MLA cache row mean, part of the external cache's namespace
# (connector.namespace.model_cache_row_format reads it from the model class): any change to the
# row layout takes a new number, so rows written in another layout are never loaded.
# Format 2: [latent | rope key (qk_rope_head_dim, usually none) | k | z] per token, except
# that a pool's closing row holds the pool key in place of its z (format 1, the same rows without stored keys, is what
# validation/bench_pool_keys.py times against).
CACHE_ROW_FORMAT = "glm5next-plugin-sparse-mla-rows/2"

# --kv-cache-dtype values this layer serves; the fp8 ones store float8_e4m3fn bytes.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
SUPPORTED_KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448: quantised values saturate here


def kv_cache_refusal(cache_dtype: str) -> str | None:
    """Why this layer cannot keep its cache in ``cache_dtype`` (vLLM's
    ``--kv-cache-dtype``), or None when it can."""
    if cache_dtype in SUPPORTED_KV_CACHE_DTYPES:
        return None
    if cache_dtype == "fp8_e5m2":
        why = "only the e4m3 fp8 format is implemented (use 'fp8' or 'fp8_e4m3')"
    elif cache_dtype.endswith("_ds_mla"):
        why = ("the packed DeepSeek MLA formats are the native model's FlashMLA layout on CUDA; "
               "this plugin stores plain rows (use 'fp8')")
    else:
        why = "no quantised row format for it is implemented"
    return (f"glm5next plugin: kv cache dtype {cache_dtype!r} is not supported by the sparse-MLA layers: {why}; "
            f"supported: {', '.join(SUPPORTED_KV_CACHE_DTYPES)}")


def quantize_rows(rows: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cache rows as the fp8 page holds them: ``rows / scale`` clamped to e4m3's finite
    range and cast to ``float8_e4m3fn`` (round to nearest even), returned as its bytes
    (``uint8``, the page's dtype), one byte per value."""
    q = rows.float() if scale == 1.0 else rows.float() / scale
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def dequantize_rows(raw: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The values fp8 page bytes ``raw`` (``uint8``) stand for, in ``dtype``."""
    values = raw.view(FP8_DTYPE).to(torch.float32)
    return (values if scale == 1.0 else values * scale).to(dtype)


class Indexer(nn.Module):
    """DSA indexer weights (checkpoint names)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(config.index_kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, config.hidden_size))


class SparseMLAProjections(nn.Module):
    """The sparse-MLA layer's weights and per-sequence math, free of vLLM (this rank's heads)."""

    tp_shards = {"q_b_proj.weight": Shard(0), "kv_b_proj.weight": Shard(0), "o_proj.weight": Shard(1)}

    def __init__(self, config: PretrainedConfig, tp: TPInfo = TP1) -> None:
        super().__init__()
        self.tp = tp
        if not config.index_kpool_always_select_tail:
            raise NotImplementedError("index_kpool_always_select_tail=False is not supported")
        hidden = config.hidden_size
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.v_head_dim = config.v_head_dim
        self.index_topk = config.index_topk
        self.kpool = config.index_kpool
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.indexer = Indexer(config)
        self.key_size = config.kv_lora_rank + self.rope_dim  # latent and rope key: what attention reads
        self.row_size = self.key_size + 2 * config.index_head_dim
        self.index_cols = slice(self.key_size, self.row_size)  # k and z
        self.pool_key_cols = slice(self.key_size + config.index_head_dim, self.row_size)  # z / pool key
        # Per-tensor scale of an fp8 cache (module docstring): 1.0, or the checkpoint's
        # ``self_attn.k_scale``; unused with an unquantised cache.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def cache_rows(self, x: torch.Tensor) -> torch.Tensor:
        """What each new token leaves in the cache: ``[T, row_size]``."""
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # the rope key part is not normalized
        ix = self.indexer
        k = ix.k_norm(ix.wk(x))
        z = torch.nn.functional.linear(x, ix.index_kpool_compress_gate)
        return torch.cat([latent, rope_key.to(latent.dtype), k.to(latent.dtype), z.to(latent.dtype)], dim=-1)

    def pool_keys_at(self, closing: torch.Tensor, fetch: Fetch, dtype: torch.dtype) -> torch.Tensor:
        """Keys ``[P, index_head_dim]`` of the pools closed at positions ``closing`` ``[P]``,
        from their ``kpool`` rows' raw ``k`` and ``z`` read through ``fetch(idx, cols)``
        (rows not yet holding a pool key: every row of a pool but its closing one, and the
        closing row as written this step)."""
        ix = self.indexer
        idx = closing[:, None] + torch.arange(1 - self.kpool, 1, device=closing.device)  # [P, kpool]
        cols = fetch(idx.reshape(-1), self.index_cols).to(dtype)
        keys, gates = cols.split([ix.head_dim, ix.head_dim], dim=-1)
        return sparse_mla.pool_keys(keys, gates, ix.index_kpool_compress_ape)

    def close_pools(self, rows: torch.Tensor) -> torch.Tensor:
        """A whole sequence's rows as the cache holds them: ``rows`` ``[S, row_size]`` from
        :meth:`cache_rows` (position 0 first) with each complete pool's key stored in its
        closing row (standalone use, tests and tools; the paged path does it per step)."""
        closing = sparse_mla.closing_positions(0, rows.shape[0], self.kpool, rows.device)
        out = rows.clone()
        keys = self.pool_keys_at(closing, lambda idx, cols: rows[idx, cols], rows.dtype)
        out[closing, self.pool_key_cols] = keys.to(rows.dtype)
        return out

    def attend(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Queries ``x`` ``[T, hidden]`` at ``positions`` over the sequence's cached ``rows``
        ``[S, row_size]`` in cache format (:meth:`close_pools`; the queries' own rows included)."""
        return self.attend_rows(x, positions, rows.shape[0], lambda idx, cols: rows[idx, cols])

    def attend_rows(self, x: torch.Tensor, positions: torch.Tensor, seq_len: int, fetch: Fetch) -> torch.Tensor:
        """Sparse absorbed attention of ``x`` ``[T, hidden]`` at ``positions`` over a sequence
        of ``seq_len`` cached rows (pool keys stored) read through
        ``fetch(token_indices, column_slice)``.

        Only the stored key of each complete pool and the latents (and rope keys) of the
        chosen tokens are read; ``kv_b_proj`` is never applied to cached rows (see
        :mod:`.sparse_mla`)."""
        t = x.shape[0]
        ix = self.indexer
        r = self.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.qk_head_dim)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, r)
        w_k, w_v = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, Dn, R], [H, Dv, R]

        closing = sparse_mla.closing_positions(0, seq_len, self.kpool, x.device)
        pooled = fetch(closing, self.pool_key_cols).to(x.dtype)  # [P, Dk]
        index_q = ix.wq_b(q_resid).view(t, ix.n_heads, ix.head_dim)
        head_w = ix.weights_proj(x).float() * ix.n_heads**-0.5
        out = sparse_mla.sparse_mla_absorbed(
            q, w_k, w_v, index_q, head_w, pooled, positions, self.kpool, self.index_topk,
            lambda idx: fetch(idx, slice(0, self.key_size)),
        )
        return self.project_out(out.reshape(t, -1))

    def attend_dense(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The dense-masked formulation (every row expanded through ``kv_b_proj``, a
        ``[T, S]`` mask, full logits): the reference :meth:`attend` is tested against."""
        t = x.shape[0]
        s = rows.shape[0]
        ix = self.indexer
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.qk_head_dim)
        latent, rope_key = rows[:, : self.key_size].split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(s, self.num_heads, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, rope_key[:, None, :].expand(s, self.num_heads, self.rope_dim)], dim=-1)
        index_q = ix.wq_b(q_resid).view(t, ix.n_heads, ix.head_dim)
        head_w = ix.weights_proj(x).float() * ix.n_heads**-0.5
        pooled = rows[sparse_mla.closing_positions(0, s, self.kpool, rows.device), self.pool_key_cols]
        mask = sparse_mla.select_tokens(index_q, head_w, pooled, positions, s, self.kpool, self.index_topk)
        out = sparse_mla.masked_attention(q, k, v, mask, self.qk_head_dim**-0.5)
        return self.project_out(out.reshape(t, -1))

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Row-parallel ``o_proj``: this rank's share of the output (the bias on rank 0 only)."""
        bias = self.o_proj.bias if self.tp.rank == 0 else None
        return torch.nn.functional.linear(out, self.o_proj.weight, bias)

    def forward_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """A whole fresh sequence (standalone use and tests)."""
        return self.attend(x, self.close_pools(self.cache_rows(x)), torch.arange(x.shape[0], device=x.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Standalone: ``x`` is one whole fresh sequence."""
        return self.forward_sequence(x)

    def cache_codec(self, cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> tuple[
            Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        """(store, load): values to a cache of ``cache_dtype``'s elements and back to
        ``compute_dtype``. A ``uint8`` cache holds fp8 e4m3 bytes (:func:`quantize_rows`,
        :func:`dequantize_rows` with this layer's ``k_scale``); any other is the values
        cast to its dtype, read as they are."""
        if cache_dtype == torch.uint8:
            scale = float(self.k_scale)
            return (lambda v: quantize_rows(v, scale)), (lambda raw: dequantize_rows(raw, compute_dtype, scale))
        return (lambda v: v.to(cache_dtype)), (lambda raw: raw)

    def forward_paged(self, x: torch.Tensor, cache: torch.Tensor, md: SparseMLAMetadata) -> torch.Tensor:
        """One step of a batch over a paged ``cache`` ``[num_blocks, block_size, row_size]``:
        write the step's rows, store the keys of the pools they complete, attend. A
        ``uint8`` cache holds fp8 rows (module docstring): written quantised, read
        dequantised to ``x``'s dtype."""
        bs = cache.shape[1]
        n = md.num_actual_tokens
        store, load = self.cache_codec(cache.dtype, x.dtype)
        rows = store(self.cache_rows(x[:n]))
        slots = md.slot_mapping.long()
        ok = slots >= 0
        cache[slots[ok] // bs, slots[ok] % bs] = rows[ok]
        out = torch.zeros_like(x)
        for i in range(md.num_reqs):
            start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
            if end == start:
                continue
            seq_len = md.seq_lens[i]
            row = md.block_table[i].long()

            def fetch(idx: torch.Tensor, cols: slice, row: torch.Tensor = row) -> torch.Tensor:
                # only the requested tokens and columns leave the paged cache
                return load(cache[row[idx // bs], idx % bs, cols])

            first = seq_len - (end - start)
            closing = sparse_mla.closing_positions(first, seq_len, self.kpool, x.device)
            if closing.numel():
                # pools this step completed (their first rows may come from earlier steps)
                keys = self.pool_keys_at(closing, fetch, x.dtype)
                cache[row[closing // bs], closing % bs, self.pool_key_cols] = store(keys)
            positions = torch.arange(first, seq_len, device=x.device)
            out[start:end] = self.attend_rows(x[start:end], positions, seq_len, fetch)
        return out


@dataclass
class SparseMLAMetadata:
    """Per-step batch layout, as this layer reads it (lists on the host, tensors on the device)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_tokens]
    num_reqs: int
    num_actual_tokens: int


def _backend_class() -> type[AttentionBackend]:
    """Build the backend class lazily so importing the plugin does not import vLLM."""
    from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, MultipleOf

    class SparseMLAMetadataBuilder(AttentionMetadataBuilder[SparseMLAMetadata]):
        def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                     device: torch.device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False) -> SparseMLAMetadata:
            m = common_attn_metadata
            return SparseMLAMetadata(
                query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
                seq_lens=m.seq_lens[: m.num_reqs].cpu().tolist(),
                block_table=m.block_table_tensor[: m.num_reqs],
                slot_mapping=m.slot_mapping[: m.num_actual_tokens],
                num_reqs=m.num_reqs,
                num_actual_tokens=m.num_actual_tokens,
            )

    class SparseMLATorchBackend(AttentionBackend):
        """Plain-PyTorch sparse MLA over vLLM's paged cache (any device torch runs on)."""

        supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
        supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: object = None) -> list[int | MultipleOf]:
            return [MultipleOf(16)]

        @staticmethod
        def get_name() -> str:
            return "GLM5NEXT_SPARSE_MLA_TORCH"

        @staticmethod
        def get_impl_cls() -> NoReturn:
            raise NotImplementedError("the layer computes attention itself")

        @staticmethod
        def get_builder_cls() -> type[SparseMLAMetadataBuilder]:
            return SparseMLAMetadataBuilder

        @classmethod
        def is_mla(cls) -> bool:
            return True

        # The cache row of one token, in values; set on the per-geometry subclass.
        row_size: ClassVar[int] = 0
        # What the row's bytes mean (see CACHE_ROW_FORMAT).
        cache_row_format: ClassVar[str] = CACHE_ROW_FORMAT

        @classmethod
        def customize_spec(cls, spec: FullAttentionSpec) -> FullAttentionSpec:
            """vLLM sizes the hybrid unified block from the attention page a backend
            reports here (``Platform._align_hybrid_block_size``), starting from a dense
            K/V spec built from the model config. Our page is one row per token, nothing
            else, so the block and the KDA state padding follow the real row."""
            return replace(spec, num_kv_heads=1, head_size=cls.row_size, head_size_v=0, page_size_padded=None)

    return SparseMLATorchBackend


_BASE_BACKEND = None
_BACKENDS: dict[int, type] = {}


def sparse_mla_backend(row_size: int) -> type[AttentionBackend]:
    """The attention backend class of :class:`SparseMLALayer` for rows of ``row_size``
    values (one class per geometry, so ``customize_spec`` knows the row)."""
    global _BASE_BACKEND
    if _BASE_BACKEND is None:
        _BASE_BACKEND = _backend_class()
    if row_size not in _BACKENDS:
        _BACKENDS[row_size] = type(f"SparseMLATorchBackend{row_size}", (_BASE_BACKEND,), {"row_size": row_size})
    return _BACKENDS[row_size]


def _quant_mode(cache_dtype: str) -> dict[str, object]:
    """``kv_quant_mode`` as vLLM's block alignment puts it in the spec it sizes pages from
    (a ``FullAttentionSpec`` field in vLLM 0.32; left out where the installed vLLM has none)."""
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not any(f.name == "kv_quant_mode" for f in fields(FullAttentionSpec)):
        return {}
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    return {"kv_quant_mode": get_kv_quant_mode(cache_dtype)}


def _attention_layer_base() -> type:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return AttentionLayerBase


class SparseMLALayer(SparseMLAProjections, _attention_layer_base()):
    """Sparse MLA with its rows in vLLM's paged cache (registered in the forward context)."""

    def __init__(self, config: PretrainedConfig, vllm_config: VllmConfig, prefix: str, tp: TPInfo | None = None) -> None:
        # ``tp`` given: this rank's place without asking vLLM's process groups (a layer
        # built only for its cache spec, e.g. by testing/glm_flash_kv_layouts.py).
        super().__init__(config, tp or tp_info(vllm_config))
        self.prefix = prefix
        self.vllm_config = vllm_config
        self.kv_cache = torch.tensor([])
        register_layer(self, vllm_config, prefix)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return sparse_mla_backend(self.row_size)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        cache_dtype = str(cache_config.cache_dtype)
        refusal = kv_cache_refusal(cache_dtype)
        if refusal is not None:
            raise NotImplementedError(refusal)
        # One "head" holding the whole per-token row, no separate V: the same spec the
        # backend reported to vLLM's block-size alignment (customize_spec), from the cache
        # dtype that alignment starts from (Platform._align_hybrid_block_size): the
        # model's dtype for 'auto', uint8 (one byte a value) for fp8.
        fp8 = cache_dtype in FP8_KV_CACHE_DTYPES
        spec = self.get_attn_backend().customize_spec(
            FullAttentionSpec(block_size=cache_config.block_size, num_kv_heads=1, head_size=1,
                              dtype=torch.uint8 if fp8 else model_config.dtype, **_quant_mode(cache_dtype))
        )
        state_page = cache_config.mamba_page_size_padded or 0
        if spec.page_size_bytes < state_page:
            # vLLM pads the state page up to the attention page it computed; a larger
            # state page means it sized the block from something other than our row.
            raise RuntimeError(
                f"glm5next plugin: sparse-MLA page {spec.page_size_bytes} B (block {cache_config.block_size} x "
                f"{self.row_size} values) is smaller than the padded KDA state page {state_page} B; vLLM did not "
                "size the unified block from this backend's rows"
            )
        return spec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return self.forward_sequence(x)
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # profiling / dummy run
            return torch.zeros_like(x)
        md: SparseMLAMetadata = metadata[self.prefix]
        return self.forward_paged(x, self.kv_cache[:, 0], md)  # cache [num_blocks, block_size, row_size]
