"""What the L2 tier stores under each key: ``header || payload``, and the namespace tag of
the key itself.

The header carries a magic, a digest of the full key (namespace, hash, group, rank: a value
under the wrong key is refused), the object's checksum as its storing client wrote it
(``protocol.checksum``), the ``prev`` link and the chunk-tree ``parent``, so a promoted
prefix is placed in its namespace's chunk tree and counts as resumable (and is retained as
such) at once. Formats, all still read: 1 has no parent (it promotes with the parent
unknown, as a put that does not say it); 1 and 2 carry protocol v2's blake3 checksum (they
are verified with it and promoted with protocol v3's); 3 is written. Decoding recomputes
the payload's checksum, so a value that fails it is refused (the tier counts it, deletes it
from L2 and treats the object as absent); the checksum goes into L1 with the object, so
the loading client checks it again.

A key's namespace part is the first 16 bytes of blake3(namespace) in hex: namespaces are
long engine fingerprints, and a tag keeps keys short and free of separators.
"""

from __future__ import annotations

from blake3 import blake3

from cache_server import protocol as p
from cache_server.store import UNKNOWN_PARENT, StoreKey

MAGIC_V1 = b"GL2\x01"  # magic, key digest, checksum, prev
MAGIC_V2 = b"GL2\x02"  # ... and the chunk-tree parent (tag byte: 0 unknown, 1 none: the first chunk, 2 a hash)
MAGIC = b"GL2\x03"  # as format 2, the checksum being protocol v3's (XXH3-128; formats 1-2: blake3)
KEY_DIGEST_BYTES = 8
HEADER_BYTES_V1 = len(MAGIC) + KEY_DIGEST_BYTES + p.CHECKSUM_BYTES + 1 + p.HASH_BYTES
HEADER_BYTES = HEADER_BYTES_V1 + 1 + p.HASH_BYTES


def namespace_tag(namespace: str) -> str:
    """The namespace's part of an L2 key."""
    return blake3(namespace.encode()).digest(16).hex()


def key_digest(key: StoreKey) -> bytes:
    """The digest of the full key a value carries, so a value under another key is refused."""
    ns, digest, group, rank = key
    return blake3(b"%s\0%s\0%d\0%d" % (ns.encode(), digest, group, rank)).digest(KEY_DIGEST_BYTES)


def encode_value(key: StoreKey, payload: bytes | memoryview, checksum: bytes, prev: bytes | None,
                 parent: bytes | None = UNKNOWN_PARENT) -> bytes:
    """``header || payload`` (one copy, on the writer thread). ``parent`` as the store's
    ``put`` takes it: a hash, None (the first chunk) or :data:`UNKNOWN_PARENT`."""
    if len(checksum) != p.CHECKSUM_BYTES:
        raise ValueError("checksum must be CHECKSUM_BYTES long")
    if parent is not None and parent != UNKNOWN_PARENT and len(parent) != p.HASH_BYTES:
        raise ValueError("parent must be a HASH_BYTES hash, None or UNKNOWN_PARENT")
    tail = (b"\1" + prev) if prev is not None else b"\0" + bytes(p.HASH_BYTES)
    up = b"\1" + bytes(p.HASH_BYTES) if parent is None else \
        b"\0" + bytes(p.HASH_BYTES) if parent == UNKNOWN_PARENT else b"\2" + parent
    return b"".join((MAGIC, key_digest(key), checksum, tail, up, payload))


def decode_value(key: StoreKey, value: bytes) -> tuple[memoryview, bytes, bytes | None, bytes | None] | str:
    """``(payload, checksum, prev, parent)`` of a verified value, or why it was refused.
    Format-1 values (no parent) decode with the parent :data:`UNKNOWN_PARENT`."""
    view = memoryview(value)
    magic = bytes(view[:len(MAGIC)])
    header = {MAGIC: HEADER_BYTES, MAGIC_V2: HEADER_BYTES, MAGIC_V1: HEADER_BYTES_V1}.get(magic)
    if header is None or len(value) < header:
        return "format"
    at = len(MAGIC)
    if view[at:at + KEY_DIGEST_BYTES] != key_digest(key):
        return "format"
    at += KEY_DIGEST_BYTES
    checksum = bytes(view[at:at + p.CHECKSUM_BYTES])
    at += p.CHECKSUM_BYTES
    prev = bytes(view[at + 1:at + 1 + p.HASH_BYTES]) if view[at] else None
    at += 1 + p.HASH_BYTES
    parent: bytes | None = UNKNOWN_PARENT
    if header == HEADER_BYTES:
        tag = view[at]
        if tag > 2:
            return "format"
        parent = None if tag == 1 else bytes(view[at + 1:at + 1 + p.HASH_BYTES]) if tag == 2 else UNKNOWN_PARENT
    payload = view[header:]
    if magic != MAGIC:
        # Written by a server of protocol v2: its checksum is blake3's. Verified with that,
        # the payload gets protocol v3's checksum, which the loading client checks again.
        if blake3(payload).digest(length=p.CHECKSUM_BYTES) != checksum:
            return "checksum"
        return payload, p.checksum(payload), prev, parent
    if p.checksum(payload) != checksum:
        return "checksum"
    return payload, checksum, prev, parent
