"""What a :class:`~cache_server.client.CacheClient` call raises when the server cannot serve
it (:mod:`cache_server.client` exports it all)."""

from __future__ import annotations

from cache_server import protocol as p


class CacheServerError(RuntimeError):
    """The server answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"glm-cache-server error [{code}]: {message}")
        self.code = code
        self.message = message


class CacheServerUnavailable(ConnectionError):
    """No reply within the timeout: the server is absent, dead or overloaded."""


# What a client call raises when the server cannot serve it: an error reply, no reply in
# time, or a socket error. Callers that serve without the cache on failure catch these.
CLIENT_ERRORS = (CacheServerUnavailable, CacheServerError, OSError)


def unauthorized(err: BaseException) -> bool:
    """True for the server's refusal of our token."""
    return isinstance(err, CacheServerError) and err.code == p.ErrorCode.UNAUTHORIZED.value
