"""Shared-secret authentication of glm-cache-server, used by the server, its CLI and the client.

One global token: whoever holds it may read, write and clear every namespace; whoever does
not may do nothing but ``/healthcheck`` and ``/metrics``. The token travels in clear text
(the ``auth`` header field on ZMQ, ``Authorization: Bearer`` on HTTP), so on a network
others can sniff it only protects together with a private network or a tunnel.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from pathlib import Path

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
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise TokenFileError(f"{what} in {str(p)!r} must be one word of printable ASCII "
                             "(no spaces, no control characters)")
    if len(token) < min_chars:
        raise TokenFileError(f"{what} in {str(p)!r} has {len(token)} characters; use at least "
                             f"{min_chars}, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


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
