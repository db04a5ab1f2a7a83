"""What glm-cache-server is configured with: :class:`ServerConfig`, whose field defaults are
the server's defaults (the command line in :mod:`cache_server.cli` reads them from here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_server import protocol as p

GIB = 1 << 30
MIB = 1 << 20
PUT_OBJECTS_BOUND = 16  # maximum-size objects one put may carry by default (--max-message-mb)


def default_max_message_bytes(max_object_bytes: int, l1_size_bytes: int,
                              max_header_bytes: int = p.DEFAULT_MAX_HEADER_BYTES) -> int:
    """Default ``--max-message-mb``: a header plus :data:`PUT_OBJECTS_BOUND` maximum-size
    objects, but no more than the budget (a put larger than the store cannot be kept
    whole), and never less than one maximum-size object."""
    return max(max_object_bytes, min(PUT_OBJECTS_BOUND * max_object_bytes, l1_size_bytes)) + max_header_bytes


@dataclass(frozen=True)
class ServerConfig:
    """Everything the CLI sets."""

    host: str = "127.0.0.1"
    port: int = 5555
    http_port: int = 8080  # 0 disables HTTP
    http_host: str | None = None  # --http-host: where HTTP binds; None: --host (as before the flag)
    prometheus_port: int | None = None  # --prometheus-port: a metrics-only HTTP port (LMCache's 9090); None: none
    min_chunk_size: int = 256
    l1_size_bytes: int = 1 * GIB
    max_object_bytes: int = 256 * MIB
    separate_object_groups: bool = True  # every model this project serves needs it
    lease_ttl_s: float = 60.0
    eviction_policy: str = "value"  # cache_server.store: "value" (recency and value per byte) or "LRU"
    l1_state_share: float | None = None  # share of l1_size_bytes for state groups; None: one budget
    debug_fault_hooks: bool = False  # enables ``debug_corrupt`` (tests of the checksum path)
    # Shared secret every request must carry; None: no authentication (loopback, or
    # --insecure-no-auth). Kept out of repr so it never reaches a log line.
    auth_token: str | None = field(default=None, repr=False)
    # LMCache's rule (its key set by --api-key-file or LMCACHE_[HTTP_]API_KEY[_FILE]): HTTP /metrics
    # needs the key too, only / and /healthcheck stay open; --auth-token-file alone keeps /metrics open
    metrics_need_auth: bool = False
    max_message_bytes: int | None = None  # None: default_max_message_bytes(...)
    max_header_bytes: int = p.DEFAULT_MAX_HEADER_BYTES
    max_leases_per_client: int = 1024
    max_leased_fraction: float = 0.5  # of l1_size_bytes that leases may pin
    max_namespaces: int = 64
    l2_url: str | None = field(default=None, repr=False)  # --l2: second tier (cache_server.l2); may hold a password
    # --l2-secret-file: keys the MAC of every L2 value; the servers sharing a store share it
    l2_secret: bytes | None = field(default=None, repr=False)
    shm: bool = True  # --no-shm: offer no shared memory to same-host clients
    arena: bool = True  # --no-arena: serve same-host gets by copy, never from a mapping every client shares
    workers: int = 4  # --workers: threads answering requests
    io_threads: int = 2  # --io-threads: ZMQ I/O threads (socket reads and writes)
    http_timeout_s: float = 10.0  # --http-timeout-s: an HTTP connection's time to send a whole request
    http_max_connections: int = 32  # --http-max-connections: HTTP connections (each a thread) open at once

    @property
    def bound_http_host(self) -> str:
        """The address HTTP binds (``--http-host``, else ``--host``)."""
        return self.host if self.http_host is None else self.http_host

    @property
    def message_limit_bytes(self) -> int:
        """The effective ``--max-message-mb`` in bytes."""
        if self.max_message_bytes is not None:
            return self.max_message_bytes
        return default_max_message_bytes(self.max_object_bytes, self.l1_size_bytes, self.max_header_bytes)
