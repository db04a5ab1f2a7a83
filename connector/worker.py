"""The worker side of :class:`~connector.glm_connector.GlmCacheConnector`: it moves bytes.

It loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS, so vLLM's state
pre-copy cannot race the load) and reports each request's load as finished or failed; it
copies save pages out after the forward and sends them from a background thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from connector.client import CacheClient
from connector.common import (
    CLIENT_ERRORS,
    GlmConnectorMetadata,
    LoadJob,
    ObjectMove,
    Settings,
    logger,
    unauthorized,
)
from connector.geometry import Geometry

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class WorkerSide:
    """The connector's worker role (one per TP/PP rank)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings, geometry: Geometry, refused_layout: str | None) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._geometry = geometry
        self._refused_layout = refused_layout
        self._auth_broken = settings.auth_broken
        self._max_pending_save_bytes = settings.max_pending_save_bytes
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        # One object per (chunk, group, rank): the rank is the worker's place in TP x PP.
        # Groups identical on every TP rank are one object per (chunk, group) instead, kept
        # under the TP group's first rank: TP rank 0 saves it, every rank loads it.
        try:
            tp = self._vllm_config.parallel_config.tensor_parallel_size
            self._tp_rank = get_tensor_model_parallel_rank()
            self._rank = get_pp_group().rank_in_group * tp + self._tp_rank
        except (AssertionError, RuntimeError):
            self._rank = self._tp_rank = 0
        self._replicated = {g.group_id for g in self._geometry.groups if g.replicated_across_tp}
        self._pages = None
        self._load_client = CacheClient(
            settings.url, timeout_s=settings.timeout_s, auth_token=settings.auth_token
        )
        self._save_client = CacheClient(
            settings.url, timeout_s=settings.timeout_s, auth_token=settings.auth_token
        )
        self._refused_logged = False
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-save")
        self._lock = threading.Lock()
        self._loads_done: set[str] = set()
        self._loads_failed: set[str] = set()
        self._pending_save_bytes = 0
        self._dropped_saves = 0
        self.stats = {"loaded_objects": 0, "saved_objects": 0, "load_failures": 0}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from connector.kv_pages import PagedKVCache

        self._pages = PagedKVCache(kv_caches, self._kv_cache_config, self._geometry.groups)
        logger.info(
            "GlmCacheConnector worker rank %d: bytes per block per group %s",
            self._rank,
            {g.group_id: g.object_bytes_per_block for g in self._geometry.groups},
        )

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, GlmConnectorMetadata) or not meta.loads:
            return
        for job in meta.loads:
            self._loader.submit(self._run_load, meta.namespace, job)

    def _run_load(self, namespace: str, job: LoadJob) -> None:
        ok = False
        try:
            assert self._pages is not None
            if self._auth_broken:
                raise RuntimeError("no usable auth_token_file")
            if self._refused_layout is not None:
                raise RuntimeError(f"external cache disabled: {self._refused_layout}")
            keys = [(m.chunk_hash, m.group_id, self._key_rank(m.group_id)) for m in job.objects]
            payloads = self._load_client.get(namespace, keys)
            missing = [k for k, p in zip(keys, payloads) if p is None]
            if missing:
                raise LookupError(f"{len(missing)} of {len(keys)} objects missing")
            # Check every object before writing any: a bad one fails the load untouched.
            for move, payload in zip(job.objects, payloads):
                self._check_size(move, payload)
            for move, payload in zip(job.objects, payloads):
                self._write(move, payload)
            ok = True
            self.stats["loaded_objects"] += len(job.objects)
        except Exception as e:  # any failure is a recompute, never a crash
            logger.warning("GlmCacheConnector: load for %s failed (%s); recomputing", job.req_id, e)
            self.stats["load_failures"] += 1
        with self._lock:
            self._loads_done.add(job.req_id)
            if not ok:
                self._loads_failed.add(job.req_id)

    def _key_rank(self, group_id: int) -> int:
        """The rank an object of ``group_id`` is stored under (see ``_init_worker``)."""
        return self._rank - self._tp_rank if group_id in self._replicated else self._rank

    def _check_size(self, move: ObjectMove, payload: Any) -> None:
        assert self._pages is not None
        expected = self._pages.object_bytes(move.group_id, len(move.block_ids))
        if len(payload) != expected:
            raise ValueError(
                f"object for group {move.group_id} has {len(payload)} bytes, expected {expected}"
            )

    def _write(self, move: ObjectMove, payload: Any) -> None:
        assert self._pages is not None
        # None blocks are held locally already: the pages skip them (each layer its own size).
        self._pages.write(move.group_id, move.block_ids, payload)

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, GlmConnectorMetadata) or not meta.saves or self._pages is None:
            return
        if self._auth_broken or self._refused_layout is not None:
            return
        # Copy the pages now (they are valid after this step's forward and may be reused
        # later); the network send happens in the background.
        items = []
        prevs: list[bytes | None] = []
        parents: list[bytes | None] = []
        nbytes = 0
        for move in meta.saves:
            ids = [b for b in move.block_ids if b is not None]
            if len(ids) != len(move.block_ids):
                continue
            if move.group_id in self._replicated and self._tp_rank != 0:
                continue  # the TP group's first rank stores the one copy
            data = self._pages.read(move.group_id, ids)
            items.append((move.chunk_hash, move.group_id, self._key_rank(move.group_id), data))
            prevs.append(move.prev)
            parents.append(move.parent)
            nbytes += len(data)
        with self._lock:
            if self._pending_save_bytes + nbytes > self._max_pending_save_bytes:
                self._dropped_saves += len(items)
                logger.warning(
                    "GlmCacheConnector: %d save objects dropped (server too slow)", len(items)
                )
                return
            self._pending_save_bytes += nbytes
        self._saver.submit(self._run_save, meta.namespace, items, prevs, parents, nbytes)

    def _run_save(self, namespace: str, items: list, prevs: list[bytes | None],
                  parents: list[bytes | None], nbytes: int) -> None:
        try:
            results = self._save_client.put(namespace, items, prev=prevs, parent=parents)
            self.stats["saved_objects"] += sum(r == "stored" for r in results)
            bad = [r for r in results if r not in ("stored", "exists")]
            if bad:
                logger.debug("GlmCacheConnector: put results %s", bad)
        except CLIENT_ERRORS as e:
            if unauthorized(e):
                if not self._refused_logged:
                    logger.error(
                        "GlmCacheConnector: glm-cache-server refused our token (%s); saves are "
                        "dropped until auth_token_file matches its --auth-token-file", e,
                    )
                self._refused_logged = True
            else:
                logger.warning("GlmCacheConnector: save of %d objects failed: %s", len(items), e)
        finally:
            with self._lock:
                self._pending_save_bytes -= nbytes

    def get_transfer_results(self) -> KVConnectorTransferResults:
        with self._lock:
            done, failed = self._loads_done, self._loads_failed
            self._loads_done, self._loads_failed = set(), set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=True, cancel_futures=False)
        self._load_client.close()
        self._save_client.close()
