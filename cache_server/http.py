"""HTTP side of glm-cache-server: /healthcheck, /status, /conf, /metrics, cache clearing, and
routers' queries (POST /query and /query_by_hash, :mod:`cache_server.prefix_query`).

With a token configured, /status (it lists namespaces), /conf, /version, POST /cache/clear and the
queries need ``Authorization: Bearer <token>`` (or LMCache's ``X-LMCache-API-Key: <token>``);
/, /healthcheck and /metrics stay open for probes and scrapers (they reveal sizes and counts,
never keys or namespaces: per-namespace series are labelled with an id keyed by the token,
:func:`cache_server.metrics.namespace_id`). A key given LMCache's way (``--api-key-file``,
``LMCACHE_API_KEY[_FILE]``) follows LMCache's rule instead: only / and /healthcheck stay open,
/metrics needs the key too; ``--prometheus-port`` serves /metrics alone without one, as
LMCache's separate scrape port does.

LMCache's MP server paths are served too, so its CLI (``lmcache ping|describe kvcache``,
``lmcache kvcache clear``) works here: /status carries the fields LMCache's has
(:func:`cache_server.lmcache_compat.status_fields`) beside ours, /config is /conf,
/clear-cache is an alias of /cache/clear, and POST /cache/clear takes LMCache's body
``{"tier": "l1"|"l2"|"all", "force": bool}`` with LMCache's meaning: without a body (or
without ``tier``) it clears L1 only, and only the objects no lookup has leased (``force``
removes those too); L2, which every server sharing the store reads, is cleared only when
asked for by name. /quota is answered 501: this server has no per-salt quotas, and a quota
it accepted but did not enforce would be worse than a refusal.

Hostile clients. Each connection has ``--http-timeout-s`` to deliver its whole request
(headers and body, however slowly it trickles them) and to take the reply; at most
``--http-max-connections`` are open at once, and one more arriving sheds the one that has
waited longest for its request (an idle or slow-loris connection), so a probe still gets
through a flood of idle ones. A browser page must not be able to change anything: a POST
(PUT, DELETE) carrying an ``Origin`` other than this server's own (or ``Sec-Fetch-Site``
other than same-origin) is refused 403, and a body that is not ``application/json`` 415
(a page can send text/plain or a form cross-site without asking first); curl without a
body, and LMCache's CLI, send neither."""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from cache_server import protocol as p
from cache_server.auth import LMCACHE_KEY_HEADER, is_loopback, request_token_matches
from cache_server.lmcache_compat import effective_config, status_fields
from cache_server.prefix_query import parse_query

if TYPE_CHECKING:
    from cache_server.server import CacheServer

logger = logging.getLogger("glm_cache_server.http")

MAX_BODY_BYTES = 4096  # a clear's body: {"tier": ..., "force": ...}
MAX_QUERY_BODY_BYTES = 5 << 20  # a router's query: 131072 token ids or 65536 hex hashes, as JSON
QUERY_PATHS = {"/query": False, "/query_by_hash": True}  # the Mooncake KV Indexer RFC's (by_hash)
CLEAR_PATHS = ("/cache/clear", "/clear-cache")  # ours, and an alias of it
VERSION_PATHS = ("/version", "/lmc_version", "/commit_id")  # LMCache's
COMMIT_ID = ""  # not recorded at install: /commit_id answers "" and /version "<version>-NA", as LMCache's would
QUOTA_REFUSAL = ("glm-cache-server has no per-salt quotas: every namespace shares --l1-size-gb (and "
                 "--l1-state-share); LMCache's /quota is not served")


_BUSY_BODY = b'{"error": "too many HTTP connections at once; try again shortly"}'
BUSY_REPLY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              b"Connection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
SAFE_FETCH_SITES = ("same-origin", "none")  # Sec-Fetch-Site values of a request no other site made
JSON_TYPE = "application/json"


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them.

    Each connection is tracked from accept to close with the deadline of the request it is
    reading (None once a whole request head is in and it is being answered). One more
    arriving sheds the reading connection with the oldest deadline (shut down: its thread
    sees the end of input and exits); if every slot is answering a request, the newcomer is
    answered 503 and closed without a thread."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst of connects waits here, not in SYN retries

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 max_connections: int, timeout_s: float, on_refusal: Callable[[str], None]) -> None:
        if max_connections < 1 or timeout_s <= 0:
            raise ValueError("max_connections and timeout_s must be positive")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._on_refusal = on_refusal
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float | None] = {}  # connection -> deadline of the request it reads
        super().__init__(address, handler)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def reading(self, conn: socket.socket, deadline: float | None) -> None:
        """The connection waits for a request due by ``deadline`` (None: it is being answered)."""
        with self._lock:
            if conn in self._open:
                self._open[conn] = deadline

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self._lock:
            if len(self._open) >= self.max_connections:
                waiting = [(d, c) for c, d in self._open.items() if d is not None]
                if not waiting:
                    self._refuse(request)
                    return
                victim = min(waiting, key=lambda dc: dc[0])[1]
                del self._open[victim]
                try:
                    victim.shutdown(socket.SHUT_RDWR)  # under the lock: it is not closed yet (shutdown_request)
                except OSError:
                    pass
                self._on_refusal("http_shed")
            self._open[request] = time.monotonic() + self.timeout_s
        super().process_request(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        self._on_refusal("http_busy")
        try:
            request.setblocking(False)
            request.send(BUSY_REPLY)  # fits any socket buffer: never waits
        except OSError:
            pass
        super().shutdown_request(request)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self._lock:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: object, client_address: object) -> None:
        # a peer that vanished mid-request (or was shed): nothing to print a traceback for
        logger.debug("HTTP connection from %s ended with an error", client_address, exc_info=True)


class _HTTPServer6(BoundedHTTPServer):
    """The same server on an IPv6 address (``--host ::1``)."""

    address_family = socket.AF_INET6


class _DeadlineReader(io.RawIOBase):
    """A connection's input that ends (TimeoutError) at its request's deadline, however
    often bytes arrive before it: a socket timeout alone restarts at every byte."""

    def __init__(self, conn: socket.socket, deadline: Callable[[], float]) -> None:
        self._conn = conn
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        left = self._deadline() - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within --http-timeout-s")
        self._conn.settimeout(left)
        return self._conn.recv_into(buffer)


def _has_body(content_length: str | None) -> bool:
    """Whether a request announces a body (a malformed length counts: _body refuses it)."""
    try:
        return int(content_length or 0) != 0
    except ValueError:
        return True


def same_origin(origin: str, host: str, port: int) -> bool:
    """Whether a request's ``Origin`` is this server's own: http, our port, and our bound
    host or a loopback name for it (never the request's Host header, which a DNS-rebinding
    page controls)."""
    try:
        url = urlsplit(origin.strip())
        origin_port = url.port or 80
    except ValueError:
        return False
    if url.scheme != "http" or not url.hostname or origin_port != port:
        return False
    name = url.hostname.lower()
    return is_loopback(name) or name == host.strip("[]").lower()


def server_version() -> str:
    """Our package's version (LMCache's /lmc_version answers its own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("glm5next-cache")
    except PackageNotFoundError:
        return ""


def start_http(server: CacheServer, host: str, port: int, metrics_only: bool = False) -> BoundedHTTPServer:
    """Serve the HTTP endpoints in a daemon thread; returns the bound server.

    ``metrics_only``: ``--prometheus-port``, LMCache's separate scrape port (its
    ``prometheus_client.start_http_server``, 9090): GET /metrics and nothing else, without a
    key, as LMCache's (it reveals sizes and counts, never keys or namespace names)."""
    timeout_s = server.config.http_timeout_s

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # the socket's: bounds each write of a reply (sendall: in all)
        _deadline = 0.0

        def setup(self) -> None:
            super().setup()
            plain = self.rfile
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, lambda: self._deadline))
            plain.close()

        def handle_one_request(self) -> None:
            # the whole request (line, headers, body) is due within the timeout of when we
            # start waiting for it; writes get the socket timeout back (_send)
            self._deadline = time.monotonic() + timeout_s
            httpd.reading(self.connection, self._deadline)
            super().handle_one_request()

        def parse_request(self) -> bool:
            ok = super().parse_request()
            if ok:
                httpd.reading(self.connection, None)  # a whole head is in: no longer one to shed
            return ok

        def log_error(self, fmt: str, *args: object) -> None:
            if fmt.startswith("Request timed out"):
                server.metrics.errors.labels(code="http_timeout").inc()
            logger.debug("%s " + fmt, self.address_string(), *args)

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if metrics_only:
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, server.metrics.render())
                else:
                    self._error(404, f"no such endpoint {path}; this port (--prometheus-port) serves /metrics only")
                return
            if path == "/healthcheck":
                self._json(200, {"status": "healthy"})  # LMCache's body
            elif path == "/":  # LMCache's static liveness payload, open as there
                self._json(200, {"status": "ok", "service": "glm-cache-server"})
            elif path in VERSION_PATHS:  # LMCache's version routes (behind the key there too)
                if self._authorized():
                    ours = server_version()
                    self._json(200, {"/lmc_version": ours, "/commit_id": COMMIT_ID,
                                     "/version": f"{ours or 'NA'}-{COMMIT_ID or 'NA'}"}[path])
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
                if not server.config.metrics_need_auth or self._authorized():
                    self._send(200, CONTENT_TYPE_LATEST, server.metrics.render())
            elif path == "/quota" or path.startswith("/quota/"):
                self._error(501, QUOTA_REFUSAL)
            else:
                self._error(404, f"no such endpoint {path}; try /healthcheck, /status, /conf, /metrics, /version, "
                                 "POST /cache/clear, POST /query, POST /query_by_hash")

        def do_POST(self) -> None:
            url = urlparse(self.path)
            if not self._not_cross_site():
                return
            if metrics_only:
                self._not_served()
                return
            if url.path in QUERY_PATHS:
                self._query(QUERY_PATHS[url.path])
                return
            if url.path not in CLEAR_PATHS:
                self._error(404, f"no such endpoint {url.path}")
                return
            if not self._authorized():
                return
            body = self._body()
            if body is None:
                return
            tier, force = body.get("tier", "l1"), body.get("force", False)  # LMCache's defaults
            if tier not in p.CLEAR_TIERS:
                self._error(400, f"tier must be one of {', '.join(p.CLEAR_TIERS)}, not {str(tier)[:32]!r}")
                return
            if not isinstance(force, bool):
                self._error(400, "force must be true or false")
                return
            if tier == "l2" and server.l2 is None:
                self._error(400, "this server has no L2 tier (--l2)")
                return
            namespace = parse_qs(url.query).get("ns", [None])[0]
            removed, kept = server.clear(namespace, tier, force)
            reply: dict[str, object] = {"removed": removed}
            if kept:
                reply["kept_leased"] = kept  # a lookup leased them for a load; force=true removes them too
            if body or url.path != "/cache/clear":  # asked LMCache's way: answered its way too
                reply.update(status="ok", cleared={"tier": tier}, forced=force)
            self._json(200, reply)

        def _query(self, by_hash: bool) -> None:
            """A router's question (:mod:`cache_server.prefix_query`), with the token of the
            other non-public endpoints; errors as the protocol names them."""
            if not self._authorized():
                return
            body = self._body(MAX_QUERY_BODY_BYTES)
            if body is None:
                return
            try:
                self._json(200, server.queries.answer(parse_query(body, by_hash)))
            except p.ProtocolError as e:
                server.metrics.errors.labels(code=e.code.value).inc()
                self._error({p.ErrorCode.TOO_LARGE: 413, p.ErrorCode.UNKNOWN_MODEL: 404}.get(e.code, 400), e.message)
            except Exception as e:  # a bug costs this request, never the HTTP thread
                logger.exception("internal error answering a query")
                server.metrics.errors.labels(code=p.ErrorCode.INTERNAL.value).inc()
                self._error(500, f"{type(e).__name__}: {e}")

        def do_PUT(self) -> None:
            if self._not_cross_site():
                self._not_served()

        def do_DELETE(self) -> None:
            if self._not_cross_site():
                self._not_served()

        def _not_cross_site(self) -> bool:
            """False, once answered 403 or 415, for a request a browser page of another origin
            could have sent: one carrying a foreign ``Origin`` or ``Sec-Fetch-Site``, or a body
            that is not JSON (a page may post text/plain or a form anywhere without asking);
            a chunked body (no Content-Length: never read, so never JSON here) is answered 411."""
            origin = self.headers.get("Origin")
            site = self.headers.get("Sec-Fetch-Site")
            refusal = None
            if origin is not None and not same_origin(origin, host, httpd.server_address[1]):
                refusal = 403, f"cross-site request refused (Origin {origin[:64]!r} is not this server)"
            elif site is not None and site.strip().lower() not in SAFE_FETCH_SITES:
                refusal = 403, f"cross-site request refused (Sec-Fetch-Site: {site[:32]})"
            elif self.headers.get("Transfer-Encoding") is not None:
                refusal = 411, "send the body with Content-Length, not Transfer-Encoding"
            elif _has_body(self.headers.get("Content-Length")) and self.headers.get_content_type() != JSON_TYPE:
                refusal = 415, (f"a body must be Content-Type: {JSON_TYPE}, not "
                                f"{(self.headers.get('Content-Type') or 'none')[:64]!r} (curl: -H 'Content-Type: "
                                f"{JSON_TYPE}')")
            if refusal is None:
                return True
            if refusal[0] != 411:
                server.metrics.errors.labels(code="http_cross_site").inc()
            self.close_connection = True  # the body, if any, is left unread
            self._error(*refusal, {"Connection": "close"})
            return False

        def _not_served(self) -> None:
            path = urlparse(self.path).path
            if path == "/quota" or path.startswith("/quota/"):
                self._error(501, QUOTA_REFUSAL)
            else:
                self._error(405 if path in ("/", "/healthcheck", "/status", "/conf", "/config", "/metrics",
                                            *VERSION_PATHS, *CLEAR_PATHS, *QUERY_PATHS)
                            else 404, f"no {self.command} {path}")

        def _body(self, max_bytes: int = MAX_BODY_BYTES) -> dict | None:
            """The request's JSON object ({} without a body); None once answered 400/413."""
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > max_bytes:
                self.close_connection = True  # the body is left unread
                self._error(413 if length > 0 else 400, f"body must be a JSON object of at most {max_bytes} bytes")
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
            """True if no token is configured or the request bears it; else answers 401.
            Without a token (loopback only), a request naming another host is refused with
            421: a DNS-rebinding page (its own name resolving to 127.0.0.1) could otherwise
            read /status (namespace names) from a browser on this host."""
            token = server.config.auth_token
            if token is None and not self._host_is_ours():
                server.metrics.errors.labels(code="http_cross_site").inc()
                self._error(421, "this server answers requests for loopback names or its own address only")
                return False
            if token is None or request_token_matches(self.headers.get("Authorization"),
                                                      self.headers.get(LMCACHE_KEY_HEADER), token):
                return True
            server.metrics.errors.labels(code="unauthorized").inc()
            self._error(401, f"this endpoint needs Authorization: Bearer <token> or {LMCACHE_KEY_HEADER}: <token> "
                             "(server started with --auth-token-file, --api-key-file or LMCACHE_API_KEY[_FILE])",
                        {"WWW-Authenticate": 'Bearer realm="glm-cache-server"'})
            return False

        def _host_is_ours(self) -> bool:
            if not is_loopback(host):
                return True  # bound beyond loopback (--insecure-no-auth): any name may reach it
            given = self.headers.get("Host")
            if given is None:
                return True  # HTTP/1.0 clients send none; a browser always does
            try:
                name = urlsplit("//" + given.strip()).hostname
            except ValueError:
                return False
            return name is not None and (is_loopback(name) or name == host.strip("[]").lower())

        def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._send(code, "application/json", json.dumps({"error": message}).encode(), headers)

        def _send(self, code: int, content_type: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.connection.settimeout(timeout_s)  # reading left it at what remained of the deadline
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
    server_class = _HTTPServer6 if ":" in h else BoundedHTTPServer
    httpd = server_class((h, port), Handler, max_connections=server.config.http_max_connections,
                         timeout_s=timeout_s, on_refusal=lambda code: server.metrics.errors.labels(code=code).inc())
    threading.Thread(target=httpd.serve_forever, name="glm-cache-http", daemon=True).start()
    return httpd
