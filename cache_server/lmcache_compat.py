"""What glm-cache-server shows under LMCache's names, so LMCache's own tools keep working.

An operator who ran LMCache's multiprocess server keeps three things when switching:

- ``lmcache describe kvcache`` (``lmcache-cli``) reads ``/status``: :func:`status_fields`
  adds the fields it reads (``is_healthy``, ``engine_type``, ``chunk_size``,
  ``storage_manager.l1_manager.*``, ``storage_manager.eviction_controller.eviction_policy``,
  ``storage_manager.l2_adapters``) beside ours, computed from the same snapshot.
- ``GET /conf`` (and ``/config``, the path LMCache 0.5.7 serves): :func:`effective_config`.
- Prometheus: :class:`LMCacheCollector` serves ``lmcache_mp_*`` series for what both servers
  measure, each from one of our own counters (the mapping is in :data:`SERVED`); our
  ``glm_cache_*`` series are unchanged. What LMCache measures and we do not count is left
  out (:data:`LEFT_OUT`), never estimated.

LMCache's names are OpenTelemetry instruments exported to Prometheus: ``lmcache_mp.lookup_hit``
with unit ``tokens`` becomes ``lmcache_mp_lookup_hit_tokens_total``. Its "chunks" unit counts
keys (one per chunk, object group and TP rank), which is what our objects are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cache_server.config import ServerConfig
    from cache_server.l2 import L2Tier
    from cache_server.store import ObjectStore

ENGINE_TYPE = "glm-cache-server"

# LMCache name -> (our series it equals, how): the table docs/dashboards/README.md shows.
SERVED: dict[str, tuple[str, str]] = {
    "lmcache_mp_lookups_requests_total": ("glm_cache_lookups_total", "equal"),
    "lmcache_mp_lookup_requested_tokens_total": (
        "(chunks asked past start_chunk) x the namespace's chunk size", "counted per lookup"),
    "lmcache_mp_lookup_hit_tokens_total": ("glm_cache_lookup_hit_chunks_total x chunk size", "counted per lookup"),
    "lmcache_mp_lookup_hit_l1_tokens_total": ("of the hit, the part L1 held before any L2 promotion",
                                              "counted per lookup"),
    "lmcache_mp_lookup_hit_l2_tokens_total": ("of the hit, the part L2 promotion added", "counted per lookup"),
    "lmcache_mp_l1_read_chunks_total": ("glm_cache_get_hits_total", "equal"),
    "lmcache_mp_l1_write_chunks_total": ("glm_cache_puts_stored_total", "equal"),
    "lmcache_mp_l1_evicted_chunks_total": ("glm_cache_evictions_total", "equal"),
    "lmcache_mp_l1_memory_usage_bytes": ("glm_cache_used_bytes", "equal"),
    "lmcache_mp_l1_usage_ratio": ("0.8 x glm_cache_usage_ratio", "LMCache's meaning: it evicts at 0.8 of its pool, "
                                  "we when the budget is full"),
    "lmcache_mp_l1_allocation_failure_chunks_total": ("glm_cache_puts_no_space_total", "equal: puts that found no room"),
    "lmcache_mp_l1_read_failure_chunks_total": ("glm_cache_get_misses_total", "equal: objects a get found absent"),
    "lmcache_mp_l2_store_completed_objects_chunks_total": ("glm_cache_l2_written_objects_total", "equal (with --l2)"),
    "lmcache_mp_l2_prefetch_lookup_requests_total": ("glm_cache_l2_lookups_total", "equal (with --l2)"),
    "lmcache_mp_l2_prefetch_load_completed_chunks_total": ("glm_cache_l2_promoted_objects_total",
                                                           "equal (with --l2)"),
    "lmcache_mp_l2_store_throughput_GB_per_second": (
        "bytes / seconds of each L2 write batch (one pipelined round trip, glm_cache_l2_request_seconds{op=set})",
        "histogram (with --l2)"),
    "lmcache_mp_l2_load_throughput_GB_per_second": (
        "bytes / seconds of each batch of a promotion's L2 reads (glm_cache_l2_request_seconds{op=get})",
        "histogram (with --l2)"),
}

# LMCache names on its dashboard that we do not serve, and why: keys are glob patterns of
# full series names, space-separated (validation/lmcache_dashboard.py reads them per panel).
_ENGINE_SIDE = "GPU<->CPU copies happen in the engine's workers, not in our server"
LEFT_OUT: dict[str, str] = {
    "lmcache_mp_l0_l1_*_throughput_GB_per_second* lmcache_mp_num_submitted_* lmcache_mp_num_finished_*": (
        _ENGINE_SIDE + " (vllm:glm_cache_loaded_bytes_total and _saved_bytes_total are the engine's)"),
    "lmcache_mp_num_chunks_loaded_total": "engine-side in LMCache; ours is vllm:glm_cache_loaded_objects_total",
    "lmcache_mp_l0_block_*": "vLLM's GPU blocks are vLLM's: the server never sees them",
    "lmcache_mp_l2_usage_bytes": "we do not ask the L2 store how much it holds",
    "lmcache_mp_l2_store_submitted_* lmcache_mp_l2_prefetch_load_submitted_* "
    "lmcache_mp_l2_prefetch_lookup_objects_chunks_total": (
        "no L2 task queue to submit to: writes go out in pipelined batches (counted as completed tasks) and "
        "promotions read in the lookup; glm_cache_l2_queue_bytes is what waits"),
    "lmcache_mp_l2_prefetch_failure_chunks_total": (
        "L2 read failures are counted per kind, not per chunk: glm_cache_l2_errors_total{kind} and "
        "glm_cache_l2_timeouts_total"),
    "lmcache_mp_num_inflight_l2_* lmcache_mp_active_prefetch_jobs lmcache_mp_inflight_load_memory_usage_bytes": (
        "no in-flight job table: a promotion runs inside its lookup, writes in one writer thread"),
    "lmcache_mp_l1_eviction_loop_*": "no eviction loop: we evict inline on put",
    "lmcache_mp_l1_chunk_* lmcache_mp_real_reuse_gap_*": "object lifetimes and reuse gaps are not measured",
    "lmcache_mp_event_bus_*": "no event bus: counters are read at scrape time",
    "lmcache_mp_transfer_phase_*": "no DMA phases: the server touches no GPU",
    "lmcache_mp_lookup_prompt_tokens_total lmcache_mp_lookup_request_hit_tokens_total": (
        "the lookup carries chunk hashes only, not the prompt length or the engine's own hit"),
    "lmcache_blend_*": "no CacheBlend",
}


@dataclass
class LookupTokens:
    """Lookup figures in tokens, counted as each lookup is answered (the store counts chunks,
    and chunk sizes differ per namespace)."""

    lookups: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    hit_l1_tokens: int = 0
    hit_l2_tokens: int = 0
    uncounted_lookups: int = 0  # lookups in a namespace that never said hello (chunk size unknown)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def count(self, chunk_size: int | None, n_hashes: int, start_chunk: int, answered: int,
              l1_depth: int | None) -> None:
        """One answered lookup: ``n_hashes`` chunks asked for, of which the engine already had
        ``start_chunk``; ``answered`` is the resume point (0: a miss); ``l1_depth`` the depth L1
        alone had when L2 was consulted (None: L1 answered it all)."""
        with self._lock:
            self.lookups += 1
            if chunk_size is None:
                self.uncounted_lookups += 1
                return
            self.requested_tokens += max(0, n_hashes - start_chunk) * chunk_size
            hit = max(0, answered - start_chunk)
            if not hit:
                return
            l1 = hit if l1_depth is None else max(0, min(l1_depth, answered) - start_chunk)
            self.hit_tokens += hit * chunk_size
            self.hit_l1_tokens += l1 * chunk_size
            self.hit_l2_tokens += (hit - l1) * chunk_size

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}


class LMCacheCollector(Collector):
    """``lmcache_mp_*`` series, read at scrape time from the same figures as ours."""

    def __init__(self, store: ObjectStore, lookups: LookupTokens, l2: Callable[[], L2Tier | None]) -> None:
        self._store = store
        self._lookups = lookups
        self._l2 = l2

    def collect(self) -> Iterator[Metric]:
        s = self._store.snapshot()
        t = self._lookups.snapshot()
        note = " (glm-cache-server, LMCache's name)"
        yield CounterMetricFamily("lmcache_mp_lookups_requests", "Completed lookups" + note, value=s["lookups"])
        for key, name, doc in (
                ("requested_tokens", "lookup_requested_tokens", "Tokens submitted for lookup past the engine's "
                                                                "own prefix (whole chunks only)"),
                ("hit_tokens", "lookup_hit_tokens", "Tokens of resumable prefix found (strict prefix)"),
                ("hit_l1_tokens", "lookup_hit_l1_tokens", "Of lookup_hit: tokens L1 held on its own"),
                ("hit_l2_tokens", "lookup_hit_l2_tokens", "Of lookup_hit: tokens L2 promotion added")):
            yield CounterMetricFamily(f"lmcache_mp_{name}", doc + note, value=t[key])
        yield CounterMetricFamily("lmcache_mp_l1_read_chunks", "Objects served from L1" + note, value=s["get_hits"])
        yield CounterMetricFamily("lmcache_mp_l1_write_chunks", "Objects written to L1" + note,
                                  value=s["puts_stored"])
        yield CounterMetricFamily("lmcache_mp_l1_evicted_chunks", "Objects evicted from L1" + note,
                                  value=s["evictions"])
        yield GaugeMetricFamily("lmcache_mp_l1_memory_usage_bytes", "Bytes held in L1" + note, value=s["used_bytes"])
        yield GaugeMetricFamily("lmcache_mp_l1_usage_ratio", "L1 charged / capacity (payloads and per-object overhead)" + note,
                                value=s["charged_bytes"] / s["capacity_bytes"])
        tier = self._l2()
        if tier is None:
            return
        l2 = tier.snapshot()
        for name, key, doc in (
                ("l2_store_completed_objects_chunks", "written_objects", "Objects written to L2"),
                ("l2_prefetch_lookup_requests", "lookups", "Lookups that consulted L2"),
                ("l2_prefetch_load_completed_chunks", "promoted_objects", "Objects loaded from L2 into L1")):
            family = CounterMetricFamily(f"lmcache_mp_{name}", doc + note, labels=["l2_name"])
            family.add_metric([l2_name(l2["cluster"])], l2[key])
            yield family


def l2_name(cluster: bool) -> str:
    """The ``l2_name`` label (and describe's L2 type) of our one L2 tier: a RESP store
    (Redis or Valkey), one node or a cluster."""
    return "resp_cluster" if cluster else "resp"


def _chunk_size(status: dict[str, Any], config: ServerConfig) -> int | list[int]:
    """One chunk size if every negotiated namespace agrees (the configured minimum before any
    engine said hello); the sorted distinct sizes otherwise (ours is negotiated per namespace)."""
    sizes = sorted({n["chunk_size"] for n in status.get("namespaces", {}).values() if n.get("chunk_size")})
    if not sizes:
        return config.min_chunk_size
    return sizes[0] if len(sizes) == 1 else sizes


def status_fields(status: dict[str, Any], config: ServerConfig) -> dict[str, Any]:
    """The fields of LMCache's ``/status`` that ``lmcache describe kvcache`` reads, from our
    status document (added beside ours; none of ours is renamed)."""
    capacity, used = status["capacity_bytes"], status["used_bytes"]
    out: dict[str, Any] = {
        "is_healthy": True,  # the server answers; L2 trouble shows in its own entry below
        "engine_type": ENGINE_TYPE,
        "chunk_size": _chunk_size(status, config),
        "storage_manager": {
            "l1_manager": {"memory_total_bytes": capacity, "memory_used_bytes": used,
                           "memory_usage_ratio": used / capacity if capacity else 0.0,
                           "total_object_count": status["objects"]},
            "eviction_controller": {"eviction_policy": config.eviction_policy},
            "l2_adapters": [],
        },
        # read by ``lmcache bench engine --lmcache-url`` (model_name, kv_cache_layout.cache_size_per_token,
        # world_size per engine) and ``lmcache describe kvcache``: an engine's hello here names no model and
        # no bytes per token, so nothing can be filled in truthfully; empty is LMCache's answer before any
        # engine registered, and bench says "No model info returned by LMCache server"
        "cache_context_meta": {},
    }
    l2 = status.get("l2")
    if l2 is not None:
        out["storage_manager"]["l2_adapters"].append(
            {"type": l2_name(bool(l2.get("cluster"))), "is_healthy": bool(l2.get("up"))})
    return out


def effective_config(config: ServerConfig) -> dict[str, Any]:
    """``GET /conf``: every setting the server runs with, except the secrets (the fields
    kept out of the config's repr: the token, the L2 URL, which may hold a password, and
    the L2 secret), in LMCache's shape (one object per configuration)."""
    settings = {f.name: getattr(config, f.name) for f in fields(config) if f.repr}
    settings["max_message_bytes"] = config.message_limit_bytes
    settings["auth"] = config.auth_token is not None
    settings["l2"] = config.l2_url is not None
    return {"glm_cache_server": settings}


# LMCache variables this server reads (cache_server.auth.lmcache_api_keys), with LMCache's meaning.
HONOURED_ENV = ("LMCACHE_API_KEY", "LMCACHE_API_KEY_FILE", "LMCACHE_HTTP_API_KEY", "LMCACHE_HTTP_API_KEY_FILE")


def unhonoured_lmcache_env(environ: Mapping[str, str], shadowed: Iterable[str] = ()) -> list[str]:
    """The ``LMCACHE_*`` variables set in ``environ`` that this server does not act on, sorted:
    every one but :data:`HONOURED_ENV` (empty ones too), and those of them LMCache itself would
    ignore here (``shadowed``: a legacy key variable beside the new one). Named at start-up,
    one line each, never with the value (it may be a password: LMCACHE_RESP_PASSWORD)."""
    shadowed = set(shadowed)
    return sorted(name for name in environ
                  if name.startswith("LMCACHE_") and (name not in HONOURED_ENV or name in shadowed))
