"""What the scheduler side knows of each request: one record from the first time vLLM asks
about it until it finishes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.media import unvouched_from

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from connector.keys import ChunkKeys
    from connector.media import MediaItem, MediaLedger
    from connector.remote import LookupAnswer, Session


@dataclass
class Hit:
    """A lookup answer accepted for a request, not yet turned into a load (between vLLM
    asking for matched tokens and allocating the request's blocks)."""

    start_chunk: int
    end_chunk: int  # exclusive; the resume point is end_chunk * C
    local_tokens: int
    held: int = 0  # attention chunks [0, held) the server already holds (all groups, ranks)
    start_state: bool = False  # the server holds the states at chunk start_chunk - 1
    session: Session | None = None  # the server's session the hit is under (its chunk size: the hit's grid)
    # A PD hand-off (connector.handoff): its last "chunk" is the hand-off, and the resume
    # point is this token (inside chunk end_chunk - 1) instead of end_chunk * C.
    handoff_tokens: int | None = None

    def resume_tokens(self) -> int:
        if self.handoff_tokens is not None:
            return self.handoff_tokens
        assert self.session is not None
        return self.end_chunk * self.session.chunk_size

    def whole_chunks(self) -> int:
        """The hit's chunks that are whole chunks of the chain (not the hand-off)."""
        return self.end_chunk - (self.handoff_tokens is not None)


@dataclass
class Lookup:
    """A request's question to the server: on the lookup thread (``answered_at`` None),
    or answered and kept while vLLM asks again without allocating."""

    question: tuple[Any, ...]  # (namespace, chunk size, start chunk, chunks asked, lease)
    future: Future[LookupAnswer]
    deadline: float  # unanswered past it: the request is admitted cold
    answered_at: float | None = None


@dataclass
class RequestState:
    """One request, as the scheduler side tracks it."""

    request: Request
    # Admission: when the current one began (None: not under way), its lookup, and the
    # hit accepted for it; the lease holding the hit's objects on the server.
    admission_started: float | None = None
    lookup: Lookup | None = None
    hit: Hit | None = None
    lease_id: int | None = None
    load_in_flight: bool = False  # a worker is writing a load into its blocks
    load_failed: bool = False  # vLLM recomputes it; offering the same hit again would loop
    finished: bool = False  # vLLM finished it while a load was in flight: kept for the report
    # Chunk keys of the cacheable tokens so far, on the current session's grid (a new grid
    # empties them: connector.scheduler.SchedulerSide._adopt); with a drafter's lookahead,
    # ``plain_keys`` are the key scheme's own keys they derive from.
    keys: list[bytes] = field(default_factory=list)
    plain_keys: list[bytes] = field(default_factory=list)
    # Images: (first placeholder, digest) of each item, mixed into the keys of the chunks
    # they reach (connector.media); None until named (or for a text request), [] where the
    # keys are vLLM's block hashes as they are (trust_media_ids).
    media: list[tuple[int, bytes]] | None = None
    media_items: list[MediaItem] = field(default_factory=list)  # the same items, with vLLM's identifiers
    # Saves stop at this token: before an image whose rows or embeddings vLLM's caches may
    # hold under another content's identifier (connector.media.MediaLedger); None: no limit.
    media_limit: int | None = None
    # vLLM's local prefix hit when it last asked about the request (its admission's).
    local_tokens: int = 0
    # The request's kv_transfer_params, read once (connector.lmcache_settings.request_params).
    params_read: bool = False
    offload_cap: int | None = None  # lmcache.max_offload_tokens
    skip_load: bool = False  # lmcache.skip_load
    # vLLM's PD convention (kv_transfer_params do_remote_decode / do_remote_prefill): this
    # instance prefills for a decode instance (saves a hand-off), or decodes what one
    # prefilled (looks the hand-off up); connector.handoff.
    remote_decode: bool = False
    remote_prefill: bool = False
    handoff_key: bytes | None = None  # the hand-off this request looks up (remote_prefill)
    prefill_chunks: int = 0  # the chain depth the prefill instance planned (glm_chunks)
    prefill_wait_until: float | None = None  # its lookups wait for the prefill's saves until then
    prefill_retry_at: float = 0.0  # and ask again no sooner than this
    prefill_retries: int = 0  # lookups repeated so far for the prefill's saves
    handoff_planned: bool = False  # its hand-off was considered (remote_decode: once)
    handoff_made: bool = False  # and its saves planned
    # Why this request is served without the external cache after handling its data
    # raised (None: it is not); it is then never looked up, loaded or saved again.
    bypass: str | None = None
    # Saves: from the first allocation on (``scheduled``).
    scheduled: bool = False
    saved_chunks: int = 0  # attention chunks [0, saved_chunks) are saved or on the server
    loaded_tokens: int = 0  # resume point of an external load (its states are on the server)
    state_chunk: int = 0  # chunks covered by the newest state on this path (0: none yet)
    save_retries: int = 0  # corrections of failed saves so far
    resave_at: float = 0.0  # when the holes may be saved again (monotonic time)
    saves_given_up: bool = False

    def save_limit(self) -> int | None:
        """Saves never reach past this token (the client's cap, an image not vouched for)."""
        limits = [x for x in (self.offload_cap, self.media_limit) if x is not None]
        return min(limits) if limits else None

    def extend_keys(self, chunk_keys: ChunkKeys, chunk_size: int, n_chunks: int, memo_only: bool = False) -> list[bytes]:
        """The request's chunk keys, extended to at least ``n_chunks`` where it has the
        tokens (``memo_only``: only what is known or in the memo, nothing hashed)."""
        return chunk_keys.extend(self.keys, self.request, chunk_size, n_chunks, memo_only, plain=self.plain_keys,
                                 media=self.media)

    def within_wait(self, wait_s: float) -> bool:
        """True while the current admission is younger than ``wait_s`` (starting it now if
        it had not started): no request waits on the server longer."""
        now = time.monotonic()
        if self.admission_started is None:
            self.admission_started = now
        return now - self.admission_started < wait_s


class Requests(dict[str, RequestState]):
    """Every request the scheduler side is tracking, by request id."""

    def of(self, request: Request) -> RequestState:
        state = self.get(request.request_id)
        if state is None:
            state = self[request.request_id] = RequestState(request)
        return state


def record_encodings(ledger: MediaLedger, encoder_inputs: Mapping[str, Iterable[int]],
                     requests: Mapping[str, RequestState]) -> None:
    """The images the workers encode this step (vLLM's ``scheduled_encoder_inputs``:
    request id -> item indices), each from its own request's pixels: what vLLM's encoder
    cache (and the rows computed from it) holds under their identifiers from now on."""
    for req_id, inputs in encoder_inputs.items():
        state = requests.get(req_id)
        if state is None:
            continue
        features = getattr(state.request, "mm_features", None) or ()
        by_index = {it.index: it for it in state.media_items}
        for i in inputs:
            item = by_index.get(i)
            if item is not None:
                ledger.record(item.identifier, item.digest)
            elif 0 <= i < len(features):  # pixels not named here: the identifier vouches for nothing
                ledger.record(str(features[i].identifier), None)


def withhold_unvouched(state: RequestState, ledger: MediaLedger, reached: int) -> bool:
    """Stop ``state``'s saves before the first image among its first ``reached`` tokens
    whose rows or embeddings vLLM's caches may hold for other pixels (the ledger does not
    vouch for its identifier with this image's digest). The limit only moves down; True
    where this is the first limit of the request's saves."""
    if not state.media_items:
        return False
    limit = unvouched_from(state.media_items, ledger, reached, state.local_tokens, state.loaded_tokens)
    if limit is None or (state.media_limit is not None and limit >= state.media_limit):
        return False
    first, state.media_limit = state.media_limit is None, limit
    return first
