"""Chunk keys: LMCache's blake3 hash chain over whole chunks of token ids.

``h_0 = NONE_HASH`` and ``h_i = blake3(h_{i-1} || tokens of chunk i as big-endian uint32)``,
where ``NONE_HASH = blake3(int64_be(0) || uint32_be(0))`` (LMCache's ``hash_func((0, (0,),
None))``). Only whole chunks are hashed; a partial last chunk has no key.

A ``cache_salt`` replaces the chain's seed with ``blake3(NONE_HASH || b"cache_salt:" ||
salt)``, so the same tokens under different salts share no key at any depth. Without a
salt the chain is exactly LMCache's.

Cost (issue 10: 6.7 ms for a 300k-token prompt, most of it ``struct.pack`` of Python
ints). Tokens are packed with ``array.array`` (one C loop over the list, then one
byte swap) and each chunk is hashed from a slice of that buffer; a chain already
computed for a prefix is extended, never recomputed (:func:`extend_chunk_hashes`).
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


def block_hash_keys(block_hashes: Sequence[bytes], chunk_size: int, span: int, start: int,
                    n_chunks: int) -> list[bytes]:
    """``chunk_keys: vllm``: the keys of chunks ``start`` up to ``n_chunks`` (as far as
    vLLM has hashed), each vLLM's block hash at the chunk's end (``span`` tokens per block
    hash, dividing ``chunk_size``)."""
    per_chunk = chunk_size // span
    end = min(n_chunks, len(block_hashes) // per_chunk)
    return [bytes(block_hashes[(k + 1) * per_chunk - 1]) for k in range(start, end)]
