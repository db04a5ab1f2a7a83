"""Chunk keys: LMCache's blake3 hash chain over whole chunks of token ids.

``h_0 = NONE_HASH`` and ``h_i = blake3(h_{i-1} || tokens of chunk i as big-endian uint32)``,
where ``NONE_HASH = blake3(int64_be(0) || uint32_be(0))`` (LMCache's ``hash_func((0, (0,),
None))``). Only whole chunks are hashed; a partial last chunk has no key.

A ``cache_salt`` replaces the chain's seed with ``blake3(NONE_HASH || b"cache_salt:" ||
salt)``, so the same tokens under different salts share no key at any depth. Without a
salt the chain is exactly LMCache's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from blake3 import blake3

NONE_HASH: bytes = blake3(struct.pack(">q", 0) + struct.pack(">I", 0)).digest()
_SALT_TAG = b"cache_salt:"


def chain_seed(cache_salt: str | None = None) -> bytes:
    """The hash the chain starts from: NONE_HASH, or a salted variant of it."""
    if not cache_salt:
        return NONE_HASH
    return blake3(NONE_HASH + _SALT_TAG + cache_salt.encode("utf-8")).digest()


def chunk_hashes(token_ids: Sequence[int], chunk_size: int, cache_salt: str | None = None) -> list[bytes]:
    """One 32-byte hash per whole chunk of ``token_ids``, each covering the whole prefix."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    n_chunks = len(token_ids) // chunk_size
    prev = chain_seed(cache_salt)
    hashes: list[bytes] = []
    for i in range(n_chunks):
        chunk = token_ids[i * chunk_size:(i + 1) * chunk_size]
        try:
            data = struct.pack(f">{chunk_size}I", *chunk)
        except struct.error as e:
            raise ValueError(f"token ids must fit in uint32: {e}") from None
        prev = blake3(prev + data).digest()
        hashes.append(prev)
    return hashes
