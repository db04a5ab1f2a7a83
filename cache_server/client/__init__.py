"""Client of glm-cache-server, with timeouts: a dead or absent server raises within the
timeout, never hangs the caller; on the server's host, payloads move through shared memory.

This is the package's public face: import from here. Its parts:

- :mod:`~cache_server.client.connection`: the socket, its handshake, one deadline per call,
  and requests that timed out (pending for their late replies).
- :mod:`~cache_server.client.operations`: :class:`CacheClient`, the operations on it.
- :mod:`~cache_server.client.verify`: a get's reply checked before the caller sees it
  (arena placements, checksums), and :class:`InPlace`.
- :mod:`~cache_server.client.segments`: the client's same-host shared-memory segments.
- :mod:`~cache_server.client.errors`: what a call raises when the server cannot serve it.
"""

from cache_server.client.connection import OUTCOMES, PENDING_HORIZON_S, Payload
from cache_server.client.errors import CLIENT_ERRORS, CacheServerError, CacheServerUnavailable, unauthorized
from cache_server.client.operations import CacheClient, label_salt
from cache_server.client.verify import InPlace

__all__ = ["CLIENT_ERRORS", "OUTCOMES", "PENDING_HORIZON_S", "CacheClient", "CacheServerError", "CacheServerUnavailable",
           "InPlace", "Payload", "label_salt", "unauthorized"]
