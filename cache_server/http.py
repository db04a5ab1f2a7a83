"""HTTP side of glm-cache-server: /healthcheck, /status, /metrics and cache clearing."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

from prometheus_client import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from cache_server.server import CacheServer

logger = logging.getLogger("glm_cache_server.http")


def start_http(server: CacheServer, host: str, port: int) -> ThreadingHTTPServer:
    """Serve the HTTP endpoints in a daemon thread; returns the bound server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path == "/healthcheck":
                self._send(200, "application/json", b'{"status": "ok"}')
            elif path == "/status":
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
            namespace = parse_qs(url.query).get("ns", [None])[0]
            removed = server.store.clear(namespace)
            logger.info("HTTP clear removed %d objects", removed)
            self._send(200, "application/json", json.dumps({"removed": removed}).encode())

        def _error(self, code: int, message: str) -> None:
            self._send(code, "application/json", json.dumps({"error": message}).encode())

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: object) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="glm-cache-http", daemon=True).start()
    return httpd
