"""What to save, and what to do when a save does not land.

Attention objects are saved for every whole chunk a request computes, starting where the
server's contiguous attention ends (so no chunk is sent twice); KDA states only at chunk
boundaries, where vLLM (align mode) offers a snapshot. Saves the workers report as not
landed move the request's saved depth back to the first hole, to be saved again after a
back-off, or end the request's saves."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cache_server.chunk_keys import parent_of
from connector.config import logger
from connector.media import MediaLedger
from connector.metadata import TRANSIENT_SAVE_FAILURES, ObjectMove, SaveFailure
from connector.requests import withhold_unvouched

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput

    from connector.geometry import Geometry
    from connector.keys import ChunkKeys
    from connector.requests import Hit, RequestState

# Attention holes are saved again at most this many times per request, after a back-off
# that doubles from RESAVE_BACKOFF_S (a server out of space needs time to free some).
MAX_SAVE_RETRIES = 6
RESAVE_BACKOFF_S = 0.1


def tokens_after_step(so: SchedulerOutput) -> dict[str, int]:
    """Tokens each scheduled request will have computed once this step's forward ran."""
    out: dict[str, int] = {}
    for new in so.scheduled_new_reqs:
        out[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        out[req_id] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
    return out


def owned(req_id: str, moves: list[ObjectMove]) -> list[ObjectMove]:
    """Tag save moves with their request, so their outcome can find it again."""
    for m in moves:
        m.req_id = req_id
    return moves


class SavePlanner:
    """Plans the saves of tracked requests and applies their outcomes. Each plan is made
    for the geometry (the session's chunk grid) it is given; requests' chunk keys are
    extended with ``chunk_keys`` where a save needs them; no save reaches past an image
    ``ledger`` does not vouch for (:class:`connector.media.MediaLedger`)."""

    def __init__(self, chunk_keys: ChunkKeys, save_decode: bool, ledger: MediaLedger | None = None) -> None:
        self._chunk_keys = chunk_keys
        self._save_decode = save_decode
        self._ledger = MediaLedger() if ledger is None else ledger
        self.stats: collections.Counter[str] = collections.Counter()  # see failed()

    def check_media(self, state: RequestState, reached: int) -> None:
        """Stop ``state``'s saves before an image among its first ``reached`` tokens that
        the ledger does not vouch for (:func:`connector.requests.withhold_unvouched`)."""
        if withhold_unvouched(state, self._ledger, reached):
            self.stats["media_withheld"] += 1

    def new_grid(self, states: Iterable[RequestState]) -> None:
        """A server came back with another chunk size: what requests under way saved or
        planned counts chunks of the old grid. Their saves start again from chunk 0 under
        the new grid's keys (keys name their grid: an old-grid save can never land under a
        new-grid key); saves planned but not yet sent are the caller's to drop."""
        for state in states:
            state.saved_chunks = state.state_chunk = state.save_retries = 0
            state.resave_at, state.saves_given_up = 0.0, False  # a new server, a new count

    def cacheable_chunks(self, state: RequestState, computed: int, C: int) -> int:
        """Whole chunks of this request that may be saved once ``computed`` tokens exist
        (at most the request's ``lmcache.max_offload_tokens``, in ``kv_transfer_params``,
        and never past an image whose rows vLLM's caches may hold under another content's
        identifier: :class:`connector.media.MediaLedger`) and have keys (vLLM hashes a block once it is full; with a drafter's lookahead, a
        chunk has its key once the tokens after it are known)."""
        req = state.request
        limit = req.num_tokens if self._save_decode else req.num_prompt_tokens
        cap = state.save_limit()  # LMCache's lmcache.max_offload_tokens; an image not vouched for
        if cap is not None:
            limit = min(limit, cap)
        n = min(computed, limit) // C
        return min(n, len(state.extend_keys(self._chunk_keys, C, n)))

    def attention_saves(self, state: RequestState, computed: int, geo: Geometry,
                        manager: KVCacheManager | None) -> list[ObjectMove]:
        """A request's attention saves once ``computed`` tokens exist, first stopping its
        saves before any image it has reached whose identifier vouches for other content."""
        self.check_media(state, computed)
        C = geo.chunk_size
        n = self.cacheable_chunks(state, computed, C)
        if n <= state.saved_chunks or state.saves_given_up or time.monotonic() < state.resave_at:
            return []
        assert manager is not None
        block_ids = manager.get_block_ids(state.request.request_id)
        null_id = manager.block_pool.null_block.block_id
        keys = state.keys
        moves: list[ObjectMove] = []
        for g in geo.attn_groups:
            per_chunk = C // g.block_size
            ids = block_ids[g.vllm_group]
            for k in range(state.saved_chunks, n):
                chunk_ids = ids[k * per_chunk : (k + 1) * per_chunk]
                if len(chunk_ids) != per_chunk or null_id in chunk_ids:
                    break  # not allocated, or dropped (e.g. out of a sliding window)
                moves.append(ObjectMove(keys[k], g.group_id, list(chunk_ids), parent=parent_of(keys, k)))
        state.saved_chunks = n
        return moves

    def state_saves(self, state: RequestState, entries: list[tuple[int, int, int]], geo: Geometry) -> list[ObjectMove]:
        """States vLLM snapshots at block boundaries; we keep those at chunk boundaries."""
        C = geo.chunk_size
        moves: list[ObjectMove] = []
        prev_chunk = state.state_chunk
        for vllm_group, block_id, boundary in sorted(entries, key=lambda e: e[2]):
            group = geo.state_group_of(vllm_group)
            if group is None or boundary <= 0 or boundary % C:
                continue
            if boundary <= state.loaded_tokens:
                continue  # came from the server
            k = boundary // C
            if self.cacheable_chunks(state, boundary, C) < k:
                continue
            if k > state.state_chunk:  # a newer state on this path: the previous one is superseded
                prev_chunk, state.state_chunk = state.state_chunk, k
            keys = state.keys
            prev = keys[prev_chunk - 1] if 0 < prev_chunk < k else None
            moves.append(ObjectMove(keys[k - 1], group.group_id, [block_id], prev, parent_of(keys, k - 1)))
        return moves

    def local_state_resave(self, state: RequestState, blocks: KVCacheBlocks, hit: Hit, geo: Geometry) -> list[ObjectMove]:
        """vLLM resumes from its local cache at a chunk boundary the server lacks (the
        server restarted or evicted it): offer that snapshot again, since no boundary
        offload will (the block was cached earlier). Attention chunks follow as usual."""
        C = geo.chunk_size
        local = hit.local_tokens
        if local == 0 or local % C or local // C <= hit.end_chunk:
            return []
        if hit.start_chunk == local // C and hit.start_state:
            return []  # the lookup started there and found the states present: nothing lost
        k = local // C
        if self.cacheable_chunks(state, local, C) < k:
            return []  # past the client's cap or an image not vouched for, or no key yet
        keys = state.keys
        moves = []
        for g in geo.state_groups:
            blk = blocks.blocks[g.vllm_group][local // g.block_size - 1]
            if not blk.is_null:
                moves.append(ObjectMove(keys[k - 1], g.group_id, [blk.block_id], parent=parent_of(keys, k - 1)))
        return moves

    def failed(self, failures: list[SaveFailure], tracked: Callable[[str], RequestState | None], geo: Geometry) -> None:
        """Saves the workers report as not landed: move each request's saved depth back to
        its first attention hole, so that later steps save the holes again from the blocks
        the request still holds (after a back-off), or give its saves up cleanly.
        ``tracked(req_id)`` is the request's state while it holds its blocks.

        A failed state save is not retried: vLLM (align mode) does not keep a request's
        interior state blocks alive, so that block may hold other bytes by now. The server
        then simply has no resume point there (a shallower hit, never a wrong one)."""
        self.stats["failed"] += len(failures)
        attn_ids = {g.group_id for g in geo.attn_groups}
        by_req: dict[str, list[SaveFailure]] = {}
        for f in failures:
            by_req.setdefault(f.req_id, []).append(f)
            self.stats[f"failed_{f.reason}"] += 1
        for req_id, fs in by_req.items():
            state = tracked(req_id) if req_id else None
            if state is None:  # finished (its blocks are gone) or not traceable
                self.stats["lost"] += len(fs)
                continue
            index = {h: k for k, h in enumerate(state.keys)}
            holes = [index[f.chunk_hash] for f in fs if f.group_id in attn_ids and f.chunk_hash in index]
            if not holes or state.saves_given_up:
                self.stats["lost"] += len(fs)
                continue
            first = min(holes)
            permanent = any(f.reason not in TRANSIENT_SAVE_FAILURES for f in fs)
            if permanent or state.save_retries >= MAX_SAVE_RETRIES:
                state.saves_given_up = True
                state.saved_chunks = min(state.saved_chunks, first)
                self.stats["given_up"] += 1
                logger.warning(
                    "GlmCacheConnector: %s: saves from chunk %d did not land (%s) after %d "
                    "retries; not saving this request further", req_id, first,
                    sorted({f.reason for f in fs}), state.save_retries,
                )
                continue
            state.saved_chunks = min(state.saved_chunks, first)
            now = time.monotonic()
            if now < state.resave_at:
                continue  # sent before the last correction: the same incident, not a new retry
            state.resave_at = now + RESAVE_BACKOFF_S * (2 ** state.save_retries)
            state.save_retries += 1
            self.stats["corrected"] += 1
            logger.info(
                "GlmCacheConnector: %s: %d saves did not land (%s); saving again from chunk %d",
                req_id, len(fs), sorted({f.reason for f in fs}), first,
            )
