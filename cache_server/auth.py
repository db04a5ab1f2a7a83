"""Shared-secret authentication of glm-cache-server, used by the server, its CLI and the client.

One global token: whoever holds it may read, write and clear every namespace; whoever does
not may do nothing but ``/healthcheck`` and ``/metrics``. On ZMQ it is checked twice: at
connection (the PLAIN mechanism's password, :class:`ZapHandler`), so a peer without it is
disconnected before the server reads any of its messages, and in every request (the
``auth`` header field). The token travels in clear text (PLAIN, the header,
``Authorization: Bearer`` on HTTP), so on a network others can sniff it only protects
together with a private network or a tunnel.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq

AUTH_FIELD = "auth"  # request header field carrying the token
MIN_TOKEN_CHARS = 16  # a shorter secret is guessable by a client that may retry freely
# The L2 secret can be attacked offline (guesses checked against values read from the store,
# no server involved), so it must be longer.
MIN_L2_SECRET_CHARS = 32


class TokenFileError(ValueError):
    """A token file that cannot be used; the message says why and what to do."""


def read_token_file(path: str | os.PathLike[str], what: str = "auth token",
                    min_chars: int = MIN_TOKEN_CHARS) -> str:
    """The token held in ``path``, surrounding whitespace stripped (``what`` names it in
    errors: the L2 secret is read the same way, with ``min_chars`` :data:`MIN_L2_SECRET_CHARS`).

    Refuses (``TokenFileError``) a missing or unreadable file, an empty one, a token shorter
    than ``min_chars`` and one with characters an HTTP header cannot carry, so a typo fails
    at start-up instead of as a stream of ``unauthorized`` replies. No message shows the
    file's content.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise TokenFileError(f"cannot read {what} file {str(p)!r}: {e.strerror or e}") from None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError(f"{what} file {str(p)!r} must hold printable ASCII") from None
    if not token:
        raise TokenFileError(f"{what} file {str(p)!r} is empty")
    return checked_token(token, f"{what} in {str(p)!r}", min_chars)


def checked_token(token: str, where: str, min_chars: int = MIN_TOKEN_CHARS) -> str:
    """``token`` (stripped) if it is one word of printable ASCII at least ``min_chars`` long;
    else ``TokenFileError`` naming ``where`` it came from (never the token itself)."""
    token = token.strip()
    if not token:
        raise TokenFileError(f"{where} is empty")
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise TokenFileError(f"{where} must be one word of printable ASCII "
                             "(no spaces, no control characters)")
    if len(token) < min_chars:
        raise TokenFileError(f"{where} has {len(token)} characters; use at least "
                             f"{min_chars}, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


# --- LMCache 0.5.7's API-key sources (lmcache/security/api_key.py), mapped onto our token ---------

LMCACHE_API_KEY_ENV = "LMCACHE_API_KEY"
LMCACHE_API_KEY_FILE_ENV = "LMCACHE_API_KEY_FILE"
LMCACHE_HTTP_API_KEY_ENV = "LMCACHE_HTTP_API_KEY"  # LMCache's legacy names, read only when
LMCACHE_HTTP_API_KEY_FILE_ENV = "LMCACHE_HTTP_API_KEY_FILE"  # the new one is unset or empty
LMCACHE_KEY_HEADER = "X-LMCache-API-Key"  # LMCache's second header, beside Authorization: Bearer


def lmcache_key_variables(environ: Mapping[str, str]) -> tuple[str, str, list[str]]:
    """LMCache's choice among its key variables: the value variable and the file variable it
    reads (``LMCACHE_API_KEY[_FILE]``, or the legacy ``LMCACHE_HTTP_API_KEY[_FILE]`` when the
    new one is unset or empty), and the legacy ones set but shadowed by the new ones."""
    value_var = LMCACHE_API_KEY_ENV if environ.get(LMCACHE_API_KEY_ENV) else LMCACHE_HTTP_API_KEY_ENV
    file_var = LMCACHE_API_KEY_FILE_ENV if environ.get(LMCACHE_API_KEY_FILE_ENV) else LMCACHE_HTTP_API_KEY_FILE_ENV
    shadowed = [legacy for legacy, new in ((LMCACHE_HTTP_API_KEY_ENV, value_var),
                                           (LMCACHE_HTTP_API_KEY_FILE_ENV, file_var))
                if new != legacy and environ.get(legacy)]
    return value_var, file_var, shadowed


def lmcache_api_keys(key_files: Sequence[str], environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The keys LMCache 0.5.7 would accept, as ``(source, key)`` in its order: each
    ``--api-key-file``/``--http-api-key-file``, then the file the key-file variable names,
    then the key variable's value (empty variables count as unset, as in LMCache). Each is
    held to our token rules (``TokenFileError`` names its source, never its value)."""
    value_var, file_var, _ = lmcache_key_variables(environ)
    sources = [(f"--api-key-file {path}", path) for path in key_files]
    if environ.get(file_var):
        sources.append((f"{file_var}={environ[file_var]}", environ[file_var]))
    keys = [(source, read_token_file(path, "API key")) for source, path in sources]
    if environ.get(value_var):
        keys.append((value_var, checked_token(environ[value_var], f"the API key in {value_var}")))
    return keys


def request_token_matches(authorization: str | None, lmcache_key: str | None, expected: str) -> bool:
    """Whether an HTTP request bears the token, as ``Authorization: Bearer <token>`` or
    LMCache's ``X-LMCache-API-Key: <token>`` (either one right suffices, as in LMCache)."""
    return bearer_matches(authorization, expected) or (
        lmcache_key is not None and token_matches(lmcache_key.strip(), expected))


def world_readable(path: str | os.PathLike[str]) -> bool:
    """Whether any local user may read ``path`` (worth a warning, not a refusal: container
    secret mounts are commonly 0444 or 0644 in a single-user container)."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def token_matches(given: object, expected: str) -> bool:
    """Constant-time comparison; anything but a string is a mismatch."""
    if isinstance(given, bytes):
        given_bytes = given
    elif isinstance(given, str):
        given_bytes = given.encode("utf-8", "replace")
    else:
        return False
    return hmac.compare_digest(given_bytes, expected.encode("ascii"))


def bearer_matches(header_value: str | None, expected: str) -> bool:
    """Whether an HTTP ``Authorization`` header is ``Bearer <expected>``."""
    if not header_value:
        return False
    scheme, _, credentials = header_value.strip().partition(" ")
    return scheme.lower() == "bearer" and token_matches(credentials.strip(), expected)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the sockets reachable from this machine only.

    Hostnames other than ``localhost`` count as not loopback: what they resolve to is
    outside our control. ``*`` and ``0.0.0.0`` are every interface.
    """
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


# --- ZMQ: refusing peers without the token at connection -----------------------------------

PLAIN_USERNAME = b"glm-cache"  # the PLAIN user name clients send; only the password (the token) is checked
ZAP_DOMAIN = b"glm-cache-server"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler


class ZapHandler:
    """ZMQ's ZAP handler for a server with a token: a peer connecting with the PLAIN
    mechanism is accepted when its password is the token, and refused otherwise; a peer
    without PLAIN (no token: ZMQ's NULL mechanism) is refused by libzmq at the greeting.
    Either way the peer is disconnected in the handshake, before libzmq reads any message
    of it: MAXMSGSIZE bounds one frame, not a message, so a peer allowed to send could make
    the server buffer any number of frames before the token in its header is seen.

    One thread answers ZAP requests and reports refusals (``on_refusal(reason)``): ``token``
    for a PLAIN handshake with another password (exactly one a refused connection attempt),
    ``mechanism`` for a handshake that failed otherwise, which the server's connection gate
    learns from its monitor of the server socket (:mod:`cache_server.conn_gate`): a peer
    without a token, which libzmq retries every 100 ms, and on a mismatch the peer that sees
    it first closes, so the other side often learns no reason: one or more a refused client.
    Bind it before the server socket accepts connections: without a handler, PLAIN
    handshakes fail."""

    def __init__(self, ctx: zmq.Context[Any], token: str, on_refusal: Callable[[str], None]) -> None:
        import zmq

        self._zmq = zmq
        self._token = token
        self._on_refusal = on_refusal
        self._ctx = ctx
        self._rep = ctx.socket(zmq.REP)
        self._rep.setsockopt(zmq.LINGER, 0)
        self._rep.bind(_ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glm-zap", daemon=True)

    @staticmethod
    def configure(sock: Any) -> None:
        """Make ``sock`` (the server's ROUTER, before it binds) a PLAIN server under our domain."""
        sock.plain_server = True
        sock.zap_domain = ZAP_DOMAIN

    def start(self) -> None:
        """Start answering ZAP requests."""
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            try:
                if self._rep.poll(100):
                    self._answer(self._rep.recv_multipart())
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                raise

    def _answer(self, request: list[bytes]) -> None:
        """Reply to one ZAP request (RFC 27): 200 for PLAIN with the token, 400 otherwise."""
        version, request_id = (request + [b"", b""])[:2]
        mechanism = request[5] if len(request) > 5 else b""
        password = request[7] if mechanism == b"PLAIN" and len(request) > 7 else None
        ok = version == b"1.0" and password is not None and token_matches(password, self._token)
        if not ok:
            self._on_refusal("token")
        self._rep.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                  b"OK" if ok else b"wrong token", b"" if not ok else PLAIN_USERNAME, b""])

    def close(self) -> None:
        """Stop the thread and close its sockets (before the context terminates)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._rep.close(linger=0)
