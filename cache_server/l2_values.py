"""What the L2 tier stores under each key: ``header || payload``, authenticated with a key
only the servers hold; and the namespace tag of the key itself.

A value (format 4, the only one read) is::

    MAGIC | checksum (16) | prev (1 + 32) | parent (1 + 32) | MAC (32) | payload

``checksum`` is the object's checksum as its storing client wrote it
(:func:`cache_server.protocol.checksum`, which covers the key), ``prev`` the previous state
of the same path (tag 0: none, 1: a hash), ``parent`` the chunk-tree parent (tag 0:
unknown, 1: none, the first chunk, 2: a hash), so a promoted prefix is placed in its
namespace's chunk tree and counts as resumable (and is retained as such) at once.

``MAC`` is keyed blake3 (a PRF, so a MAC; about 4 GB/s on one core here, against 1.6 GB/s
for HMAC-SHA256) under :func:`mac_key` of the servers' shared ``--l2-secret-file``, over the
full key (namespace, chunk hash, group, rank, encoded as the checksum encodes them), the
header before the MAC, and the payload. Whoever can write to the store but lacks the
secret cannot make a value that decodes: neither a forged one (built from a namespace and
a public chunk hash) nor a replayed one (a valid value of another key copied under this
one). Decoding checks the magic (``format``), then the MAC (``auth``), then the payload's
checksum for this key (``checksum``: a storing client's wrong sum); the tier counts a
refusal by that reason, deletes the value and treats the object as absent. The values of
earlier formats (1-3, unauthenticated) are refused as ``format``. The checksum goes into L1
with the object, so the loading client checks it again.

It is integrity, not confidentiality: payloads are stored in the clear (see
docs/operating.md, "L2", for why not AEAD).

A key's namespace part is the first 16 bytes of blake3(namespace) in hex: namespaces are
long engine fingerprints, and a tag keeps keys short and free of separators.
"""

from __future__ import annotations

import hmac

from blake3 import blake3

from cache_server import protocol as p
from cache_server.chunk_tree import UNKNOWN_PARENT
from cache_server.layout import StoreKey

MAGIC = b"GL2\x04"
MAC_BYTES = 32
MAC_CONTEXT = "glm-cache-server L2 value MAC, format 4"  # blake3 derive_key context: the key is for this only
HEADER_BYTES = len(MAGIC) + p.CHECKSUM_BYTES + 2 * (1 + p.HASH_BYTES) + MAC_BYTES
_MAC_AT = HEADER_BYTES - MAC_BYTES


def namespace_tag(namespace: str) -> str:
    """The namespace's part of an L2 key."""
    return blake3(namespace.encode()).digest(16).hex()


def mac_key(secret: bytes) -> bytes:
    """The 32-byte MAC key of a shared secret (``--l2-secret-file``)."""
    if not secret:
        raise ValueError("the L2 secret is empty")
    return blake3(secret, derive_key_context=MAC_CONTEXT).digest()


def value_mac(key_bytes: bytes, key: StoreKey, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """The MAC of a value: keyed blake3 over the full key, the header before the MAC and the payload."""
    ns, digest, group, rank = key
    h = blake3(p.key_prefix(ns, (digest, group, rank)), key=key_bytes)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode_value(key: StoreKey, payload: bytes | memoryview, checksum: bytes, prev: bytes | None,
                 parent: bytes | None = UNKNOWN_PARENT, *, key_bytes: bytes) -> bytes:
    """``header || payload`` (one copy, on the writer thread), authenticated under
    ``key_bytes`` (:func:`mac_key`). ``parent`` as the store's ``put`` takes it: a hash,
    None (the first chunk) or :data:`UNKNOWN_PARENT`."""
    if len(checksum) != p.CHECKSUM_BYTES:
        raise ValueError("checksum must be CHECKSUM_BYTES long")
    if parent is not None and parent != UNKNOWN_PARENT and len(parent) != p.HASH_BYTES:
        raise ValueError("parent must be a HASH_BYTES hash, None or UNKNOWN_PARENT")
    tail = (b"\1" + prev) if prev is not None else b"\0" + bytes(p.HASH_BYTES)
    up = b"\1" + bytes(p.HASH_BYTES) if parent is None else \
        b"\0" + bytes(p.HASH_BYTES) if parent == UNKNOWN_PARENT else b"\2" + parent
    header = b"".join((MAGIC, checksum, tail, up))
    return b"".join((header, value_mac(key_bytes, key, header, payload), payload))


def decode_value(key: StoreKey, value: bytes, *, key_bytes: bytes
                 ) -> tuple[memoryview, bytes, bytes | None, bytes | None] | str:
    """``(payload, checksum, prev, parent)`` of a value that is ``key``'s and authentic, or
    why it was refused: ``format`` (not format 4, or malformed), ``auth`` (its MAC is not
    this key's under ``key_bytes``: forged, replayed from another key, or altered) or
    ``checksum`` (authentic, but its payload does not match the checksum stored with it)."""
    view = memoryview(value)
    if len(value) < HEADER_BYTES or bytes(view[:len(MAGIC)]) != MAGIC:
        return "format"
    header, payload = view[:_MAC_AT], view[HEADER_BYTES:]
    if not hmac.compare_digest(value_mac(key_bytes, key, header, payload), bytes(view[_MAC_AT:HEADER_BYTES])):
        return "auth"
    at = len(MAGIC)
    checksum = bytes(view[at:at + p.CHECKSUM_BYTES])
    at += p.CHECKSUM_BYTES
    if view[at] > 1 or view[at + 1 + p.HASH_BYTES] > 2:
        return "format"
    prev = bytes(view[at + 1:at + 1 + p.HASH_BYTES]) if view[at] else None
    at += 1 + p.HASH_BYTES
    tag = view[at]
    parent = None if tag == 1 else bytes(view[at + 1:at + 1 + p.HASH_BYTES]) if tag == 2 else UNKNOWN_PARENT
    ns, digest, group, rank = key
    if p.checksum(payload, ns, (digest, group, rank)) != checksum:
        return "checksum"
    return payload, checksum, prev, parent
