"""Prometheus metrics of glm-cache-server.

Store figures are read from the store at scrape time (one source of truth); per-request
latency and error counts are recorded by the request loop.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cache_server.lmcache_compat import LMCacheCollector, LookupTokens, l2_name
from cache_server.store import ObjectStore

if TYPE_CHECKING:
    from cache_server.l2 import L2Tier

PREFIX = "glm_cache"
L2_LATENCY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
L2_THROUGHPUT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0)  # GB/s

# (status key, metric name, help) for the monotonic store counters.
_COUNTERS = (
    ("lookups", "lookups", "Lookups answered"),
    ("hits", "lookup_hits", "Lookups that found a resume point"),
    ("misses", "lookup_misses", "Lookups that found none"),
    ("hit_chunks", "lookup_hit_chunks", "Chunks of resumable prefix found by lookups"),
    ("get_hits", "get_hits", "Objects served"),
    ("get_misses", "get_misses", "Objects asked for but absent"),
    ("puts_stored", "puts_stored", "Objects stored"),
    ("puts_existing", "puts_existing", "Puts skipped because the object was resident"),
    ("puts_no_space", "puts_no_space", "Puts refused because leased objects held the budget"),
    ("evictions", "evictions", "Objects evicted (LRU)"),
    ("evicted_bytes", "evicted_bytes", "Bytes evicted"),
    ("leases_granted", "leases_granted", "Leases granted by lookups"),
    ("leases_expired", "leases_expired", "Leases dropped at their TTL"),
    ("stored_bytes_total", "stored_bytes", "Bytes stored"),
    ("served_bytes_total", "served_bytes", "Bytes served by get"),
)


def namespace_id(namespace: str, key: bytes = b"") -> str:
    """What stands for a namespace in /metrics labels: the first 12 hex digits of
    HMAC-SHA256 of its name under ``key`` (the server's token; empty without one). /metrics
    is open to scrapers, and a namespace names the model and the engine's layout; keyed by
    the token, nobody without it can test a guessed name against a label. /status (behind
    the token) shows each namespace's id as ``metrics_id``."""
    return hmac.new(key, namespace.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:12]


class _StoreCollector(Collector):
    def __init__(self, store: ObjectStore, label: Callable[[str], str]) -> None:
        self._store = store
        self._label = label

    def collect(self) -> Iterator[Metric]:
        s = self._store.snapshot()
        yield GaugeMetricFamily(f"{PREFIX}_capacity_bytes", "Byte budget (--l1-size-gb)", value=s["capacity_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_used_bytes", "Bytes held by objects", value=s["used_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_usage_ratio", "used / capacity",
                                value=s["used_bytes"] / s["capacity_bytes"])
        objects = GaugeMetricFamily(f"{PREFIX}_objects", "Resident objects per object group", labels=["group"])
        for group, n in s["objects_by_group"].items():
            objects.add_metric([group], n)
        yield objects
        nbytes = GaugeMetricFamily(f"{PREFIX}_group_bytes", "Resident bytes per object group", labels=["group"])
        for group, b in s["bytes_by_group"].items():
            nbytes.add_metric([group], b)
        yield nbytes
        named = GaugeMetricFamily(f"{PREFIX}_object_group_bytes", "Resident bytes by what the object group holds "
                                  "(kda_state, mla_latent, indexer_cache, as engines name them at hello)",
                                  labels=["name"])
        for name, b in s["bytes_by_group_name"].items():
            named.add_metric([name], b)
        yield named
        yield GaugeMetricFamily(f"{PREFIX}_active_leases", "Leases not yet released or expired",
                                value=s["active_leases"])
        yield GaugeMetricFamily(f"{PREFIX}_leased_objects", "Objects pinned by a lease", value=s["leased_objects"])
        yield GaugeMetricFamily(f"{PREFIX}_leased_bytes", "Bytes pinned by leases", value=s["leased_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_max_leased_bytes", "Cap on bytes pinned by leases (--max-leased-fraction)",
                                value=s["max_leased_bytes"])
        dropped = CounterMetricFamily(f"{PREFIX}_leases_dropped", "Oldest leases dropped to admit a newer one, "
                                      "by the cap that was reached", labels=["cap"])
        dropped.add_metric(["per_client"], s["leases_dropped_client_cap"])
        dropped.add_metric(["leased_bytes"], s["leases_dropped_leased_bytes"])
        yield dropped
        yield GaugeMetricFamily(f"{PREFIX}_superseded_objects",
                                "State objects with a newer state on their path (evicted first)",
                                value=s["superseded_objects"])
        # Usable prefixes: what the cache can resume, not only what it holds (per namespace id).
        usable = {ns: u for ns in self._store.tracked_namespaces()
                  if (u := self._store.usable_prefixes(ns)) is not None}
        for key, kind, doc in (
                ("resumable_tokens", GaugeMetricFamily, "Tokens of prefixes with attention for every chunk and "
                                                        "a state at the end (distinct chunks times chunk size)"),
                ("resumable_states", GaugeMetricFamily, "Chunks where a lookup can resume (attention on the whole "
                                                        "path and every state object)"),
                ("states_held", GaugeMetricFamily, "Chunks with every state object resident"),
                ("worthless_objects", GaugeMetricFamily, "Objects on no resumable path any more (evicted first)"),
                ("states_evicted_newest", CounterMetricFamily, "States evicted while still the newest of their "
                                                               "conversation path")):
            family = kind(f"{PREFIX}_{key}", doc + " (label: the namespace's metrics_id in /status)",
                          labels=["namespace"])
            for ns, u in usable.items():
                family.add_metric([self._label(ns)], u[key])
            yield family
        for key, name, doc in _COUNTERS:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=s[key])


class _L2Collector(Collector):
    """The L2 tier's figures, read at scrape time (``glm_cache_l2_*``)."""

    def __init__(self, tier: L2Tier) -> None:
        self._tier = tier

    def collect(self) -> Iterator[Metric]:
        s = self._tier.snapshot()
        name = f"{PREFIX}_l2"
        yield GaugeMetricFamily(f"{name}_up", "1 unless L2 is being skipped after an error", value=int(s["up"]))
        for key, doc in (("lookups", "Lookups that consulted L2"),
                         ("hits", "Lookups answered deeper than L1 alone thanks to L2"),
                         ("misses", "Lookups that consulted L2 and got nothing deeper"),
                         ("skipped", "Lookups that did not consult L2 (down, busy, namespace being cleared)"),
                         ("timeouts", "Lookups whose promotion hit the deadline"),
                         ("promoted_objects", "Objects promoted from L2 into L1"),
                         ("promoted_bytes", "Bytes promoted from L2 into L1"),
                         ("written_objects", "Objects written through to L2"),
                         ("written_bytes", "Bytes written to L2 (values, headers included)")):
            yield CounterMetricFamily(f"{name}_{key}", doc, value=s[key])
        dropped = CounterMetricFamily(f"{name}_dropped_writes", "Writes to L2 not made, by reason "
                                      "(queue_full, too_large, down, error)", labels=["reason"])
        for reason in ("queue_full", "too_large", "down", "error"):
            dropped.add_metric([reason], s["dropped"].get(reason, 0))
        yield dropped
        errors = CounterMetricFamily(f"{name}_errors", "L2 errors, by kind (timeout, connection, other; and "
                                     "values refused at promotion: auth (forged, replayed from another key or "
                                     "altered), checksum, format)", labels=["kind"])
        for kind in sorted({"timeout", "connection", "auth", "checksum", "format", "other", *s["errors"]}):
            errors.add_metric([kind], s["errors"].get(kind, 0))
        yield errors
        yield GaugeMetricFamily(f"{name}_queue_bytes", "Bytes waiting for the L2 writer", value=s["queue_bytes"])
        yield GaugeMetricFamily(f"{name}_queue_items", "Writes and clears waiting for the L2 writer",
                                value=s["queue_items"])


class ServerMetrics:
    """The server's own registry (not the global one, so tests can run several servers)."""

    def __init__(self, store: ObjectStore, namespace_key: bytes = b"") -> None:
        self.registry = CollectorRegistry()
        self._namespace_key = namespace_key
        self.registry.register(_StoreCollector(store, self.namespace_id))
        # LMCache's names for what both servers measure (cache_server.lmcache_compat)
        self.lookup_tokens = LookupTokens()
        self._l2: L2Tier | None = None
        self.registry.register(LMCacheCollector(store, self.lookup_tokens, lambda: self._l2))
        self.requests = Histogram(f"{PREFIX}_request_seconds", "Time to answer a request, by op", ["op"],
                                  registry=self.registry,
                                  buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
        self.errors = Counter(f"{PREFIX}_errors", "Error replies, by code", ["code"], registry=self.registry)
        self.deleted = Counter(f"{PREFIX}_deleted_objects", "Objects deleted on a client's request, by reason "
                               "(checksum: a loader found the bytes did not match their checksum; size: not the size its group has)", ["reason"],
                               registry=self.registry)
        self.limit_refusals = Counter(
            f"{PREFIX}_limit_refusals", "Requests refused by a limit (message_bytes, header_bytes, namespaces), "
            "and hits answered without a lease (leased_bytes)", ["limit"], registry=self.registry)
        for limit in ("message_bytes", "header_bytes", "namespaces", "leased_bytes"):
            self.limit_refusals.labels(limit=limit)  # present at 0 from the start
        self.refused_connections = Counter(
            f"{PREFIX}_refused_connections", "ZMQ handshakes refused before any message was read (servers with "
            "--auth-token-file): token (PLAIN with a wrong token, one a connection attempt), mechanism (no token; "
            "a peer retries, so one or more a client)", ["reason"], registry=self.registry)

    def count_lookup(self, chunk_size: int | None, n_hashes: int, start_chunk: int, answered: int,
                     l1_depth: int | None = None) -> None:
        """One answered lookup, in tokens (:meth:`LookupTokens.count`)."""
        self.lookup_tokens.count(chunk_size, n_hashes, start_chunk, answered, l1_depth)

    def namespace_id(self, namespace: str) -> str:
        """The label of ``namespace`` in this server's metrics (:func:`namespace_id`)."""
        return namespace_id(namespace, self._namespace_key)

    def observe_l2(self, cluster: bool) -> Callable[[str, float, int], None]:
        """Register the L2 round-trip histogram and, under LMCache's names, the L2 store and
        load throughput (GB/s per round trip: one pipelined batch of writes, or of a
        promotion's reads, is one of LMCache's L2 tasks); returns what the tier calls per
        round trip with its op, seconds and bytes moved."""
        latency = Histogram(f"{PREFIX}_l2_request_seconds", "Time of one L2 round trip, by op (exists, get, set, "
                            "clear)", ["op"], registry=self.registry, buckets=L2_LATENCY_BUCKETS)
        label = l2_name(cluster)
        rate = {op: Histogram(f"lmcache_mp_l2_{kind}_throughput_GB_per_second",
                              f"L2 {kind} throughput in GB/s per round trip (bytes / its time), as LMCache's "
                              f"lmcache_mp.l2_{kind}_throughput", ["l2_name"], registry=self.registry,
                              buckets=L2_THROUGHPUT_BUCKETS).labels(l2_name=label)
                for op, kind in (("set", "store"), ("get", "load"))}

        def observe(op: str, seconds: float, nbytes: int) -> None:
            latency.labels(op=op).observe(seconds)
            if op in rate and nbytes and seconds > 0:
                rate[op].observe(nbytes / seconds / 1e9)

        return observe

    def watch_l2(self, tier: L2Tier) -> None:
        """Export the tier's figures."""
        self.registry.register(_L2Collector(tier))
        self._l2 = tier

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
