"""What to load: the hit accepted for a request, once vLLM has allocated its blocks.

A load moves the attention objects of the hit's chunks beyond vLLM's local prefix hit (the
blocks vLLM already holds are skipped, as are blocks past the resume point) and the KDA
states at the resume point, into the block of the last resumed token. A hit that cannot be
loaded as planned (another chunk grid since, another count of external tokens than vLLM
took, no keys or no state block) becomes a refused load: the worker reports it failed and
vLLM recomputes the request. The workers' reports of loads end them (:func:`loads_reported`)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING

from connector.metadata import LoadJob, ObjectMove

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from connector.geometry import Geometry
    from connector.keys import ChunkKeys
    from connector.media import MediaLedger
    from connector.requests import Hit, RequestState


def plan_load(state: RequestState, blocks: KVCacheBlocks, hit: Hit, num_external_tokens: int, geo: Geometry,
              chunk_keys: ChunkKeys, ledger: MediaLedger, stats: collections.Counter[str]) -> LoadJob | None:
    """What the hit accepted for ``state`` becomes once vLLM allocated its ``blocks`` and
    took ``num_external_tokens``: None where it took none (vLLM's local hit is as deep),
    else the load (:func:`load_job`), after which the request holds what it loads. Either
    way the chunks the server holds, or vLLM resumed locally, are not saved again."""
    C = geo.chunk_size
    if hit.local_tokens and hit.local_tokens % C == 0:
        state.state_chunk = max(state.state_chunk, hit.local_tokens // C)  # resumed locally there
    # The server holds attention for chunks [0, held): don't send them again.
    state.saved_chunks = max(state.saved_chunks, hit.held)  # (a hand-off's: its chain's)
    if num_external_tokens == 0:
        return None
    resume = hit.local_tokens + num_external_tokens
    if state.handoff_key is not None:
        stats["handoffs_missed" if hit.handoff_tokens is None else "handoffs_loaded"] += 1
    job = load_job(state, blocks, hit, resume, geo, chunk_keys)
    state.load_in_flight = True
    if job.refused is None:
        state.loaded_tokens = resume
        ledger.record_load(state.media_items, hit.local_tokens, resume)
        state.saved_chunks = max(state.saved_chunks, hit.whole_chunks())
        state.state_chunk = max(state.state_chunk, hit.whole_chunks())
    return job


def load_job(state: RequestState, blocks: KVCacheBlocks, hit: Hit, resume: int, geo: Geometry,
             chunk_keys: ChunkKeys) -> LoadJob:
    """The load of ``hit`` into ``blocks`` (vLLM took the tokens up to ``resume``), on the
    chunk grid of ``geo``, or a refused one where it cannot be loaded as planned."""
    req_id = state.request.request_id
    C = geo.chunk_size
    if hit.session.chunk_size != C:
        return LoadJob(req_id, [], refused=f"the hit is in chunks of {hit.session.chunk_size}, the server's are "
                                           f"now {C}")
    if resume != hit.resume_tokens():
        return LoadJob(req_id, [], refused=f"vLLM took {resume - hit.local_tokens} external tokens, not "
                                           f"{hit.resume_tokens() - hit.local_tokens}")
    try:
        return LoadJob(req_id, load_moves(state, blocks, hit, geo, chunk_keys))
    except (LookupError, ValueError) as e:
        return LoadJob(req_id, [], refused=str(e))


def load_moves(state: RequestState, blocks: KVCacheBlocks, hit: Hit, geo: Geometry,
               chunk_keys: ChunkKeys) -> list[ObjectMove]:
    """The hit's objects and the blocks they go to: attention for the chunks beyond
    vLLM's local hit, and the states at the resume point. Raises LookupError where the
    request's keys or a state block are missing."""
    C = geo.chunk_size
    hashes = state.extend_keys(chunk_keys, C, hit.whole_chunks())[:hit.whole_chunks()]
    if hit.handoff_tokens is not None:
        assert state.handoff_key is not None
        hashes = hashes + [state.handoff_key]
    if len(hashes) < hit.end_chunk:
        raise LookupError(f"{len(hashes)} chunk keys for a hit of {hit.end_chunk} chunks")
    resume = hit.resume_tokens()
    moves: list[ObjectMove] = []
    for g in geo.attn_groups:
        per_chunk = C // g.block_size
        group_blocks = blocks.blocks[g.vllm_group]
        first_new_block = hit.local_tokens // g.block_size
        end_block = -(-resume // g.block_size)  # blocks past the resume point: never loaded
        for k in range(hit.start_chunk, hit.end_chunk):
            ids: list[int | None] = []
            for i in range(k * per_chunk, (k + 1) * per_chunk):
                blk = group_blocks[i] if i < min(end_block, len(group_blocks)) else None
                ids.append(None if i < first_new_block or blk is None or blk.is_null else blk.block_id)
            moves.append(ObjectMove(hashes[k], g.group_id, ids))
    for g in geo.state_groups:
        # vLLM resumes a recurrent state from the block of the last computed token
        blk = blocks.blocks[g.vllm_group][(resume - 1) // g.block_size]
        if blk.is_null:
            raise LookupError(f"no state block allocated at position {resume} for group {g.group_id}")
        moves.append(ObjectMove(hashes[hit.end_chunk - 1], g.group_id, [blk.block_id]))
    return moves


def load_failed(state: RequestState) -> None:
    """A worker reported ``state``'s load failed: vLLM recomputes the request from scratch,
    and offering the same hit again would loop."""
    state.load_failed = True
    if state.scheduled:
        # The scheduler recomputes from 0: those chunks are ours to save again.
        state.saved_chunks = 0
        state.loaded_tokens = 0


def loads_reported(requests: dict[str, RequestState], finished: Iterable[str],
                   failed: Iterable[str]) -> list[RequestState]:
    """The workers' reports of loads: those ``finished`` are no longer in flight (a request
    vLLM finished meanwhile is forgotten now), those ``failed`` are recomputed
    (:func:`load_failed`). The requests whose load finished, whose leases may go."""
    done = []
    for req_id in set(finished):
        state = requests.get(req_id)
        if state is not None:
            state.load_in_flight = False
            done.append(state)
            if state.finished:
                del requests[req_id]
    for req_id in failed:
        state = requests.get(req_id)
        if state is not None and not state.finished:
            load_failed(state)
    return done


def fence_under_way(states: Iterable[RequestState], loads: Iterable[LoadJob]) -> int:
    """The weights changed in place: a request that holds KV computed (or being loaded) for
    the old weights computes next what mixes both, so it is not cached further (a request
    not yet allocated is admitted afresh); ``loads`` planned for the old weights are refused
    (the worker reports them failed, vLLM recomputes). How many requests were under way."""
    under_way = 0
    for state in states:
        if state.bypass is None and (state.scheduled or state.load_in_flight):
            state.bypass, state.scheduled = "under way while the weights changed", False
            under_way += 1
    for job in loads:
        job.objects, job.refused = [], job.refused or "the weights changed in place"
    return under_way
