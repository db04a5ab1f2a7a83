"""What ``glm-cache-server --l2 URL`` says: the store's nodes, its credentials, and the
tier's parameters, parsed once at start-up with errors that never show the password.

URL: ``redis://[:password@]host:port`` (one node) or
``redis+cluster://[:password@]host:port[,host:port...]`` (a cluster; any nodes as seeds);
``valkey://`` and ``valkey+cluster://`` are the same. Query parameters: ``timeout_s`` (1.0),
``retry_after_s`` (2.0), ``queue_mb`` (512: bytes waiting for the writer), ``prefix``
(``glmkv``), ``ttl_s`` (none: keys expire only by the store's ``maxmemory-policy``;
configure ``allkeys-lru``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlparse


class L2ConfigError(ValueError):
    """An ``--l2`` URL this server cannot use (its message never holds the password)."""


def redact_url(url: str) -> str:
    """``url`` with everything before the host list's ``@`` (user and password) replaced by
    ``***``; where the URL is too malformed to tell, more is hidden, never less."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url if sep else "***" if "@" in url else url
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}"


@dataclass(frozen=True)
class L2Config:
    """What ``--l2 URL`` says."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    password: str | None = field(default=None, repr=False)
    secret: bytes | None = field(default=None, repr=False)  # --l2-secret-file: keys the MAC of every value
    username: str | None = None
    timeout_s: float = 1.0
    retry_after_s: float = 2.0
    queue_bytes: int = 512 << 20
    prefix: str = "glmkv"
    ttl_s: int | None = None
    debug_promote_delay_s: float = 0.0  # tests only (with --debug-fault-hooks): widen the promotion window

    @classmethod
    def from_url(cls, url: str, *, allow_debug: bool = False, secret: bytes | None = None) -> L2Config:
        """Parse ``--l2 URL``; ``secret`` is the content of ``--l2-secret-file``."""
        shown = redact_url(url)
        try:
            u = urlparse(url)
        except ValueError as e:  # e.g. an unclosed IPv6 bracket
            raise L2ConfigError(f"--l2 {shown!r}: {e}") from None
        schemes = {"redis": False, "valkey": False, "redis+cluster": True, "valkey+cluster": True}
        if u.scheme not in schemes:
            raise L2ConfigError(f"--l2 {shown!r}: scheme must be one of {', '.join(schemes)}")
        userinfo, _, hostlist = u.netloc.rpartition("@")
        username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
        nodes = []
        for item in filter(None, hostlist.split(",")):
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise L2ConfigError(f"--l2 {shown!r}: {item!r} is not host:port")
            nodes.append((host.strip("[]"), int(port)))
        if not nodes:
            raise L2ConfigError(f"--l2 {shown!r}: no host:port")
        if not schemes[u.scheme] and len(nodes) > 1:
            raise L2ConfigError(f"--l2 {shown!r}: several nodes need {u.scheme}+cluster://")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        known = {"timeout_s", "retry_after_s", "queue_mb", "prefix", "ttl_s", "debug_promote_delay_s"}
        if set(q) - known:
            raise L2ConfigError(f"--l2 {shown!r}: unknown parameter(s) {sorted(set(q) - known)}; "
                                f"known: {sorted(known)}")
        try:
            cfg = cls(tuple(nodes), schemes[u.scheme], unquote(password) or None, secret, unquote(username) or None,
                      timeout_s=float(q.get("timeout_s", 1.0)), retry_after_s=float(q.get("retry_after_s", 2.0)),
                      queue_bytes=int(float(q.get("queue_mb", 512)) * (1 << 20)), prefix=q.get("prefix", "glmkv"),
                      ttl_s=int(q["ttl_s"]) if "ttl_s" in q else None,
                      debug_promote_delay_s=float(q.get("debug_promote_delay_s", 0.0)))
        except ValueError as e:
            raise L2ConfigError(f"--l2 {shown!r}: {e}") from e
        if not (0 < cfg.timeout_s <= 60 and cfg.retry_after_s >= 0 and cfg.queue_bytes > 0
                and (cfg.ttl_s is None or cfg.ttl_s > 0) and cfg.prefix and ":" not in cfg.prefix):
            raise L2ConfigError(f"--l2 {shown!r}: timeout_s in (0, 60], retry_after_s >= 0, queue_mb > 0, "
                                "ttl_s > 0 and a prefix without ':' please")
        if cfg.debug_promote_delay_s and not allow_debug:
            raise L2ConfigError("debug_promote_delay_s needs --debug-fault-hooks")
        return cfg

    def redacted(self) -> str:
        """The URL without its password, for logs and /status."""
        scheme = "redis+cluster" if self.cluster else "redis"
        auth = f"{self.username or ''}:***@" if self.password else ""
        return f"{scheme}://{auth}" + ",".join(f"{h}:{port}" for h, port in self.nodes)
