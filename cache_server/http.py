"""HTTP side of glm-cache-server: /healthcheck, /status, /metrics and cache clearing.

With a token configured, /status (it lists namespaces) and POST /cache/clear need
``Authorization: Bearer <token>``; /healthcheck and /metrics stay open for probes and
scrapers (they reveal sizes and counts, never keys or namespaces: per-namespace series are
labelled with an id keyed by the token, :func:`cache_server.metrics.namespace_id`)."""

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

if TYPE_CHECKING:
    from cache_server.server import CacheServer

logger = logging.getLogger("glm_cache_server.http")


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
                self._send(200, "application/json", json.dumps(server.status(), indent=1).encode())
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, server.metrics.render())
            else:
                self._error(404, f"no such endpoint {path}; try /healthcheck, /status, /metrics, POST /cache/clear")

        def do_POST(self) -> None:
            url = urlparse(self.path)
            if url.path != "/cache/clear":
                self._error(404, f"no such endpoint {url.path}")
                return
            if not self._authorized():
                return
            namespace = parse_qs(url.query).get("ns", [None])[0]
            removed = server.store.clear(namespace)
            if server.l2 is not None:  # and in L2, in the background, after the writes queued before it
                server.l2.clear(namespace)
            logger.info("HTTP clear removed %d objects", removed)
            self._send(200, "application/json", json.dumps({"removed": removed}).encode())

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
