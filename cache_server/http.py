"""HTTP side of glm-cache-server: /healthcheck, /status, /conf, /metrics and cache clearing.

With a token configured, /status (it lists namespaces), /conf and POST /cache/clear need
``Authorization: Bearer <token>``; /healthcheck and /metrics stay open for probes and
scrapers (they reveal sizes and counts, never keys or namespaces: per-namespace series are
labelled with an id keyed by the token, :func:`cache_server.metrics.namespace_id`).

LMCache's MP server paths are served too, so its CLI (``lmcache ping|describe kvcache``,
``lmcache kvcache clear``) works here: /status carries the fields LMCache's has
(:func:`cache_server.lmcache_compat.status_fields`) beside ours, /config is /conf,
/clear-cache is /cache/clear, and POST /cache/clear takes LMCache's body
``{"tier": "l1"|"l2"|"all", "force": bool}``. /quota is answered 501: this server has no
per-salt quotas, and a quota it accepted but did not enforce would be worse than a refusal."""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST

from cache_server.auth import bearer_matches
from cache_server.lmcache_compat import effective_config, status_fields

if TYPE_CHECKING:
    from cache_server.server import CacheServer

logger = logging.getLogger("glm_cache_server.http")

MAX_BODY_BYTES = 4096  # the only body read is a clear's {"tier": ..., "force": ...}
CLEAR_PATHS = ("/cache/clear", "/clear-cache")  # ours, and LMCache's older path
CLEAR_TIERS = ("l1", "l2", "all")
QUOTA_REFUSAL = ("glm-cache-server has no per-salt quotas: every namespace shares --l1-size-gb (and "
                 "--l1-state-share); LMCache's /quota is not served")


class _HTTPServer6(ThreadingHTTPServer):
    """The same server on an IPv6 address (``--host ::1``)."""

    address_family = socket.AF_INET6


def start_http(server: CacheServer, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the HTTP endpoints in a daemon thread; returns the bound server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path == "/healthcheck":
                self._send(200, "application/json", b'{"status": "ok"}')
            elif path == "/status":
                if not self._authorized():
                    return
                doc = server.status()
                for key, value in status_fields(doc, server.config).items():
                    doc.setdefault(key, value)  # LMCache's fields beside ours, never over them
                self._json(200, doc)
            elif path in ("/conf", "/config"):
                if self._authorized():
                    self._json(200, effective_config(server.config))
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, server.metrics.render())
            elif path == "/quota" or path.startswith("/quota/"):
                self._error(501, QUOTA_REFUSAL)
            else:
                self._error(404, f"no such endpoint {path}; try /healthcheck, /status, /conf, /metrics, "
                                 "POST /cache/clear")

        def do_POST(self) -> None:
            url = urlparse(self.path)
            if url.path not in CLEAR_PATHS:
                self._error(404, f"no such endpoint {url.path}")
                return
            if not self._authorized():
                return
            body = self._body()
            if body is None:
                return
            tier = body.get("tier", "all")
            if tier not in CLEAR_TIERS:
                self._error(400, f"tier must be one of {', '.join(CLEAR_TIERS)}, not {str(tier)[:32]!r}")
                return
            if tier == "l2" and server.l2 is None:
                self._error(400, "this server has no L2 tier (--l2)")
                return
            namespace = parse_qs(url.query).get("ns", [None])[0]
            removed = server.store.clear(namespace) if tier != "l2" else 0
            if server.l2 is not None and tier != "l1":  # in the background, after the writes queued before it
                server.l2.clear(namespace)
            logger.info("HTTP clear (%s) removed %d objects", tier, removed)
            reply: dict[str, object] = {"removed": removed}
            if body or url.path != "/cache/clear":  # asked LMCache's way: answered its way too
                # ours always removes leased objects too (LMCache's force=true): their load misses
                reply.update(status="ok", cleared={"tier": tier}, forced=True)
            self._json(200, reply)

        def do_PUT(self) -> None:
            self._not_served()

        def do_DELETE(self) -> None:
            self._not_served()

        def _not_served(self) -> None:
            path = urlparse(self.path).path
            if path == "/quota" or path.startswith("/quota/"):
                self._error(501, QUOTA_REFUSAL)
            else:
                self._error(405 if path in ("/healthcheck", "/status", "/conf", "/config", "/metrics", *CLEAR_PATHS)
                            else 404, f"no {self.command} {path}")

        def _body(self) -> dict | None:
            """The request's JSON object ({} without a body); None once answered 400/413."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY_BYTES:
                self._error(413 if length > 0 else 400, f"body must be a JSON object of at most {MAX_BODY_BYTES} bytes")
                return None
            raw = self.rfile.read(length) if length else b""
            if not raw.strip():
                return {}
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                body = None
            if not isinstance(body, dict):
                self._error(400, "body must be a JSON object, e.g. {\"tier\": \"l1\"}")
                return None
            return body

        def _json(self, code: int, doc: object) -> None:
            self._send(code, "application/json", json.dumps(doc, indent=1).encode())

        def _authorized(self) -> bool:
            """True if no token is configured or the request bears it; else answers 401."""
            token = server.config.auth_token
            if token is None or bearer_matches(self.headers.get("Authorization"), token):
                return True
            server.metrics.errors.labels(code="unauthorized").inc()
            self._error(401, "this endpoint needs Authorization: Bearer <token> (server started with "
                             "--auth-token-file)", {"WWW-Authenticate": 'Bearer realm="glm-cache-server"'})
            return False

        def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._send(code, "application/json", json.dumps({"error": message}).encode(), headers)

        def _send(self, code: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

    h = host.strip("[]")
    server_class = _HTTPServer6 if ":" in h else ThreadingHTTPServer
    httpd = server_class((h, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="glm-cache-http", daemon=True).start()
    return httpd
