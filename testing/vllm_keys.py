"""Chunk keys and vLLM requests built outside an engine, as vLLM's engine builds them:
for tests and validation scripts that must find the objects an engine saved."""

from __future__ import annotations

from collections.abc import Sequence

from cache_server.chunk_keys import block_hash_keys


def vllm_hashed_request(req_id: str, token_ids: Sequence[int], span: int, cache_salt: str | None = None,
                        algo: str = "sha256", max_tokens: int = 1, mm_features: list | None = None):
    """A ``vllm.v1.request.Request`` whose ``block_hashes`` vLLM's own block hasher computed
    on construction, every ``span`` tokens with ``algo``, as vLLM's engine does when a
    request arrives (under the same seed: PYTHONHASHSEED, if the engine had one)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    init_none_hash(fn)
    return Request(req_id, list(token_ids), SamplingParams(max_tokens=max_tokens), None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(span, fn), mm_features=mm_features)


def vllm_chunk_keys(token_ids: Sequence[int], chunk_size: int, span: int,
                    cache_salt: str | None = None, algo: str = "sha256") -> list[bytes]:
    """The keys ``chunk_keys: vllm`` gives the whole chunks of a prompt, computed outside
    an engine (tools, tests): vLLM's block hashes, every ``span`` tokens (the engine's
    ``hash_block_size``) with ``algo`` (its ``--prefix-caching-hash-algo``), taken at
    chunk ends (:func:`vllm_hashed_request`), so they equal the engine's."""
    if chunk_size <= 0 or span <= 0 or chunk_size % span:
        raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of the hash span {span}")
    req = vllm_hashed_request("chunk-keys", token_ids, span, cache_salt, algo)
    return block_hash_keys(req.block_hashes, chunk_size, span, 0, len(token_ids) // chunk_size)
