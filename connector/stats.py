"""The connector's counters in vLLM's own metrics.

vLLM collects ``get_kv_connector_stats()`` from every worker after each step and from the
scheduler side after each ``update_connector_output``, sums them (:meth:`GlmCacheStats.aggregate`),
prints them in its periodic "KV Transfer metrics" log line and hands them to the
Prometheus counters built by :func:`build_prom_metrics` (``vllm:glm_cache_*`` on the
engine's ``/metrics``, one ``engine`` label per engine). Each report carries what changed
since the previous one, so summing reports from several TP ranks gives the engine's totals.

Worker side (each rank): bytes and objects loaded and saved, loads that failed (vLLM
recomputed the request), objects whose save did not land. Scheduler side: saves reported
as not landed, how often a request's saved depth was moved back to re-save its holes,
requests whose re-saves were given up, and saves lost because their request had finished.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# counter -> help text; the keys are what the reports carry
COUNTERS: dict[str, str] = {
    "loaded_bytes": "Bytes loaded from glm-cache-server into the KV cache (all ranks)",
    "loaded_objects": "Objects loaded from glm-cache-server (all ranks)",
    "load_failures": "Loads that failed part-way or could not start; vLLM recomputed those requests",
    "load_cpu_seconds": "CPU time the workers' load and fetch threads spent (all ranks): what loads take from "
                        "the host's cores beside the model, page copies included on a CPU host",
    "step_cpu_seconds": "CPU time the connector's hooks took on the workers' step path (all ranks: planning "
                        "loads, copying saved pages, collecting results), the load, fetch and save threads not "
                        "included",
    "scheduler_cpu_seconds": "CPU time the connector's hooks took inside vLLM's scheduler (the engine core's "
                             "step), its lookup thread not included",
    "load_wrong_size_objects": "Objects a load found not their group's size: deleted on the server, saved again",
    "saved_bytes": "Bytes glm-cache-server stored from this engine (all ranks)",
    "saved_objects": "Objects glm-cache-server stored from this engine (all ranks)",
    "save_failures": "Objects whose save did not land (dropped, timed out, refused), as the workers saw them",
    "saves_reported_failed": "Saves the scheduler side learned did not land",
    "saves_corrected": "Times a request's saved depth was moved back to save its holes again",
    "saves_given_up": "Requests whose saves were given up (a permanent refusal or too many retries)",
    "saves_lost": "Saves that did not land after their request had finished (not retried)",
    "request_errors": "Requests served without the external cache because handling their data raised",
    "params_ignored": "kv_transfer_params entries not honoured (unknown lmcache.* keys, malformed values)",
    "media_withheld": "Requests whose saves stop before an image whose identifier vLLM's caches hold for "
                      "other content (a client's multi_modal_uuids)",
    "handoffs_saved": "PD hand-offs a prefill instance saved (do_remote_decode requests; connector.handoff)",
    "handoffs_loaded": "PD hand-offs a decode instance resumed from (do_remote_prefill requests)",
    "handoffs_missed": "do_remote_prefill requests whose hand-off was not on the server (strict-prefix resume)",
    "lookups_sent": "Lookups sent to glm-cache-server (each within the connector's timeout_s from when vLLM asked)",
    "lookups_in_time": "Lookups glm-cache-server answered within their deadline (error replies included)",
    "lookups_late": "Lookups answered after their deadline had passed (the request was served cold; a lease "
                    "in the late answer is released)",
    "lookups_unanswered": "Lookups never answered: no reply within 60 s of giving up, or the connection dropped or closed first",
    "lease_releases_failed": "Lease releases not made (failed, or skipped while the server was away): those "
                             "leases stay held on the server until its lease TTL",
}

# the scheduler side's Counter keys (connector.scheduler) -> the reported names
SCHEDULER_KEYS: dict[str, str] = {
    "failed": "saves_reported_failed",
    "corrected": "saves_corrected",
    "given_up": "saves_given_up",
    "lost": "saves_lost",
    "request_errors": "request_errors",
    "params_ignored": "params_ignored",
    "media_withheld": "media_withheld",
    "handoffs_saved": "handoffs_saved",
    "handoffs_loaded": "handoffs_loaded",
    "handoffs_missed": "handoffs_missed",
    "cpu": "scheduler_cpu_seconds",
    **{name: name for name in ("lookups_sent", "lookups_in_time", "lookups_late", "lookups_unanswered",
                               "lease_releases_failed")},  # RemoteCache.counters()
}


@dataclass
class GlmCacheStats(KVConnectorStats):
    """Counter increments since the last report: ``data`` maps a :data:`COUNTERS` key to
    an integer (unknown keys from a newer peer are summed along and not exported)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> GlmCacheStats:
        for key, value in other.data.items():
            if isinstance(value, (int, float)):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class DeltaReporter:
    """Turns running counters into increments since the previous call (None: nothing new)."""

    def __init__(self, keys: Mapping[str, str] | None = None) -> None:
        self._keys = keys  # counter key -> reported name; None: the counter's own keys
        self._last: dict[str, int] = {}

    def report(self, counters: Mapping[str, int]) -> GlmCacheStats | None:
        delta: dict[str, int] = {}
        for key, value in list(counters.items()):  # a copy: workers' threads add to it
            name = key if self._keys is None else self._keys.get(key)
            if name is None or name not in COUNTERS:
                continue
            change = value - self._last.get(key, 0)
            self._last[key] = value
            if change:
                delta[name] = delta.get(name, 0) + change
        return GlmCacheStats(data=delta) if delta else None


class GlmCachePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :data:`COUNTERS` entry, ``vllm:glm_cache_<name>``."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:glm_cache_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and engine_idx in per_engine and isinstance(value, (int, float)) and value > 0:
                per_engine[engine_idx].inc(value)
