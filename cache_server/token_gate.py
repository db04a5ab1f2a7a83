"""The server's side of ``--auth-token-file``: the token checked at connection (a ZAP
handler, :class:`cache_server.auth.ZapHandler`) and in every request, and the refusals
counted and logged.

Checked per request as well as per connection: ROUTER_HANDOVER lets any peer take over a
routing identity, so an identity that once authenticated proves nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from cache_server import protocol as p
from cache_server.auth import AUTH_FIELD, ZapHandler, token_matches

if TYPE_CHECKING:
    import zmq

    from cache_server.metrics import ServerMetrics

logger = logging.getLogger("glm_cache_server")


class TokenGate:
    """Admits only peers and requests that present ``token``.

    Created before ``sock`` binds: a peer must present the token at connection too (PLAIN,
    checked by the ZAP handler), so one without it is disconnected before any of its
    frames is read."""

    def __init__(self, token: str, metrics: ServerMetrics, ctx: zmq.Context[Any], sock: zmq.Socket[Any]) -> None:
        self._token = token
        self._metrics = metrics
        metrics.errors.labels(code=p.ErrorCode.UNAUTHORIZED.value)  # exported as 0 from the start
        for reason in ("token", "mechanism"):
            metrics.refused_connections.labels(reason=reason)
        self._refused_since_log = 0
        self._refusal_logged_at = -float("inf")
        self._refusal_lock = threading.Lock()  # refusals are noted by workers and the ZAP thread
        self._zap = ZapHandler(ctx, token, self._note_connection_refusal)
        ZapHandler.configure(sock)
        self._zap.start()

    def note_handshake_failed(self) -> None:
        """A handshake failed on the mechanism (the connection gate's monitor saw it): a
        peer without the token."""
        self._note_connection_refusal("mechanism")

    def check(self, header: dict[str, Any]) -> None:
        """Refuse a request without the token, before it can read or change anything."""
        if not token_matches(header.get(AUTH_FIELD), self._token):
            self._note_refusal()
            raise p.ProtocolError(p.ErrorCode.UNAUTHORIZED,
                                  f"missing or wrong {AUTH_FIELD!r} token (server started with --auth-token-file)")

    def close(self) -> None:
        """Stop the ZAP handler (before the context terminates)."""
        self._zap.close()

    def _note_connection_refusal(self, reason: str) -> None:
        """A handshake refused (ZAP thread): ``token`` (a wrong one) or ``mechanism`` (none)."""
        self._metrics.refused_connections.labels(reason=reason).inc()
        self._note_refusal()

    def _note_refusal(self) -> None:
        """Say in the log that requests are being refused, at most once a minute (a
        misconfigured client retries often; the exact count is the errors metric)."""
        with self._refusal_lock:
            self._refused_since_log += 1
            now = time.monotonic()
            if now - self._refusal_logged_at < 60.0:
                return
            count, self._refused_since_log, self._refusal_logged_at = self._refused_since_log, 0, now
        logger.warning("refused %d unauthenticated connection(s) or request(s) (missing or wrong token)", count)
