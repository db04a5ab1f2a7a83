"""Prometheus metrics of glm-cache-server.

Store figures are read from the store at scrape time (one source of truth); per-request
latency and error counts are recorded by the request loop.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
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
        yield GaugeMetricFamily(f"{PREFIX}_used_bytes", "Bytes held by objects (their payloads)", value=s["used_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_charged_bytes", "Bytes charged against the budget: payloads plus "
                                f"{s['object_overhead_bytes']} bytes per object for its index", value=s["charged_bytes"])
        yield GaugeMetricFamily(f"{PREFIX}_usage_ratio", "charged / capacity (what eviction keeps at most 1)",
                                value=s["charged_bytes"] / s["capacity_bytes"])
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


# --- LMCache's labels (issue 35, item 4) -------------------------------------------------
# LMCache 0.5.7 labels its lookup counters by model_name and cache_salt, its L1 counters by
# l1_tag (and cache_salt when salted), its L1 gauges by l1_tag and backend, its failure
# counters by model_name (and during / reason). Ours, with the values this server knows:
L1_TAG = "_default"  # LMCache's tag of its one DRAM L1 (L1ManagerConfig.tag)
L1_BACKEND = "dram"  # L1BackendType.DRAM: our L1 is host memory
LMCACHE_EVICTION_WATERMARK = 0.8  # LMCache's --eviction-trigger-watermark default
NO_MODEL = "unknown"  # model_name of a namespace not named as engines name theirs
NO_SALT = "none"  # cache_salt of a lookup that carries no salt
OVERFLOW = "other"  # the label value past the cap on distinct values
MAX_MODEL_LABELS = 16
MAX_SALT_LABELS = 32
_ENGINE_NAMESPACE = re.compile(r"^(.+)-[0-9a-f]{16}$")  # connector.namespace.engine_fingerprint


def model_name_of(namespace: str) -> str:
    """The ``model_name`` label of a namespace: the served model name an engine's namespace
    starts with (``<model>-<16 hex>``, :func:`connector.namespace.engine_fingerprint`; the hello
    carries no model of its own), :data:`NO_MODEL` for any other name."""
    m = _ENGINE_NAMESPACE.match(namespace)
    return m.group(1) if m else NO_MODEL


def salt_label(salt: str | None, key: bytes = b"") -> str:
    """The ``cache_salt`` label: :data:`NO_SALT` without a salt, else ``s`` and 10 hex digits
    of HMAC-SHA256 of the salt under ``key`` (the server's token), so that no tenant's salt is
    shown in clear and, with a token, a guessed salt cannot be tested against a label."""
    if not salt:
        return NO_SALT
    return "s" + hmac.new(key, b"cache_salt:" + salt.encode("utf-8", "surrogatepass"),
                          hashlib.sha256).hexdigest()[:10]


class _LabelCap:
    """At most ``limit`` distinct values of one label; later ones become :data:`OVERFLOW`."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self._limit:
                self._seen.add(value)
                return value
            return OVERFLOW


class _LMCacheLabelled(Collector):
    """``lmcache_mp_*`` with LMCache's labels: lookup counters per (model_name, cache_salt),
    L1 counters per l1_tag, L1 gauges per (l1_tag, backend), the usage ratio with LMCache's
    meaning; the L2 series as :class:`LMCacheCollector` serves them (``l2_name``)."""

    def __init__(self, store: ObjectStore, lookups: Callable[[], dict[tuple[str, str], dict[str, int]]],
                 l2_families: LMCacheCollector) -> None:
        self._store = store
        self._lookups = lookups
        self._l2_families = l2_families

    def collect(self) -> Iterator[Metric]:
        s = self._store.snapshot()
        note = " (glm-cache-server, LMCache's name and labels)"
        by_label = self._lookups()
        for key, name, doc in (
                ("lookups", "lookups_requests", "Completed lookups"),
                ("requested_tokens", "lookup_requested_tokens", "Tokens submitted for lookup past the engine's "
                                                                "own prefix (whole chunks only)"),
                ("hit_tokens", "lookup_hit_tokens", "Tokens of resumable prefix found (strict prefix)"),
                ("hit_l1_tokens", "lookup_hit_l1_tokens", "Of lookup_hit: tokens L1 held on its own"),
                ("hit_l2_tokens", "lookup_hit_l2_tokens", "Of lookup_hit: tokens L2 promotion added")):
            family = CounterMetricFamily(f"lmcache_mp_{name}", doc + note, labels=["model_name", "cache_salt"])
            for (model, salt), t in sorted(by_label.items()):
                family.add_metric([model, salt], t[key])
            yield family
        for key, name, doc in (("get_hits", "l1_read_chunks", "Objects served from L1"),
                               ("puts_stored", "l1_write_chunks", "Objects written to L1"),
                               ("evictions", "l1_evicted_chunks", "Objects evicted from L1")):
            family = CounterMetricFamily(f"lmcache_mp_{name}", doc + note, labels=["l1_tag"])
            family.add_metric([L1_TAG], s[key])
            yield family
        tier = [L1_TAG, L1_BACKEND]
        used = GaugeMetricFamily("lmcache_mp_l1_memory_usage_bytes", "Bytes held in L1" + note,
                                 labels=["l1_tag", "backend"])
        used.add_metric(tier, s["used_bytes"])
        yield used
        ratio = GaugeMetricFamily(
            "lmcache_mp_l1_usage_ratio", f"L1 usage as LMCache reports it: LMCache evicts at its trigger "
            f"watermark ({LMCACHE_EVICTION_WATERMARK} of its pool), this server when its budget is full, so this is "
            f"{LMCACHE_EVICTION_WATERMARK} x charged / budget (glm_cache_usage_ratio is charged / budget)" + note,
            labels=["l1_tag", "backend"])
        ratio.add_metric(tier, LMCACHE_EVICTION_WATERMARK * s["charged_bytes"] / s["capacity_bytes"])
        yield ratio
        for family in self._l2_families.collect():
            if family.name.startswith("lmcache_mp_l2_"):
                yield family


class ServerMetrics:
    """The server's own registry (not the global one, so tests can run several servers)."""

    def __init__(self, store: ObjectStore, namespace_key: bytes = b"") -> None:
        self.registry = CollectorRegistry()
        self._namespace_key = namespace_key
        self.registry.register(_StoreCollector(store, self.namespace_id))
        # LMCache's names for what both servers measure (cache_server.lmcache_compat), with
        # LMCache's labels: lookups per (model_name, cache_salt), capped
        self.lookup_tokens = LookupTokens()  # every lookup, unlabelled
        self._lookups_by_label: dict[tuple[str, str], LookupTokens] = {}
        self._labels_lock = threading.Lock()
        self._model_cap = _LabelCap(MAX_MODEL_LABELS)
        self._salt_cap = _LabelCap(MAX_SALT_LABELS)
        self._l2: L2Tier | None = None
        self.registry.register(_LMCacheLabelled(
            store, self._lookup_snapshot, LMCacheCollector(store, self.lookup_tokens, lambda: self._l2)))
        # LMCache's failure counters (lmcache_mp.l1_allocation_failure / l1_read_failure, unit chunks)
        self.l1_allocation_failures = Counter(
            "lmcache_mp_l1_allocation_failure_chunks", "Objects whose put found no room in L1 (the budget held by "
            "leased objects: glm_cache_puts_no_space_total), as LMCache's lmcache_mp.l1_allocation_failure",
            ["during", "model_name"], registry=self.registry)
        self.l1_read_failures = Counter(
            "lmcache_mp_l1_read_failure_chunks", "Objects a get asked for and L1 did not hold (glm_cache_get_misses_"
            "total), as LMCache's lmcache_mp.l1_read_failure", ["during", "reason", "model_name"],
            registry=self.registry)
        self.requests = Histogram(f"{PREFIX}_request_seconds", "Time to answer a request, by op", ["op"],
                                  registry=self.registry,
                                  buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
        self.errors = Counter(f"{PREFIX}_errors", "Error replies, by code", ["code"], registry=self.registry)
        # A request's time from its sending (the client's clock, the header's ``sent``)
        self.queued = Histogram(f"{PREFIX}_request_queue_seconds", "Time from a request's sending (its client's "
                                "clock) to a worker taking it: socket buffers, the proxy, a worker's queue",
                                ["op"], registry=self.registry,
                                buckets=(1e-4, 1e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 30.0))
        self.late = Counter(f"{PREFIX}_late_requests", "Requests whose client's deadline had passed: answered "
                            "after it (answered; a lease they took is released), or skipped because it had "
                            "passed when a worker took them (dropped)", ["op", "outcome"], registry=self.registry)
        self.stuck_requests = Counter(f"{PREFIX}_stuck_requests", "Requests a worker was busy with for over "
                                      "10 s (logged with its stack): the requests dealt to that worker wait",
                                      registry=self.registry)
        self.clock_skewed = Counter(f"{PREFIX}_clock_skewed_requests", "Requests sent by a client whose clock is "
                                    "ahead of this server's by more than 1 s (no deadline applied: sync clocks)",
                                    registry=self.registry)
        self.deleted = Counter(f"{PREFIX}_deleted_objects", "Objects deleted on a client's request, by reason "
                               "(checksum: a loader found the bytes did not match their checksum; size: not the size its group has)", ["reason"],
                               registry=self.registry)
        self.limit_refusals = Counter(
            f"{PREFIX}_limit_refusals", "Requests refused by a limit (message_bytes, header_bytes, namespaces), "
            "and hits answered without a lease (leased_bytes)", ["limit"], registry=self.registry)
        for limit in ("message_bytes", "header_bytes", "namespaces", "leased_bytes"):
            self.limit_refusals.labels(limit=limit)  # present at 0 from the start
        self.refused_connections = Counter(
            f"{PREFIX}_refused_connections", "ZMQ connections refused before any message was read: pending_cap "
            "(over the caps on handshakes under way, per address or in all: cache_server.conn_gate), silent (no "
            "whole ZMQ greeting 10 s after it was accepted), and with "
            "--auth-token-file token (PLAIN with a wrong token, one a connection attempt), mechanism (no token; "
            "a peer retries, so one or more a client)", ["reason"], registry=self.registry)
        for reason in ("pending_cap", "silent"):
            self.refused_connections.labels(reason=reason)  # present at 0 from the start

    def count_lookup(self, chunk_size: int | None, n_hashes: int, start_chunk: int, answered: int,
                     l1_depth: int | None = None, namespace: str | None = None, salt: str | None = None) -> None:
        """One answered lookup, in tokens (:meth:`LookupTokens.count`), in all and under its
        ``model_name`` (of ``namespace``) and ``cache_salt`` (of ``salt``) labels."""
        self.lookup_tokens.count(chunk_size, n_hashes, start_chunk, answered, l1_depth)
        labels = (self.model_label(namespace), self._salt_cap(salt_label(salt, self._namespace_key)))
        with self._labels_lock:
            tokens = self._lookups_by_label.get(labels)
            if tokens is None:
                tokens = self._lookups_by_label[labels] = LookupTokens()
        tokens.count(chunk_size, n_hashes, start_chunk, answered, l1_depth)

    def model_label(self, namespace: str | None) -> str:
        """The ``model_name`` label of ``namespace`` (:func:`model_name_of`), capped."""
        return self._model_cap(NO_MODEL if namespace is None else model_name_of(namespace))

    def saw_namespace(self, namespace: str) -> None:
        """Show the lookup counters (unsalted) and the failure counters of ``namespace``'s model
        at 0 from its hello on (a panel then plots a real 0, not a missing series)."""
        model = self.model_label(namespace)
        with self._labels_lock:
            self._lookups_by_label.setdefault((model, NO_SALT), LookupTokens())
        self.l1_allocation_failures.labels(during="l1_store", model_name=model)
        self.l1_read_failures.labels(during="l1_retrieve", reason="not_found", model_name=model)

    def count_put_no_space(self, namespace: str, n: int) -> None:
        """``n`` objects of a put in ``namespace`` refused for lack of room (no_space)."""
        if n:
            self.l1_allocation_failures.labels(during="l1_store", model_name=self.model_label(namespace)).inc(n)

    def count_get_misses(self, namespace: str, n: int) -> None:
        """``n`` objects a get in ``namespace`` asked for and L1 did not hold."""
        if n:
            self.l1_read_failures.labels(during="l1_retrieve", reason="not_found",
                                         model_name=self.model_label(namespace)).inc(n)

    def _lookup_snapshot(self) -> dict[tuple[str, str], dict[str, int]]:
        with self._labels_lock:
            items = list(self._lookups_by_label.items())
        return {labels: tokens.snapshot() for labels, tokens in items}

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
        # LMCache's L2 task counters: one task per round trip (the L2 IOPS panel)
        tasks = {op: Counter(f"lmcache_mp_l2_{kind}_completed_requests", f"L2 {kind} tasks completed (one per "
                             "pipelined round trip), as LMCache's", ["l2_name"],
                             registry=self.registry).labels(l2_name=label)
                 for op, kind in (("set", "store"), ("get", "load"))}

        def observe(op: str, seconds: float, nbytes: int) -> None:
            latency.labels(op=op).observe(seconds)
            if op in rate and nbytes and seconds > 0:
                rate[op].observe(nbytes / seconds / 1e9)
            if op in tasks:
                tasks[op].inc()

        return observe

    def watch_l2(self, tier: L2Tier) -> None:
        """Export the tier's figures."""
        self.registry.register(_L2Collector(tier))
        self._l2 = tier

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
