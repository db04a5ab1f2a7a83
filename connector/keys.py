"""Chunk keys of vLLM's requests: the memo of recent prefixes' keys, and each request's
keys under one engine's key scheme, computed once and extended as it grows.

The key functions themselves (LMCache's blake3 chain over token ids, the grid key over
vLLM's block hashes, the lookahead and media keys) are :mod:`cache_server.chunk_keys`,
which the server uses too (a router's prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from cache_server.chunk_keys import block_hash_keys, extend_chunk_hashes, lookahead_keys, media_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from connector.namespace import KeyScheme


class ChunkMemo:
    """Token-chain keys of recently seen prefixes, keyed by vLLM's own block hash at the
    chunk's end, so a conversation's next turn does not hash its whole history again.

    vLLM hashes every request's blocks when it arrives (``Request.block_hashes``: a chain
    over the whole prefix, the cache salt included, that its prefix cache already trusts
    to identify the tokens), so a prefix whose end-of-chunk block hash was seen before has
    the same chunk key as then. Only chunks not seen are hashed from their tokens; the
    keys themselves do not change. Bounded (LRU); the scheduler thread alone uses it.
    Entries are plain bytes (key: vLLM's hash and the chunk size), which the garbage
    collector does not track: hundreds of tuples per admission set off collections
    costing milliseconds."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._max = max_entries

    @staticmethod
    def _vllm_hash(request: Request, C: int, k: int, span: int | None) -> bytes | None:
        """The memo key of chunk ``k``: vLLM's block hash at its end and the chunk size
        (None if not known)."""
        if span is None or C % span:
            return None
        i = (k + 1) * C // span - 1
        block_hashes = request.block_hashes
        vh = block_hashes[i] if i < len(block_hashes) else None
        return vh + C.to_bytes(4, "little") if isinstance(vh, bytes) else None

    def extend(self, hashes: list[bytes], request: Request, C: int, n_chunks: int, span: int | None) -> None:
        """Append the memo's keys for chunks ``len(hashes)`` onwards while it has them."""
        while len(hashes) < n_chunks:
            key = self._vllm_hash(request, C, len(hashes), span)
            ours = self.entries.get(key) if key is not None else None
            if ours is None:
                return
            self.entries.move_to_end(key)
            hashes.append(ours)

    def remember(self, hashes: list[bytes], request: Request, C: int, start: int, span: int | None) -> None:
        for k in range(start, len(hashes)):
            key = self._vllm_hash(request, C, k, span)
            if key is None:
                return
            self.entries[key] = hashes[k]
        while len(self.entries) > self._max:
            self.entries.popitem(last=False)


def request_tokens(request: Request, n_tokens: int) -> Sequence[int]:
    """Token ids covering the first ``n_tokens``: the prompt, a plain list, when they lie
    in it (``all_token_ids`` is a read-only view that copies on slicing)."""
    prompt = request.prompt_token_ids
    if isinstance(prompt, list) and len(prompt) >= n_tokens:
        return prompt
    return request.all_token_ids


class ChunkKeys:
    """Chunk keys of requests, under one engine's :class:`KeyScheme`.

    A request's keys are one list, computed once and extended as the request grows; the
    caller owns the list (one per request and chunk size). With a drafter whose rows look
    ``lookahead`` (L) tokens ahead, the keys are :func:`lookahead_keys` of the scheme's
    keys (the caller keeps those in a second list, ``plain``), and a chunk has a key only
    once the L tokens after it are known: a prompt ending exactly on a chunk's end gets
    that chunk's key (and so saves it) when the first generated token is in. Every group
    of a chunk uses the one key, KDA states included: their bytes hold no draft row, but
    the server resumes a prefix at chunk j only with the attention of chunks 0..j found
    under the same key chain, and the attention of chunk j needs the lookahead anyway."""

    def __init__(self, scheme: KeyScheme, hash_span: int | None, lookahead: int = 0) -> None:
        self.scheme = scheme
        self.memo = ChunkMemo()
        self._hash_span = hash_span  # vLLM's block hash span, for the memo (None: no memo)
        self.lookahead = lookahead

    def known_chunks(self, request: Request, C: int) -> int:
        """How many chunks of ``request`` can have a key now: its whole chunks, each
        followed by ``lookahead`` known tokens."""
        return max(0, (request.num_tokens - self.lookahead) // C)

    def extend(self, hashes: list[bytes], request: Request, C: int, n_chunks: int,
               memo_only: bool = False, plain: list[bytes] | None = None,
               media: Sequence[tuple[int, bytes]] | None = None) -> list[bytes]:
        """Extend ``hashes`` (the request's keys so far) to ``n_chunks`` keys where the
        request has the tokens; returns it. Token-chain chunks an earlier request already
        hashed (the previous turn of a conversation) come from the memo; ``memo_only``:
        nothing is hashed. With vLLM's block hashes, keys are read off
        ``request.block_hashes`` as far as vLLM has hashed, with ``media`` (the request's
        ``(offset, digest)`` items, :func:`connector.media.request_media`) mixed into the
        chunks they reach. With a lookahead, ``plain`` is the request's list of the
        scheme's own keys, extended here too."""
        if not self.lookahead:
            return self._extend_plain(hashes, request, C, n_chunks, memo_only, media)
        if plain is None:
            raise ValueError("chunk keys with a lookahead need the request's plain key list")
        n = min(n_chunks, self.known_chunks(request, C))
        if len(hashes) < n:
            self._extend_plain(plain, request, C, n, memo_only, media)
            end = min(n, len(plain))
            if end > len(hashes):
                tokens = request_tokens(request, end * C + self.lookahead)
                hashes.extend(lookahead_keys(plain, tokens, C, self.lookahead, len(hashes), end))
        return hashes

    def _extend_plain(self, hashes: list[bytes], request: Request, C: int, n_chunks: int,
                      memo_only: bool, media: Sequence[tuple[int, bytes]] | None = None) -> list[bytes]:
        span = self.scheme.span
        if span is not None:
            new = block_hash_keys(request.block_hashes, C, span, len(hashes), n_chunks)
            hashes.extend(media_keys(new, media, C, len(hashes)) if media else new)
            return hashes
        if len(hashes) < n_chunks:
            done = len(hashes)
            self.memo.extend(hashes, request, C, n_chunks, self._hash_span)
            if not memo_only:
                self.chain(request, C, n_chunks)(hashes)
                self.memo.remember(hashes, request, C, done, self._hash_span)
        return hashes

    def probe(self, hashes: list[bytes], request: Request, C: int, n_chunks: int,
              media: Sequence[tuple[int, bytes]] | None = None) -> tuple[list[bytes], Callable[[list[bytes]], list[bytes]]]:
        """For a probe of a prefix nobody here has hashed (:meth:`connector.remote.RemoteCache.probe`;
        keys without a lookahead): the first chunk's key, extended into ``hashes`` here, and
        what hashes the rest of the chain to ``n_chunks`` keys on the lookup thread."""
        return self._extend_plain(hashes, request, C, 1, False, media)[:1], self.chain(request, C, n_chunks)

    @staticmethod
    def chain(request: Request, C: int, n_chunks: int) -> Callable[[list[bytes]], list[bytes]]:
        """What extends a token chain of ``request`` (its first keys) to ``n_chunks`` keys,
        in place: the one place the request's cache salt enters its keys. The tokens are
        taken now; the hashing may run on another thread (the lookup thread's probe)."""
        tokens, salt = request_tokens(request, n_chunks * C), request.cache_salt
        return lambda hashes: extend_chunk_hashes(hashes, tokens, C, salt, max_chunks=n_chunks)

    def adopt(self, hashes: list[bytes], request: Request, C: int, computed: list[bytes]) -> None:
        """Take keys computed elsewhere (the lookup thread) for the same chain. The lookup
        thread hashes plain token chains only: with a lookahead nothing is adopted (the
        scheduler does not probe then)."""
        if self.lookahead:
            return
        if len(computed) > len(hashes):
            done = len(hashes)
            hashes.extend(computed[done:])
            self.memo.remember(hashes, request, C, done, self._hash_span)
