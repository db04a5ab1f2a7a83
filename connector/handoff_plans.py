"""The scheduler side's plans for a PD hand-off (:mod:`connector.handoff`): the hand-off key
a decode-side request looks up (:func:`handoff_lookup`), and on the prefill side what a
request saves (:func:`handoff_saves`) and answers the proxy (:func:`handoff_params`). Each is made
for the chunk grid it is given; requests' chunk keys are extended with ``chunk_keys`` where
a hand-off needs them."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from connector.handoff import CHUNKS_PARAM, HANDOFF_PARAM, handoff_key, handoff_span
from connector.keys import request_tokens
from connector.metadata import ObjectMove

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from connector.geometry import Geometry
    from connector.keys import ChunkKeys
    from connector.requests import RequestState


def handoff_named(state: RequestState, chunk_keys: ChunkKeys, chunk_size: int,
                  m: int) -> tuple[bytes, bytes | None, int] | None:
    """``(key, parent key, whole chunks)`` of the hand-off of ``state``'s first ``m``
    tokens, the same on both sides (the prefill's prompt is the decode's less its last
    token); None where none is made: a drafter's lookahead, images, an empty tail, or no
    chain keys that far (connector.handoff)."""
    if chunk_keys.lookahead or getattr(state.request, "mm_features", None):
        return None
    whole, tail = handoff_span(m, chunk_size)
    keys = state.extend_keys(chunk_keys, chunk_size, whole)
    if tail == 0 or len(keys) < whole:
        return None
    parent = keys[whole - 1] if whole else None
    tail_tokens = list(request_tokens(state.request, m)[whole * chunk_size:m])
    return handoff_key(parent, tail_tokens, state.request.cache_salt), parent, whole


def handoff_lookup(state: RequestState, chunk_keys: ChunkKeys, chunk_size: int, chain_chunks: int) -> bytes | None:
    """The hand-off key a decode-side request (``do_remote_prefill``) looks up after its
    ``chain_chunks`` whole chunks: its prompt less the last token is what the prefill
    instance computed. None where no hand-off is made (strict prefix only: the caller's)."""
    request = state.request
    if not state.remote_prefill or request.num_tokens != request.num_prompt_tokens:
        return None
    named = handoff_named(state, chunk_keys, chunk_size, request.num_tokens - 1)
    return named[0] if named is not None and named[2] == chain_chunks else None


def handoff_saves(state: RequestState, chunk_keys: ChunkKeys, geo: Geometry, manager: KVCacheManager | None,
                  stats: collections.Counter[str]) -> list[ObjectMove]:
    """A prefill-side request (``do_remote_decode``) has computed its prompt: its
    hand-off, the pages of its tail blocks and the states after its last token, copied
    in this step after the forward (counted in ``stats`` as ``handoffs_saved``)."""
    state.handoff_planned = True
    request = state.request
    m = request.num_prompt_tokens
    cap = state.save_limit()
    C = geo.chunk_size
    named = None if cap is not None and cap < m else handoff_named(state, chunk_keys, C, m)
    if named is None:
        return []
    key, parent, whole = named
    assert manager is not None
    block_ids = manager.get_block_ids(request.request_id)
    null_id = manager.block_pool.null_block.block_id
    moves: list[ObjectMove] = []
    for g in geo.attn_groups:
        per_chunk = C // g.block_size
        first, last = whole * per_chunk, (m - 1) // g.block_size
        ids = list(block_ids[g.vllm_group][first:last + 1])
        if len(ids) != last + 1 - first or null_id in ids:
            return []
        # a chunk's size: blocks past the tail repeat the last one (never loaded)
        moves.append(ObjectMove(key, g.group_id, ids + [ids[-1]] * (per_chunk - len(ids)), parent=parent))
    for g in geo.state_groups:
        ids = block_ids[g.vllm_group]
        i = (m - 1) // g.block_size  # vLLM keeps the running state in the last token's block
        if i >= len(ids) or ids[i] == null_id:
            return []
        moves.append(ObjectMove(key, g.group_id, [ids[i]], parent=parent))
    stats["handoffs_saved"] += 1
    state.handoff_made = True
    return moves


def handoff_params(state: RequestState, stores: bool) -> dict[str, Any]:
    """What a finished prefill-side request's ``kv_transfer_params`` say, for the proxy to
    pass on to the decode instance (``stores``: this instance saves). Our keys only:
    beside a transfer connector (NIXL in a MultiConnector) the ``do_remote_*`` keys are its
    (vLLM refuses a key two children return), and ours marks the hand-off."""
    planned = min(state.saved_chunks, state.state_chunk) if stores else 0
    if state.handoff_made and stores:
        planned = state.saved_chunks + 1  # the whole chunks, then the hand-off
    return {HANDOFF_PARAM: state.handoff_made and stores, CHUNKS_PARAM: planned}
