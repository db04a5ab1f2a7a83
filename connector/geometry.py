"""Cache geometry: which of vLLM's KV cache groups the external cache holds, and how.

Pure functions over vLLM's resolved ``KVCacheConfig``: no server, no torch tensors. The
connector resolves a ``Geometry`` once at start-up (both roles compute the same one) and
every later decision (strict-prefix lookup, which blocks make a chunk, which state block
a resume reads) is arithmetic on it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class GeometryError(ValueError):
    """The engine is configured in a way the external cache cannot serve."""


@dataclass(frozen=True)
class CacheGroup:
    """One prefix-cacheable vLLM KV cache group as the cache sees it."""

    group_id: int  # index into kv_cache_config.kv_cache_groups
    is_state: bool  # recurrent state (Mamba/GDN/KDA): one snapshot per block position
    block_size: int  # tokens one block of this group spans
    layer_names: tuple[str, ...]
    page_bytes: int  # content bytes of one block of one layer (padding excluded)
    # Identical on every tensor-parallel rank (an MLA latent / indexer cache): stored once,
    # under the first rank of the TP group, and loaded from that copy by every rank.
    replicated_across_tp: bool = False

    @property
    def object_bytes_per_block(self) -> int:
        return self.page_bytes * len(self.layer_names)


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
        return (
            f"Resolved geometry: group_tokens_per_block={list(self.group_tokens_per_block)}, "
            f"scheduler_block_size={self.scheduler_block_size}, chunk_size={self.chunk_size}"
        )


def strict_prefix_chunks(num_tokens: int, chunk_size: int) -> int:
    """Whole chunks a request may resume from: at most ``C * floor((N-1)/C)`` tokens.

    A hit covering all N tokens would restore the recurrent state after token N-1 while
    vLLM recomputes that token to get logits, applying it to the state twice (seed 004).
    Resuming one checkpoint earlier recomputes the suffix instead.
    """
    if num_tokens <= 0:
        return 0
    return (num_tokens - 1) // chunk_size


def _is_replicated_across_tp(spec: Any) -> bool:
    """Attention caches that every TP rank holds in full: MLA latents (vLLM's
    ``MLAAttentionSpec``: one latent row per token, never sharded by head) and any
    latent-only row cache (one KV "head" without a V part, as an MLA-style model plugin
    declares it). K/V caches of sharded heads have a V part and differ per rank."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec):
        return True
    return getattr(spec, "num_kv_heads", None) == 1 and getattr(spec, "head_size_v", None) == 0


def _is_state_spec(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _page_bytes(spec: Any) -> int:
    # Mamba pages are padded up to the attention page; only the state content matters.
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real if real is not None else spec.page_size_bytes)


def _unwrap_uniform(spec: Any) -> Any:
    """A UniformTypeKVCacheSpecs group: take one member spec (all share the type)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return next(iter(inner.values()))
    return spec


def check_engine_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse configurations whose prefixes could not be resumed correctly."""
    cache_config = vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        raise GeometryError(
            "GlmCacheConnector needs vLLM prefix caching: start vLLM with "
            "--enable-prefix-caching (it also selects the align-mode state snapshots "
            "that recurrent layers need)."
        )
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = _unwrap_uniform(group.kv_cache_spec)
        if _is_state_spec(spec) and getattr(spec, "mamba_cache_mode", "none") != "align":
            raise GeometryError(
                f"KV cache group {gid} holds recurrent state without per-block "
                f"snapshots (mamba_cache_mode={spec.mamba_cache_mode!r}); start vLLM "
                "with --enable-prefix-caching --mamba-cache-mode align."
            )


def resolve_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int | None = None
) -> Geometry:
    """Read vLLM's cache groups. ``chunk_size`` None: the scheduler block, until negotiated."""
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size

    check_engine_config(vllm_config, kv_cache_config)
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    cacheable = set(kv_cache_config.prefix_cacheable_group_ids)
    groups: list[CacheGroup] = []
    tokens_per_block: list[int] = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = _unwrap_uniform(group.kv_cache_spec)
        if gid not in cacheable:
            tokens_per_block.append(0)
            continue
        span = int(resolve_dcp_kv_block_size(group.kv_cache_spec, dcp))
        tokens_per_block.append(span)
        groups.append(
            CacheGroup(
                group_id=gid,
                is_state=_is_state_spec(spec),
                block_size=span,
                layer_names=tuple(group.layer_names),
                page_bytes=_page_bytes(spec),
                replicated_across_tp=not _is_state_spec(spec) and _is_replicated_across_tp(spec),
            )
        )
    if not groups:
        raise GeometryError("no prefix-cacheable KV cache group: nothing to cache")
    if not any(not g.is_state for g in groups):
        raise GeometryError("no attention group among the prefix-cacheable groups")
    block = math.lcm(*(g.block_size for g in groups))
    return Geometry(tuple(groups), tuple(tokens_per_block), block, chunk_size or block)


def engine_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, geometry: Geometry
) -> str:
    """Namespace for this engine's cache entries: bytes are only valid for an engine with
    the same model, dtypes, cache group geometry, block sizes and parallel layout. The
    chunk size is left out: it is negotiated per namespace, and keys already depend on it."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    desc = {
        "model": model_config.model,
        "revision": model_config.revision,
        "dtype": str(model_config.dtype),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "mamba_cache_dtype": str(getattr(cache_config, "mamba_cache_dtype", None)),
        "mamba_ssm_cache_dtype": str(getattr(cache_config, "mamba_ssm_cache_dtype", None)),
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", None)),
        "tp": parallel.tensor_parallel_size,
        "pp": parallel.pipeline_parallel_size,
        "dcp": parallel.decode_context_parallel_size,
        "groups": [
            [g.group_id, g.is_state, g.block_size, g.page_bytes, list(g.layer_names)]
            for g in geometry.groups
        ],
        "group_tokens_per_block": list(geometry.group_tokens_per_block),
    }
    digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    name = str(model_config.served_model_name or model_config.model).rstrip("/")
    return f"{name.split('/')[-1]}-{digest}"
