"""What the L2 tier's threads (:mod:`cache_server.l2`: the reader, the writer of
:mod:`cache_server.l2_writer`, routers' probes) share: the store's clients and keys, the
tier's counters and the lock over them, and the back-off after an error.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cache_server.l2_config import L2Config, L2ConfigError
from cache_server.l2_values import mac_key, namespace_tag
from cache_server.layout import StoreKey

logger = logging.getLogger("glm_cache_server.l2")


def redis_key(prefix: str, key: StoreKey) -> str:
    """The store's key of an object: ``{prefix}:{ns tag}:{hash hex}:{group}:{rank}``."""
    ns, digest, group, rank = key
    return f"{prefix}:{namespace_tag(ns)}:{digest.hex()}:{group}:{rank}"


@dataclass
class L2Counters:
    """Monotonic counters for /status and /metrics."""

    lookups: int = 0  # lookups that consulted L2
    hits: int = 0  # ... whose answer went deeper thanks to L2
    misses: int = 0
    skipped: int = 0  # lookups that could not consult L2 (down, busy, namespace being cleared)
    timeouts: int = 0  # lookups answered at the deadline
    promoted_objects: int = 0
    promoted_bytes: int = 0
    written_objects: int = 0
    written_bytes: int = 0
    deleted_objects: int = 0  # values a client's delete removed from L2
    dropped_deletes: int = 0  # keys of client deletes not made (queue full, L2 down, an error)
    dropped: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))
    errors: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))


class L2Link:
    """One server's link to its L2 store: fresh clients, bounded by ``timeout_s``; the keys
    and the MAC key of its values; ``counters`` and ``lock``, which guards them and the
    tier's other shared state; and ``down_until``, before which L2 is skipped (set for
    ``retry_after_s`` by each error). ``observe(op, seconds, bytes moved)`` is called per
    round trip (the latency histogram and L2 throughput)."""

    def __init__(self, config: L2Config, observe: Callable[[str, float, int], None] | None = None) -> None:
        if config.secret is None:
            raise L2ConfigError("the L2 tier needs the servers' shared secret (--l2-secret-file)")
        self.config = config
        self.mac_key = mac_key(config.secret)
        self.counters = L2Counters()
        self.observe = observe or (lambda op, seconds, nbytes: None)
        self.lock = threading.Lock()
        self.down_until = 0.0

    def make_client(self) -> Any:
        """A fresh client; connection attempts and replies bounded by ``timeout_s``; no
        retries (the caller decides what an error means: a miss, a dropped write)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        c = self.config
        common: dict[str, Any] = dict(password=c.password, username=c.username, socket_timeout=c.timeout_s,
                                      socket_connect_timeout=c.timeout_s, retry=Retry(NoBackoff(), 0),
                                      socket_read_size=1 << 20)  # multi-MB values: fewer, larger reads
        if c.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            return RedisCluster(startup_nodes=[ClusterNode(h, port) for h, port in c.nodes],
                                require_full_coverage=False, **common)
        (host, port), = c.nodes
        return redis.Redis(host=host, port=port, **common)

    def redis_key(self, key: StoreKey) -> str:
        return redis_key(self.config.prefix, key)

    def down(self) -> bool:
        """Whether L2 is skipped now, after an error."""
        return time.monotonic() < self.down_until

    def error(self, kind: str, err: BaseException | str) -> None:
        """Count an error of ``kind`` and skip L2 for ``retry_after_s``."""
        with self.lock:
            self.counters.errors[kind] += 1
            first = time.monotonic() >= self.down_until
            self.down_until = time.monotonic() + self.config.retry_after_s
        if first:
            logger.warning("L2 %s error (%s); skipping L2 for %.1fs", kind, err, self.config.retry_after_s)

    @staticmethod
    def kind(err: BaseException) -> str:
        """An error's kind, as counted: ``timeout``, ``connection`` or ``other``."""
        import redis

        if isinstance(err, (redis.TimeoutError, TimeoutError)):
            return "timeout"
        if isinstance(err, (redis.ConnectionError, ConnectionError, OSError)):
            return "connection"
        return "other"
