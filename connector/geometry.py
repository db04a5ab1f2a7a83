"""Cache geometry: which of vLLM's KV cache groups the external cache holds, and how.

Pure functions over vLLM's resolved ``KVCacheConfig``: no server, no torch tensors. The
connector resolves a ``Geometry`` once at start-up (both roles compute the same one) and
every later decision (strict-prefix lookup, which blocks make a chunk, which state block
a resume reads) is arithmetic on it.

The server stores *object groups*, one object per chunk (and rank, where sharded) each:
the recurrent (KDA) state, the MLA latent and the indexer cache apart, whatever vLLM packs
into one KV cache group. A vLLM group whose layers are of several kinds (native GLM-5.3:
the kpool indexer's pages and the latent's pages alternate in one block table) becomes one
object group per kind; a cache row holding several parts (the plugin's row: latent, then
indexer key and pool gate) becomes one object group per part, read column by column, when
the model declares its row's parts (:data:`RowParts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class GeometryError(ValueError):
    """The engine is configured in a way the external cache cannot serve."""


class UnsupportedLayout(GeometryError):
    """vLLM handed us a cache layout we do not understand.

    Unlike :class:`GeometryError` proper (prefix caching off, no align-mode snapshots:
    one flag fixes it), the operator cannot change this one, so the connector serves
    without the external cache instead of refusing to start (fail closed, never guess)."""


# Object group names: what the bytes are (``/status``, metrics and logs name groups so).
STATE, LATENT, INDEXER, ATTENTION = "kda_state", "mla_latent", "indexer_cache", "attention"

# The parts of a model's cache row, in row order: ``(object group name, values)``. Declared
# by a model whose one attention layer keeps several things per token in one row (the
# plugin: ``((LATENT, kv_lora_rank + qk_rope_head_dim), (INDEXER, 2 * index_head_dim))``).
RowParts = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class LayerPage:
    """What one object takes from one layer's page in one block, as vLLM's own spec for
    that layer sizes the page.

    A group can hold layers with different pages (vLLM's ``UniformTypeKVCacheSpecs``
    packs the MLA latent and the kpool indexer into one block table), so every layer
    carries its own size: reading one layer's size for all of them saves the wrong
    bytes and overwrites neighbouring pages on load. An object of one part of a row
    takes ``row_width`` bytes at ``row_offset`` of each of the page's ``rows`` rows
    (``row_stride`` bytes apart); an object of whole pages takes the page (one row)."""

    name: str
    page_bytes: int  # content bytes this object takes from the page in one block (padding excluded)
    dtype: str  # element type(s) of the page, for logs and the namespace fingerprint
    tokens_per_page: int  # tokens one block of this layer spans
    states_per_page: int  # stored rows per block: tokens / tokens_per_state; 1 for state
    spec: str  # vLLM spec class name
    rows: int = 1  # rows of the page this object reads a part of; 1: the whole page
    row_stride: int = 0  # bytes from one row of the page to the next (rows > 1)
    row_offset: int = 0  # bytes before this object's part in each row

    @property
    def row_width(self) -> int:
        """Bytes this object takes from each row."""
        return self.page_bytes // self.rows

    @property
    def page_extent(self) -> int:
        """Bytes of the page this object's parts lie in, from the page's first byte."""
        return self.page_bytes if self.rows == 1 else self.rows * self.row_stride


@dataclass(frozen=True)
class CacheGroup:
    """One object group: what one object per chunk (and rank) holds, from one
    prefix-cacheable vLLM KV cache group."""

    group_id: int  # the object group (the server's group of its objects)
    is_state: bool  # recurrent state (Mamba/GDN/KDA): one snapshot per block position
    block_size: int  # tokens one block of this group spans
    layers: tuple[LayerPage, ...]  # vLLM's layer order in the group
    # Identical bytes on every TP rank (MLA latent / indexer): such objects need not be
    # stored once per rank. Informational here; keys are the connector's business.
    replicated_across_tp: bool = False
    kv_group: int | None = None  # vLLM's KV cache group whose blocks it reads; None: group_id
    name: str = ""  # STATE, LATENT, INDEXER or ATTENTION

    @property
    def vllm_group(self) -> int:
        """Index into ``kv_cache_config.kv_cache_groups`` (the block ids' group)."""
        return self.group_id if self.kv_group is None else self.kv_group

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.layers)

    @property
    def page_bytes(self) -> tuple[int, ...]:
        """Each layer's page, in layer order."""
        return tuple(p.page_bytes for p in self.layers)

    @cached_property  # asked per object of every load and save
    def object_bytes_per_block(self) -> int:
        return sum(p.page_bytes for p in self.layers)

    def object_bytes(self, num_blocks: int) -> int:
        """Bytes of a cache object covering ``num_blocks`` blocks of this group."""
        return self.object_bytes_per_block * num_blocks


@dataclass(frozen=True)
class Geometry:
    """Resolved cache geometry of one engine (one TP/PP rank layout)."""

    groups: tuple[CacheGroup, ...]  # prefix-cacheable groups, vLLM order
    group_tokens_per_block: tuple[int, ...]  # every vLLM group; 0 = not cached
    scheduler_block_size: int  # lcm of the cached groups' block spans
    chunk_size: int  # negotiated with the server; a multiple of scheduler_block_size

    @property
    def attn_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if not g.is_state)

    @property
    def state_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.is_state)

    @property
    def enabled(self) -> bool:
        """False for the empty geometry of an engine served without the external cache."""
        return bool(self.groups)

    def group(self, group_id: int) -> CacheGroup:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"KV cache group {group_id} is not cached")

    def state_group_of(self, vllm_group: int) -> CacheGroup | None:
        """The state object group reading vLLM group ``vllm_group``'s blocks, if any."""
        for g in self.state_groups:
            if g.vllm_group == vllm_group:
                return g
        return None

    def with_chunk_size(self, chunk_size: int) -> Geometry:
        if chunk_size <= 0 or chunk_size % self.scheduler_block_size:
            raise GeometryError(
                f"chunk size {chunk_size} is not a multiple of the scheduler block "
                f"size {self.scheduler_block_size}"
            )
        return Geometry(
            self.groups, self.group_tokens_per_block, self.scheduler_block_size, chunk_size
        )

    def log_line(self) -> str:
        pages = {
            g.group_id: sorted({p.page_bytes for p in g.layers}) for g in self.groups
        }
        names = {g.group_id: g.name for g in self.groups}
        return (
            f"Resolved geometry: group_tokens_per_block={list(self.group_tokens_per_block)}, "
            f"scheduler_block_size={self.scheduler_block_size}, chunk_size={self.chunk_size}, "
            f"object_groups={names}, page_bytes_per_group={pages}"
        )


def disabled_geometry(kv_cache_config: KVCacheConfig) -> Geometry:
    """The geometry of an engine served without the external cache: nothing cached."""
    n = len(kv_cache_config.kv_cache_groups)
    return Geometry((), (0,) * n, 1, 1)


def strict_prefix_chunks(num_tokens: int, chunk_size: int) -> int:
    """Whole chunks a request may resume from: at most ``C * floor((N-1)/C)`` tokens.

    A hit covering all N tokens would restore the recurrent state after token N-1 while
    vLLM recomputes that token to get logits, applying it to the state twice.
    Resuming one checkpoint earlier recomputes the suffix instead.
    """
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // chunk_size


def _layer_specs(group: Any) -> list[tuple[str, Any]]:
    """(layer name, that layer's own spec) for every layer of a vLLM group."""
    inner = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if isinstance(inner, dict):
        return [(name, inner[name]) for name in group.layer_names]
    return [(name, group.kv_cache_spec) for name in group.layer_names]


def _refuse(gid: int, spec: Any, reason: str) -> UnsupportedLayout:
    return UnsupportedLayout(
        f"KV cache group {gid} ({type(spec).__name__}) is not cacheable: {reason}"
    )


def _layer_reason(spec: Any) -> str | None:
    """Why the connector cannot hold this layer's pages as opaque bytes per block, or
    None when it can. An allow-list: a spec kind we have not reasoned about is refused.

    Understood: full attention (one page per block, every token of the block in it,
    incl. MLA and compressed ``tokens_per_state`` caches such as the kpool indexer) and
    align-mode recurrent state (one snapshot per block position). Everything else
    recycles or skips blocks (sliding window, chunked local, sinks, R-SWA), lives outside
    the block pool (HiSparse), or is not per-token context (encoder/cross/hidden states).
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
    )

    if isinstance(spec, MambaSpec):
        if type(spec) is not MambaSpec:
            return f"unknown recurrent-state spec subclass {type(spec).__name__}"
        return None
    if isinstance(spec, (HiddenStateCacheSpec, SinkFullAttentionSpec, RSWASpec)):
        return "its blocks do not hold plain per-token context"
    if not isinstance(spec, FullAttentionSpec):
        return "only full-attention and recurrent-state groups have a stable block layout"
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return f"unknown attention spec subclass {type(spec).__name__}"
    if spec.sliding_window is not None or spec.attention_chunk_size is not None:
        return "local attention layers whose early blocks vLLM may drop"
    tps = spec.tokens_per_state
    if tps != int(tps) or int(tps) < 1 or spec.block_size % int(tps):
        return f"tokens_per_state={tps} does not divide the block of {spec.block_size} tokens"
    if spec.real_page_size_bytes <= 0:
        return "empty page"
    return None


def _dtype_name(spec: Any) -> str:
    dtypes = getattr(spec, "dtypes", None)
    if dtypes is not None:
        return ",".join(str(d).removeprefix("torch.") for d in dtypes)
    return str(spec.dtype).removeprefix("torch.")


def _layer_page(name: str, spec: Any, span: int) -> LayerPage:
    from vllm.v1.kv_cache_interface import MambaSpec

    is_state = isinstance(spec, MambaSpec)
    # Pages are padded (state pages up to the attention page, MLA pages to an alignment);
    # the content is the unpadded prefix of the page and only the content is cached.
    return LayerPage(
        name=name,
        page_bytes=int(spec.real_page_size_bytes),
        dtype=_dtype_name(spec),
        tokens_per_page=span,
        states_per_page=1 if is_state else int(spec.num_states),
        spec=type(spec).__name__,
    )


def _replicated_across_tp(spec: Any, tp_size: int) -> bool:
    """Whether every TP rank holds identical bytes for this layer.

    vLLM says so itself for MLA (``MLAAttentionSpec``: one latent row per token, built
    from replicated projections; ``max_tp_shards=1``) and for replicated recurrent state
    (``MambaSpec.tp_replicated``). The plugin's sparse MLA reports a plain
    ``FullAttentionSpec`` (no ``max_tp_shards``), recognised by its shape instead: one
    head and no V half (``head_size_v == 0``). A sharded K/V cache always has a V half,
    and a K-only single-row cache is an MLA-style latent, the same on every rank; we
    recognise the shape rather than import the plugin, so the connector stays
    model-agnostic.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    del tp_size  # a property of the layer kind, the same flag at every TP size
    if isinstance(spec, MambaSpec):
        return bool(spec.tp_replicated)
    if isinstance(spec, MLAAttentionSpec):
        return True
    max_shards = getattr(spec, "max_tp_shards", None)
    if max_shards is not None:
        return max_shards == 1
    return isinstance(spec, FullAttentionSpec) and spec.num_kv_heads == 1 and spec.head_size_v == 0


def check_engine_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse configurations whose prefixes could not be resumed correctly.

    These raise plain :class:`GeometryError` and stop vLLM at start-up on purpose: the
    operator asked for the external cache, and one flag makes it work."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        raise GeometryError(
            "GlmCacheConnector needs vLLM prefix caching: start vLLM with "
            "--enable-prefix-caching (it also selects the align-mode state snapshots "
            "that recurrent layers need)."
        )
    pp = getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1)
    if pp > 1:
        # Each stage would store its layers' objects under its own ranks while lookups
        # and leases name the first stage's: hits would be claimed for objects nobody checked.
        raise GeometryError(
            f"GlmCacheConnector does not support pipeline parallelism (--pipeline-parallel-size {pp}); "
            "use --tensor-parallel-size, or serve without --kv-transfer-config."
        )
    from vllm.v1.kv_cache_interface import MambaSpec

    from connector.vllm_compat import align_mode_flags

    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        for _, spec in _layer_specs(group):
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode != "align":
                raise GeometryError(
                    f"KV cache group {gid} holds recurrent state without per-block "
                    f"snapshots (mamba_cache_mode={spec.mamba_cache_mode!r}); start vLLM "
                    f"with {align_mode_flags()} (the flags that select align mode on this vLLM)."
                )


def _layer_kind(spec: Any) -> str:
    """The object group a whole page of this layer belongs to."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    if isinstance(spec, MambaSpec):
        return STATE
    if isinstance(spec, MLAAttentionSpec):
        role = getattr(spec, "cache_role", None)  # SparseCacheRole: "sparse" or "indexer"
        return INDEXER if getattr(role, "value", role) == "indexer" else LATENT
    return ATTENTION


def _row_split(name: str, spec: Any, parts: RowParts) -> list[tuple[str, LayerPage]] | None:
    """The layer's page as one object part per row part, or None when the declared parts
    do not describe this layer (not a one-row-per-token page of exactly their width)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    if isinstance(spec, MambaSpec) or not isinstance(spec, FullAttentionSpec):
        return None
    if spec.num_kv_heads != 1 or spec.head_size_v != 0 or spec.head_size != sum(v for _, v in parts):
        return None
    item = spec.real_page_size_bytes // (spec.block_size * spec.head_size)
    if item * spec.block_size * spec.head_size != spec.real_page_size_bytes or int(spec.tokens_per_state) != 1:
        return None
    whole = _layer_page(name, spec, spec.block_size)
    out, offset = [], 0
    for kind, values in parts:
        out.append((kind, replace(whole, page_bytes=spec.block_size * values * item, rows=spec.block_size,
                                  row_stride=spec.head_size * item, row_offset=offset * item)))
        offset += values
    return out


def _resolve_group(gid: int, group: Any, dcp: int, tp: int, row_parts: RowParts | None,
                   first_id: int) -> list[CacheGroup]:
    """One prefix-cacheable vLLM group as its object groups (ids from ``first_id``, in the
    order their kinds first appear among its layers), or :class:`UnsupportedLayout`
    naming why not.

    Recurrent state: vLLM (align mode) keeps the snapshot after position ``p`` (a multiple
    of the block) in block ``p // block - 1`` of the state group, and a resumed request
    reads its initial state from there (``preprocess_mamba``,
    vllm/v1/worker/mamba_utils.py:1495). Native KDA's prefill checkpoint blocks
    (``num_prefill_checkpoint_blocks``) land in the same place for block-aligned
    positions: the checkpoint column is ``cdiv(end, block) - 2``
    (vllm/model_executor/layers/mamba/checkpoint.py:57,
    vllm/v1/core/single_type_kv_cache_manager.py:1749), which is ``p // block - 1``
    whenever the checkpoint position ``p`` is block aligned; non-aligned checkpoints are
    cached as partial blocks, never on our chunk grid. So those layouts are accepted.
    """
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from vllm.v1.kv_cache_interface import MambaSpec

    layer_specs = _layer_specs(group)
    if not layer_specs:
        raise _refuse(gid, group.kv_cache_spec, "no layers on this rank")
    span = int(resolve_dcp_kv_block_size(group.kv_cache_spec, dcp))
    parts: dict[str, list[LayerPage]] = {}  # object group name -> its pages, layer order
    replicated: dict[str, bool] = {}
    kinds: set[bool] = set()
    for name, spec in layer_specs:
        reason = _layer_reason(spec)
        if reason is not None:
            raise _refuse(gid, spec, f"layer {name}: {reason}")
        if int(resolve_dcp_kv_block_size(spec, dcp)) != span:
            raise _refuse(gid, spec, f"layer {name} spans a different block than its group")
        kinds.add(isinstance(spec, MambaSpec))
        split = _row_split(name, spec, row_parts) if row_parts and not isinstance(spec, MambaSpec) else None
        if row_parts and not isinstance(spec, MambaSpec) and split is None:
            raise _refuse(gid, spec, f"layer {name}: the model's declared cache-row parts {list(row_parts)} "
                                     "do not describe its page")
        for kind, page in split or [(_layer_kind(spec), _layer_page(name, spec, span))]:
            parts.setdefault(kind, []).append(page)
            replicated[kind] = replicated.get(kind, True) and _replicated_across_tp(spec, tp)
    if len(kinds) > 1:
        raise _refuse(gid, group.kv_cache_spec, "it mixes recurrent state and attention layers")
    is_state = kinds.pop()
    return [
        CacheGroup(group_id=first_id + i, is_state=is_state, block_size=span, layers=tuple(pages),
                   replicated_across_tp=replicated[kind], kv_group=gid, name=kind)
        for i, (kind, pages) in enumerate(parts.items())
    ]


def resolve_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int | None = None,
    row_parts: RowParts | None = None,
) -> Geometry:
    """Read vLLM's cache groups. ``chunk_size`` None: the scheduler block, until negotiated.
    ``row_parts``: the model's cache-row parts (:func:`model_row_parts`), None if it
    declares none (each layer's page is then one part, named by its spec).

    Raises :class:`GeometryError` for fixable misconfigurations and its subclass
    :class:`UnsupportedLayout` for layouts the connector does not understand. Groups
    that are not prefix-cacheable (scratch such as the kpool tail ring) are skipped.
    """
    check_engine_config(vllm_config, kv_cache_config)
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    tp = parallel.tensor_parallel_size
    cacheable = set(kv_cache_config.prefix_cacheable_group_ids)
    groups: list[CacheGroup] = []
    tokens_per_block: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if gid not in cacheable:
            tokens_per_block.append(0)
            continue
        object_groups = _resolve_group(gid, group, dcp, tp, row_parts, len(groups))
        tokens_per_block.append(object_groups[0].block_size)
        groups.extend(object_groups)
    if not groups:
        raise UnsupportedLayout("no prefix-cacheable KV cache group: nothing to cache")
    if not any(not g.is_state for g in groups):
        raise UnsupportedLayout("no attention group among the prefix-cacheable groups")
    block = math.lcm(*(g.block_size for g in groups))
    return Geometry(tuple(groups), tuple(tokens_per_block), block, chunk_size or block)


def model_row_parts(vllm_config: VllmConfig) -> RowParts | None:
    """The cache-row parts the engine's model class declares (classmethod
    ``kv_cache_row_parts(hf_config)``), or None when it declares none (vLLM's own models,
    whose layers keep one thing per page). Read from the class vLLM resolves for the model
    config, as :func:`connector.namespace.model_cache_row_format` reads the row format."""
    from vllm.model_executor.model_loader.utils import get_model_cls

    declare = getattr(get_model_cls(vllm_config.model_config), "kv_cache_row_parts", None)
    if declare is None:
        return None
    return tuple((str(name), int(values)) for name, values in declare(vllm_config.model_config.hf_config))
