"""Chunk keys: what names a chunk of a request's prefix (the key functions both sides use).

An object is found under (namespace, chunk key, group, rank); the namespace is
:mod:`connector.namespace`. A chunk key names the chunk's whole prefix, from one of two
schemes (chosen by :func:`connector.namespace.choose_key_scheme`): vLLM's own block hash at
the chunk's end, or LMCache's blake3 hash chain over whole chunks of token ids, below.

``h_0 = NONE_HASH`` and ``h_i = blake3(h_{i-1} || tokens of chunk i as big-endian uint32)``,
where ``NONE_HASH = blake3(int64_be(0) || uint32_be(0))`` (LMCache's ``hash_func((0, (0,),
None))``). Only whole chunks are hashed; a partial last chunk has no key.

A ``cache_salt`` replaces the chain's seed with ``blake3(NONE_HASH || b"cache_salt:" ||
salt)``, so the same tokens under different salts share no key at any depth. Without a
salt the chain is exactly LMCache's.

Tokens are packed with ``array.array`` (one C loop over the list, then one byte swap;
``struct.pack`` of Python ints was most of the cost) and each chunk is hashed from a
slice of that buffer; a chain already computed for a prefix is extended, never
recomputed (:func:`extend_chunk_hashes`).

With a drafter whose cache rows depend on the L tokens after their position (EAGLE, MTP:
L = 1), each key also covers the L tokens after its chunk (:func:`lookahead_keys`).
Under vLLM's block hashes, image requests are cached too: the keys of the chunks an image
reaches also name its processed pixels (:mod:`connector.media`).

They live on the server's side of the border because both sides derive keys: the connector
for its requests (:mod:`connector.keys` keeps what is about vLLM's requests), the server for
a router's prompt (:mod:`cache_server.prefix_query`).
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence

from blake3 import blake3

NONE_HASH: bytes = blake3(struct.pack(">q", 0) + struct.pack(">I", 0)).digest()
_SALT_TAG = b"cache_salt:"
# A 4-byte unsigned array type ("I" on every platform we run on; "L" where int is 2 bytes).
_U32 = next(t for t in ("I", "L") if array.array(t).itemsize == 4)


def chain_seed(cache_salt: str | None = None) -> bytes:
    """The hash the chain starts from: NONE_HASH, or a salted variant of it."""
    if not cache_salt:
        return NONE_HASH
    return blake3(NONE_HASH + _SALT_TAG + cache_salt.encode("utf-8")).digest()


def _pack_be_u32(token_ids: Sequence[int]) -> memoryview:
    """``token_ids`` as big-endian uint32 bytes (a byte view of the packed array: no
    second 4-bytes-per-token copy); ValueError for ids outside uint32."""
    if not isinstance(token_ids, (list, tuple)):
        token_ids = list(token_ids)  # vLLM's ConstantList and other sequences
    try:
        packed = array.array(_U32, token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must fit in uint32: {e}") from None
    if sys.byteorder == "little":
        packed.byteswap()
    return memoryview(packed).cast("B")


def extend_chunk_hashes(hashes: list[bytes], token_ids: Sequence[int], chunk_size: int,
                        cache_salt: str | None = None, max_chunks: int | None = None) -> list[bytes]:
    """Append to ``hashes`` (the chain of the first ``len(hashes)`` chunks of ``token_ids``
    under ``cache_salt``) the hashes of every further whole chunk, up to ``max_chunks`` in
    all; returns ``hashes``. Only the new chunks' tokens are packed and hashed."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    done = len(hashes)
    n_chunks = len(token_ids) // chunk_size
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks <= done:
        return hashes
    begin, end = done * chunk_size, n_chunks * chunk_size
    if isinstance(token_ids, list) and len(token_ids) - (end - begin) < min(end - begin, 4 * chunk_size):
        # Little of the list lies outside the chunks to hash (at most a few chunks before
        # them, a partial chunk after): packing it whole saves copying every item
        # reference into a slice first; the rest is cut off the bytes.
        try:
            data = _pack_be_u32(token_ids)[4 * begin:4 * end]
        except ValueError:  # an invalid id, maybe outside the chunks: the exact path says
            data = _pack_be_u32(token_ids[begin:end])
    else:
        data = _pack_be_u32(token_ids[begin:end])
    step = 4 * chunk_size
    prev = hashes[-1] if hashes else chain_seed(cache_salt)
    append = hashes.append
    for off in range(0, len(data), step):
        # One contiguous input per chunk (prev + a view of the chunk): measured faster
        # than two update() calls, and than slicing the bytes.
        prev = blake3(prev + data[off:off + step]).digest()
        append(prev)
    return hashes


def chunk_hashes(token_ids: Sequence[int], chunk_size: int, cache_salt: str | None = None) -> list[bytes]:
    """One 32-byte hash per whole chunk of ``token_ids``, each covering the whole prefix."""
    return extend_chunk_hashes([], token_ids, chunk_size, cache_salt)


_GRID_TAG = b"glm-cache-grid:"


def block_hash_keys(block_hashes: Sequence[bytes], chunk_size: int, span: int, start: int,
                    n_chunks: int) -> list[bytes]:
    """``chunk_keys: vllm``: the keys of chunks ``start`` up to ``n_chunks`` (as far as
    vLLM has hashed), from vLLM's block hash at each chunk's end (``span`` tokens per block
    hash, dividing ``chunk_size``). vLLM's hash names a position, not a chunk: the key binds
    it to the chunk size, so chunks of two grids ending at one token never share a key
    (engines or servers of different chunk sizes never load each other's objects)."""
    per_chunk = chunk_size // span
    end = min(n_chunks, len(block_hashes) // per_chunk)
    grid = _GRID_TAG + chunk_size.to_bytes(4, "big")
    return [blake3(grid + block_hashes[(k + 1) * per_chunk - 1]).digest() for k in range(start, end)]


_LOOKAHEAD_TAG = b"glm-cache-lookahead:"


def lookahead_keys(plain: Sequence[bytes], token_ids: Sequence[int], chunk_size: int, lookahead: int,
                   start: int, end: int) -> list[bytes]:
    """The keys of chunks ``start`` up to ``end`` for a drafter with ``lookahead`` L > 0:
    ``key'_j = blake3(b"glm-cache-lookahead:" || uint32_be(L) || key_j || tokens[(j+1)C :
    (j+1)C+L] as big-endian uint32)``, where ``key_j`` is the chunk's key without drafts
    (``plain[j]``, of either scheme).

    A draft layer's row at position p is computed from token p + 1 (up to p + L): the
    chunk's last rows depend on the first L tokens after it, which ``key_j`` (a hash of
    the prefix up to the chunk's end) does not cover. Two prompts forking exactly at the
    chunk's end have the same ``key_j`` but different rows; ``key'_j`` tells them apart.
    ``token_ids`` must hold the L tokens after chunk ``end - 1``."""
    need = end * chunk_size + lookahead
    if len(token_ids) < need:
        raise ValueError(f"the lookahead of chunk {end - 1} needs {need} tokens, got {len(token_ids)}")
    tag = _LOOKAHEAD_TAG + lookahead.to_bytes(4, "big")
    keys = []
    for j in range(start, end):
        after = (j + 1) * chunk_size
        keys.append(blake3(tag + plain[j] + _pack_be_u32(token_ids[after:after + lookahead])).digest())
    return keys


_MEDIA_TAG = b"glm-cache-media:"


def media_keys(keys: Sequence[bytes], media: Sequence[tuple[int, bytes]], chunk_size: int,
               start: int) -> list[bytes]:
    """Keys of chunks ``start, start + 1, ...`` (``keys`` are the scheme's keys of those
    chunks) with the media before each chunk's end mixed in: a chunk ending at or before
    the first image keeps its key (its bytes are text only, shared with text prompts);
    every later one becomes ``blake3(b"glm-cache-media:" || key || digest_1 || ...)`` over
    the items whose first placeholder lies before the chunk's end."""
    out = []
    for i, key in enumerate(keys):
        end = (start + i + 1) * chunk_size
        before = [d for off, d in media if off < end]
        out.append(blake3(_MEDIA_TAG + key + b"".join(before)).digest() if before else key)
    return out


def parent_of(hashes: list[bytes], k: int) -> bytes | None:
    """The chunk key before chunk ``k`` of a chain (None for the first chunk)."""
    return hashes[k - 1] if k > 0 else None
