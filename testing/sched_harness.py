"""A connector scheduler side without an engine, for tests and benchmarks: hand-built vLLM
configs (the shapes vLLM hands the connector), real ``vllm.v1.request.Request`` objects."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


@cache
def weights_dir() -> Path:
    """A model directory with one small safetensors file (the connector names the weights
    by their content), removed when the process exits."""
    from safetensors.torch import save_file

    path = Path(tempfile.mkdtemp(prefix="glm-sched-weights-"))
    atexit.register(shutil.rmtree, path, True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / "model.safetensors"))
    return path


def scheduler_side(url: str, *, block: int = 256, tp: int = 1, timeout_s: float = 1.0,
                   retry_after_s: float = 1.0, hash_algo: str = "sha256", latent_rows: bool = False,
                   chunk_keys: str = "auto", hash_block: int | None = None, speculative: Any = None,
                   save_decode: bool = False, multimodal: dict[str, Any] | None = None,
                   trust_media_ids: bool = False, load_format: str = "auto", numerics: str | None = None,
                   retention: int | None = None, architectures: tuple[str, ...] | None = None):
    """A :class:`connector.scheduler.SchedulerSide` for one state group and one attention
    group of ``block`` tokens, TP ``tp``, talking to the server at ``url``; ``hash_algo`` is
    vLLM's ``--prefix-caching-hash-algo``. ``latent_rows``: the attention group has the
    sparse-MLA plugin's shape (one K-only row per token, the same bytes on every rank), so
    it is stored once for all ranks, as GLM-5.3-Flash's is. ``chunk_keys``: the connector's
    setting of that name; ``hash_block``: the tokens per vLLM block hash (default ``block``);
    ``speculative``: vLLM's ``speculative_config`` (None: drafts off; :func:`drafts` makes
    one); ``save_decode``, ``trust_media_ids``: the connector's settings of those names;
    ``multimodal``: the model takes images, with these ``multimodal_config`` fields
    (``mm_hasher_algorithm``, ``mm_processor_kwargs``); ``load_format``: vLLM's
    ``--load-format``; ``numerics``: the model code's numerics version
    (``connector.namespace.model_numerics_version``); ``retention``: vLLM's
    ``--prefix-cache-retention-interval`` (None: dense); ``architectures``: the model
    config's (None: no ``hf_config``)."""
    from vllm.v1 import kv_cache_interface as vkv

    from connector.config import Settings
    from connector.geometry import resolve_geometry
    from connector.scheduler import SchedulerSide

    state = vkv.MambaSpec(block_size=block, shapes=((3, 64), (2, 16, 16)),
                          dtypes=(torch.float32, torch.float32), mamba_cache_mode="align")
    attn = vkv.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                 **({"head_size_v": 0} if latent_rows else {}))
    kv = vkv.KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[],
        kv_cache_groups=[vkv.KVCacheGroupSpec(["layers.0"], state), vkv.KVCacheGroupSpec(["layers.1"], attn)],
        prefix_cache_retention_interval=retention,
    )
    vllm = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True, cache_dtype="auto", mamba_cache_dtype="auto",
                                     mamba_ssm_cache_dtype="auto", block_size=block, mamba_block_size=block,
                                     prefix_caching_hash_algo=hash_algo),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=tp,
                                        pipeline_parallel_size=1),
        model_config=SimpleNamespace(model=str(weights_dir()), revision=None, dtype=torch.float32,
                                     served_model_name="tiny-sched", is_multimodal_model=multimodal is not None,
                                     multimodal_config=None if multimodal is None else SimpleNamespace(
                                         **{"mm_hasher_algorithm": "blake3", "mm_processor_kwargs": None,
                                            **multimodal}),
                                     **({} if architectures is None else
                                        {"hf_config": SimpleNamespace(architectures=list(architectures))})),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=block),
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="recompute"),
        speculative_config=speculative,
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
    )
    kv.hash_block_size = hash_block or block  # what vLLM's engine core sets at start-up
    geo = resolve_geometry(vllm, kv)
    settings = Settings(url=url, timeout_s=timeout_s, retry_after_s=retry_after_s, chunk_keys=chunk_keys,
                        save_decode=save_decode, trust_media_ids=trust_media_ids)
    return SchedulerSide(vllm, kv, settings, geo, None, numerics=numerics)


def request(req_id: str, token_ids: list[int], salt: str | None = None, hash_block: int | None = None,
            mm_features: list[Any] | None = None):
    """A vLLM request; with ``hash_block``, its ``block_hashes`` computed as vLLM's engine
    does on arrival (sha256, the default algorithm), at that many tokens per block;
    ``mm_features``: its images (:func:`image_feature`)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from testing.vllm_keys import vllm_hashed_request

    if hash_block is not None:
        return vllm_hashed_request(req_id, token_ids, hash_block, salt, mm_features=mm_features)
    return Request(req_id, token_ids, SamplingParams(max_tokens=1), None, cache_salt=salt, mm_features=mm_features)


def image_feature(identifier: str, offset: int, length: int, pixels: torch.Tensor | None):
    """One image of a request as vLLM's engine core holds it: its identifier (vLLM's
    digest, or a client's media id), its placeholder span and its processed tensors
    (``pixel_values`` and ``image_grid_thw``; None: not on the scheduler)."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    data = None
    if pixels is not None:
        field = MultiModalBatchedField()
        data = MultiModalKwargsItem({
            "pixel_values": MultiModalFieldElem(data=pixels, field=field),
            "image_grid_thw": MultiModalFieldElem(data=torch.tensor([1, 8, 8]), field=field),
        })
    return MultiModalFeatureSpec(data=data, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=identifier)


def drafts(method: str, k: int = 1, draft_model: Path | None = None, **fields: Any) -> SimpleNamespace:
    """vLLM's ``speculative_config`` as the connector reads it: ``method``,
    ``num_speculative_tokens`` k and, for a separate draft, its model config (weights at
    ``draft_model``); ``fields`` override the rest (``disable_eagle_block_drop``,
    ``draft_model_config`` ...). ``disable_padded_drafter_batch`` is True by default: the
    setting under which the connector caches lookahead drafters (connector.drafts)."""
    draft_config = None
    if draft_model is not None:
        draft_config = SimpleNamespace(model=str(draft_model), revision=None, quantization=None, hf_overrides=None,
                                       hf_config=SimpleNamespace(to_dict=lambda: {"model_type": "draft"}))
    return SimpleNamespace(**{"method": method, "num_speculative_tokens": k, "draft_model_config": draft_config,
                              "disable_eagle_block_drop": False, "disable_padded_drafter_batch": True, **fields})


class Blocks:
    """vLLM's KV cache manager as the connector's scheduler side reads it (block ids per
    request, the null block), handing out real ``KVCacheBlocks``: every request gets its
    own block ids, ``n`` blocks in each of the harness's two groups (state 0, attention 1).
    ``bind`` makes it the side's manager."""

    def __init__(self) -> None:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self._block = KVCacheBlock
        self.block_pool = SimpleNamespace(null_block=KVCacheBlock(0))
        self.block_pool.null_block.is_null = True
        self._tables: dict[str, tuple[list[Any], list[Any]]] = {}
        self._next = 1

    def bind(self, side: Any) -> Blocks:
        side.kv_cache_manager = self
        return self

    def allocate(self, req_id: str, n: int) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        tables = self._tables.setdefault(req_id, ([], []))
        for table in tables:
            while len(table) < n:
                table.append(self._block(self._next))
                self._next += 1
        return KVCacheBlocks((list(tables[0]), list(tables[1])))

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in table] for table in self._tables.get(req_id, ([], [])))


def step(side: Any, scheduled: dict[str, tuple[int, int]],
         offloads: dict[str, list[tuple[int, int, int]]] | None = None,
         encoder_inputs: dict[str, list[int]] | None = None) -> Any:
    """One scheduler step's plan: ``build_connector_meta`` for requests already scheduled
    (``{req_id: (num_computed_tokens, num_scheduled_tokens)}``) with vLLM's boundary state
    offloads (``{req_id: [(vllm_group, block_id, boundary_tokens)]}``) and the media items
    the workers encode this step (``{req_id: [index in mm_features]}``)."""
    ids = list(scheduled)
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=ids, num_computed_tokens=[scheduled[r][0] for r in ids]),
        num_scheduled_tokens={r: scheduled[r][1] for r in ids},
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offloads or {}),
        scheduled_encoder_inputs=encoder_inputs or {},
    )
    return side.build_connector_meta(so)


def store(url: str, namespace: str, moves: list[Any]) -> list[str]:
    """Store what the worker side would for save ``moves`` (rank 0, a few bytes each, the
    moves' parents and previous states): a stand-in for the worker's copy."""
    from cache_server.client import CacheClient

    if not moves:
        return []
    items = [(m.chunk_hash, m.group_id, 0, bytes([m.group_id + 1]) * 64) for m in moves]
    with CacheClient(url) as c:
        return c.put(namespace, items, prev=[m.prev for m in moves], parent=[m.parent for m in moves])
