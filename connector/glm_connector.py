"""GlmCacheConnector: vLLM KV-transfer connector backed by glm-cache-server.

Usage::

    --kv-transfer-config '{"kv_connector":"GlmCacheConnector",
                           "kv_connector_module_path":"connector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"server":"tcp://127.0.0.1:5555"}}'

vLLM loads one class for both roles; this one is thin and hands each call to its half:

* Scheduler side (``connector.scheduler``) decides. It negotiates the chunk size,
  looks prefixes up under the strict-prefix rule, and each step writes a plain
  :class:`GlmConnectorMetadata`: which objects to load into which blocks, which blocks to
  save under which keys.
* Worker side (``connector.worker``) moves bytes. It loads asynchronously (the request waits in
  WAITING_FOR_REMOTE_KVS, so vLLM's state pre-copy cannot race the load) and reports each
  request's load as finished or failed; it copies save pages out after the forward and
  sends them from a background thread.

A miss, a timeout, a dead server or a bad object is a cold compute: never a wrong output,
never a stalled engine. Settings (``kv_connector_extra_config``): :mod:`connector.config`,
listed in ``docs/operating.md``. Which recurrent states exist, and how to run vLLM when
the chunk exceeds its block: :mod:`connector.scheduler`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from connector.config import Settings, logger
from connector.geometry import (
    Geometry,
    RowParts,
    UnsupportedLayout,
    disabled_geometry,
    model_row_parts,
    resolve_geometry,
)
from connector.namespace import model_cache_row_format, model_numerics_version
from connector.scheduler import SchedulerSide
from connector.stats import SCHEDULER_KEYS, DeltaReporter, GlmCachePromMetrics, GlmCacheStats
from connector.worker import WorkerSide

_T = TypeVar("_T")

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def resolve_or_disable(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, row_parts: RowParts | None = None
) -> tuple[Geometry, str | None]:
    """The engine's cache geometry, or an empty one and the reason when vLLM handed us
    a layout we do not understand (fail closed: serve without the external cache, never
    guess a layout). ``row_parts``: the model's cache-row parts (``model_row_parts``).
    Logged once here. Fixable misconfigurations (prefix caching off,
    recurrent state without align-mode snapshots) still raise ``GeometryError`` and stop
    vLLM at start-up: the operator asked for the cache and one flag fixes it."""
    try:
        return resolve_geometry(vllm_config, kv_cache_config, row_parts=row_parts), None
    except UnsupportedLayout as e:
        logger.error("GlmCacheConnector: %s; serving without the external cache", e)
        return disabled_geometry(kv_cache_config), str(e)


class GlmCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector for hybrid (recurrent state + attention) models on glm-cache-server."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = Settings.from_config(self._kv_transfer_config)
        # Raises GeometryError (prefix caching off, non-align state groups) at start-up;
        # a layout we do not understand disables the external cache instead.
        geometry, refused = resolve_or_disable(vllm_config, kv_cache_config, model_row_parts(vllm_config))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # the model's cache-row format and numerics version join the namespace (rows of
            # another format, or computed by other code, never load)
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, settings, geometry, refused,
                                            row_format=model_cache_row_format(vllm_config),
                                            numerics=model_numerics_version(vllm_config))
        else:
            self._worker = WorkerSide(vllm_config, kv_cache_config, settings, geometry, refused)
        # increments of our counters, reported to vLLM's metrics (connector.stats)
        self._stats_reporter = DeltaReporter(SCHEDULER_KEYS if role == KVConnectorRole.SCHEDULER else None)

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a later miss, never a wrong answer.
        return False

    # Scheduler side ---------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._metered(self._scheduler.get_num_new_matched_tokens, request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._metered(self._scheduler.update_state_after_alloc, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._metered(self._scheduler.build_connector_meta, scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._metered(self._scheduler.update_connector_output, connector_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._metered(self._scheduler.request_finished_all_groups, request, block_ids)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    def take_events(self) -> list[Any]:
        """What glm-cache-server can resume, as vLLM's KV events (``--kv-events-config``;
        :mod:`connector.events`)."""
        return self._metered(self._scheduler.take_events) if self._scheduler is not None else []

    def has_pending_push_work(self) -> bool:
        """Keep an idle engine stepping while KV events wait to be published (vLLM publishes
        only from steps): a reset of vLLM's prefix cache, chunks being confirmed on the server."""
        return self._scheduler is not None and self._metered(self._scheduler.events_pending)

    # Worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    # Sleep mode (vLLM 0.33 asks supports_sleep_mode before it starts an engine with
    # --enable-sleep-mode, then calls the two hooks around the KV cache's remap; 0.32 calls
    # none of them). We follow the remap: see WorkerSide.unregister_kv_caches.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._metered(self._worker.start_load_kv, self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the request is scheduled (async, whole request)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # pages are copied after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._metered(self._worker.wait_for_save, self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._metered(self._worker.get_transfer_results)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Never block ids: a failed load fails its whole request (see connector.worker:
        # vLLM 0.32 refuses block-level errors with several KV cache groups, and a hybrid
        # resume needs the state at the resume point, which a partial load lacks).
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Saves that did not land, for the scheduler side to save again."""
        return self._metered(self._worker.build_connector_worker_meta) if self._worker is not None else None

    # Metrics (both sides) -------------------------------------------------------------

    def _metered(self, hook: Callable[..., _T], *args: Any) -> _T:
        """``hook(*args)``, its thread CPU time added to this side's counter: what the
        connector takes from each step (``vllm:glm_cache_scheduler_cpu_seconds_total``,
        ``..._step_cpu_seconds_total``; the background threads count in their own)."""
        start = time.thread_time()
        try:
            return hook(*args)
        finally:
            if self._scheduler is not None:
                self._scheduler.save_stats["cpu"] += time.thread_time() - start
            else:
                self.stats["step_cpu_seconds"] += time.thread_time() - start

    def get_kv_connector_stats(self) -> GlmCacheStats | None:
        """What our counters gained since the last call (vLLM sums the workers' and the
        scheduler side's and exports them; see :mod:`connector.stats`)."""
        if self._scheduler is not None:
            counters = {**self._scheduler.save_stats, **self._scheduler.remote.counters()}
        else:
            counters = self.stats
        return self._stats_reporter.report(counters)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GlmCacheStats:
        return GlmCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> GlmCachePromMetrics:
        return GlmCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def stats(self) -> dict[str, int]:
        """The worker's load/save counters (empty on the scheduler side)."""
        return self._worker.stats if self._worker is not None else {}

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
