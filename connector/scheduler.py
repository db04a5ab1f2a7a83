"""The scheduler side of :class:`~connector.glm_connector.GlmCacheConnector`: vLLM's
scheduler hooks. It decides; the worker side moves bytes.

It looks prefixes up under the strict-prefix rule, turns a hit into a load plan once vLLM
has allocated the request's blocks, and each step writes a plain
:class:`~connector.metadata.GlmConnectorMetadata`: which objects to load into which
blocks, which blocks to save under which keys. The server is asked through
:class:`~connector.remote.RemoteCache`, which answers "not yet" rather than wait; saves
are planned by :class:`~connector.saves.SavePlanner`; each request's state is one
:class:`~connector.requests.RequestState`.

Which recurrent states exist: vLLM (align mode) snapshots the state where a prefill step
ends on its block grid and keeps the snapshots its retention policy names (by default the
prompt's replay boundary ``N * floor((len-1)/N)``); the scheduler hands each kept one to
us as a boundary offload, and we save those on chunk boundaries. With C == N (production:
N is vLLM's unified block) the replay boundary is the strict-prefix boundary. With C > N,
run vLLM with ``--max-num-batched-tokens`` a multiple of C and
``--prefix-cache-retention-interval C`` (one state per chunk) or give the server
``--chunk-size N``; the connector warns otherwise.

Speculative decoding with EAGLE/MTP (vLLM 0.32). vLLM's local prefix cache drops the last
block of a hit for the drafter's groups (``single_type_kv_cache_manager.py:819``, after
matching one block further, ``kv_cache_coordinator.py:857-882``): that block's last draft
row was computed from the writer's next token, which its block hash does not cover
(``kv_cache_coordinator.py:135-146``). The scheduler applies no such drop to our tokens
(``sched/scheduler.py:978-1027`` takes them as returned), allocates blocks for the whole
hit (``allocate_slots(..., num_external_computed_tokens)``, scheduler.py:1262; no
lookahead slots during the async load, :1224) and hands them to
:meth:`SchedulerSide.update_state_after_alloc` (:1289). None is needed: our chunk keys
cover the token after each chunk (:func:`cache_server.chunk_keys.lookahead_keys`), which is what
vLLM's drop buys locally. The drop moves vLLM's KDA snapshots one block back instead:
a prompt's prefill checkpoint is ``N_b * floor(len / N_b) - N_b``
(``kv_cache_interface.py:1110``, used at scheduler.py:476) and the retained replay
boundaries are ``{N_b * floor((len-1)/N_b) - N_b, N_b * floor(len/N_b) - N_b}``
(``kv_cache_coordinator.py:65``, Mamba groups told at :177). Those are the states we are
offered and save, and a hit needs a state at its end, so with C == N_b a resend of an
unaligned prompt resumes one chunk before the strict-prefix checkpoint and an aligned one
at it; a state another request saved at the strict-prefix checkpoint is used there. The
lookup is not capped below the strict prefix: with the lookahead in the keys every hit
the server returns is valid for the drafter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from connector.admission import AdmissionRules
from connector.config import (
    SchedulerBlockAligner,
    Settings,
    logger,
    require_recompute_on_load_failure,
)
from connector.events import ServerEvents
from connector.geometry import Geometry, strict_prefix_chunks
from connector.handoff import CHUNKS_PARAM, HANDOFF_PARAM, handoff_key, handoff_retry_delay, handoff_span
from connector.identity import WeightsView
from connector.keys import ChunkKeys, request_tokens
from connector.media import MediaLedger, unvouched_from
from connector.metadata import GlmConnectorMetadata, GlmWorkerMeta, LoadJob, ObjectMove
from connector.namespace import Namespace
from connector.remote import LookupAnswer, RemoteCache, Session
from connector.requests import Hit, Lookup, Requests, RequestState
from connector.saves import SavePlanner, owned

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Prefixes of at least this many chunks, hashed by nobody here yet, are probed (first
# chunk only) before being hashed whole: 260 chunks of a 300k-token prompt take about 2 ms
# to hash; a probe hashes one chunk on the scheduler thread (microseconds) and costs one
# small lookup (about 0.4 ms) on the lookup thread.
PROBE_MIN_CHUNKS = 4

# A request whose data raised in a hook is logged at most once this often (per hook).
ERROR_LOG_INTERVAL_S = 60.0

_T = TypeVar("_T")

# How long an answer given to vLLM stays good for the same request asking again without
# having been allocated (its lease keeps the objects meanwhile; the server's TTL is 60 s).
REUSE_ANSWER_S = 1.0


class SchedulerSide:
    """The connector's scheduler role (one per engine)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings, geometry: Geometry, refused_layout: str | None,
                 row_format: str | None = None, numerics: str | None = None) -> None:
        require_recompute_on_load_failure(vllm_config)
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM via the connector
        self._geometry = geometry
        self._strict_prefix = settings.strict_prefix
        self._url = settings.url
        self._timeout_s = settings.timeout_s
        # vLLM's kv_role: a prefill instance (kv_producer) saves and never loads, a decode
        # instance (kv_consumer) loads and never saves, unless a setting says otherwise.
        self._role = getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both"
        self._loads = self._role != "kv_producer" or settings.producer_loads
        self._stores = self._role != "kv_consumer" or settings.consumer_saves
        logger.info("GlmCacheConnector: kv_role %s: %s", self._role,
                    "looks up, loads and saves" if self._loads and self._stores
                    else "saves, never loads" if self._stores else "loads, never saves" if self._loads
                    else "neither loads nor saves")
        self._align_block_size = SchedulerBlockAligner(vllm_config, geometry)
        parallel = vllm_config.parallel_config
        world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # the namespace: key scheme, weights, engine, drafts, media (connector.namespace)
        self._names = names = Namespace(vllm_config, kv_cache_config, settings, geometry, row_format, numerics)
        self._trust_media_ids = settings.trust_media_ids
        # a drafter's lookahead joins every chunk key (cache_server.chunk_keys.lookahead_keys)
        self.keys = ChunkKeys(names.scheme, names.hash_span, names.drafts.lookahead)
        self._drafts = names.drafts
        self._weights = WeightsView(world_size)
        self._last_map: Any = None  # vLLM's prefix-cache map at the last step
        self._prev_map: Any = None  # and at the step before
        self._reset_fresh = False  # the last reset replaced it
        self._fingerprint = self._names.of(self._weights.tokens)
        self._session: Session | None = None  # the server's, as last handed over (None: none under these weights)
        self._logged_geometry: Geometry | None = None
        self._requests = Requests()
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[ObjectMove] = []
        self._error_logged_at: dict[str, float] = {}  # where -> when a request error was last logged
        self._errors_unlogged: dict[str, int] = {}  # where -> errors since that line
        self._media_ledger = MediaLedger()  # what vLLM's caches hold under each media identifier
        self._saves = SavePlanner(self.keys, settings.save_decode)
        self.save_stats = self._saves.stats
        self._rules = AdmissionRules(names.scheme.span is not None, settings.trust_media_ids, self._saves.stats)
        if not self._strict_prefix:
            logger.warning(
                "GlmCacheConnector: strict_prefix=false (diagnosis only): full-prompt hits apply the last "
                "token to the KDA state twice and outputs drift; this engine loads but never saves"
            )
        disabled = settings.auth_broken or refused_layout is not None or names.identity is None
        self.remote = RemoteCache(settings, disabled, world_size, geometry, self._fingerprint, names.chunk_keys())
        # KV events for routers: what the server can resume, published by vLLM (connector.events)
        self.events = ServerEvents(vllm_config, kv_cache_config, geometry,
                                   lambda ns, keys: self.remote.lookup(ns, keys, 0, False))
        self._events_map: Any = None  # vLLM's prefix-cache map at the last take_events
        session = self.remote.connect()
        if session is not None:
            self._adopt(session)

    # Handshake ---------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The namespace of the current session; "" while no handshake succeeded under
        the engine's current weights."""
        return "" if self._session is None else self._session.namespace

    def _ready(self) -> Session | Literal[False] | None:
        """:meth:`RemoteCache.ready`: the server's session (taken over here when it is a
        new one), None while a handshake is under way, False while the server is away."""
        ready = self.remote.ready()
        if ready and ready is not self._session:
            self._adopt(ready)
        return ready

    def _adopt(self, session: Session) -> None:
        """Work under a new session: its chunk size is the grid of every key, lookup, load
        and save from now on."""
        old_chunk = self._geometry.chunk_size
        self._session, self._geometry = session, session.geometry
        self.events.geometry = session.geometry
        if session.chunk_size != old_chunk:  # keys of another grid name other prefixes
            for state in self._requests.values():
                state.keys, state.plain_keys = [], []
        previous = self._logged_geometry
        if self._geometry != previous:  # once, unless a new server differs
            logger.info("%s", self._geometry.log_line())
            self._warn_if_chunk_exceeds_block()
            self._warn_if_drafts_resume_a_chunk_early()
            self._logged_geometry = self._geometry
            if previous is not None and previous.chunk_size != self._geometry.chunk_size:
                self._change_grid(previous.chunk_size)
        logger.info(
            "GlmCacheConnector: server %s, namespace %s, state groups %s, attention groups %s",
            self._url,
            self.namespace,
            [g.group_id for g in self._geometry.state_groups],
            [g.group_id for g in self._geometry.attn_groups],
        )

    def _change_grid(self, old_chunk: int) -> None:
        """A server that came back with another chunk size: what requests under way saved
        or planned counts chunks of the old grid. Their saves start again from chunk 0
        under the new grid's keys (keys name their grid: an old-grid save can never land
        under a new-grid key), and saves planned but not yet sent are dropped."""
        C = self._geometry.chunk_size
        logger.warning(
            "GlmCacheConnector: glm-cache-server %s now negotiates chunk size %d (was %d): requests "
            "under way save again from their first chunk under the new grid", self._url, C, old_chunk,
        )
        for state in self._requests.values():
            state.saved_chunks = state.state_chunk = state.save_retries = 0
            state.resave_at, state.saves_given_up = 0.0, False  # a new server, a new count
        self._pending_saves = []
        self.events.forget_all("the server's chunk size changed")

    def _warn_if_drafts_resume_a_chunk_early(self) -> None:
        """With a drafter that writes rows (MTP, EAGLE), vLLM keeps a prompt's recurrent
        state one block before its replay boundary (``drop_eagle_checkpoint_block``: the
        block its own local hits drop), so the state at the strict prefix exists only for
        the step that computed it, in a slot the next step overwrites, and vLLM offers a
        connector only the states it retains. A resend of an unaligned prompt then resumes
        one chunk before the strict prefix (255 tokens: 0 instead of 128). Only vLLM's
        retention can keep it: say which flag, once."""
        geo = self._geometry
        if not self._drafts.lookahead or not geo.state_groups:
            return
        if geo.chunk_size != geo.scheduler_block_size:
            # measured on the tiny checkpoint (chunk 256, block 128, retention 256, MTP k=2):
            # prompts of 612 and 814 tokens resumed one chunk short; with chunk == block they
            # resume at the strict prefix
            logger.warning(
                "GlmCacheConnector: with %s drafts and a chunk (%d) larger than vLLM's block (%d), resends "
                "resume up to one chunk before the strict prefix; start glm-cache-server with --chunk-size %d",
                self._drafts.method, geo.chunk_size, geo.scheduler_block_size, geo.scheduler_block_size,
            )
            return
        retention = self._kv_cache_config.prefix_cache_retention_interval
        if retention is None or (retention > 0 and geo.chunk_size % retention == 0):
            return  # dense, or a state kept at every chunk end
        logger.warning(
            "GlmCacheConnector: with %s drafts vLLM keeps each prompt's recurrent state one block before "
            "its replay boundary, so a resend resumes one chunk before the strict prefix; start vLLM with "
            "--prefix-cache-retention-interval %d for hits at the strict prefix (vLLM then keeps a state "
            "snapshot every chunk of a prompt in its pool, evicted as its prefix cache is)",
            self._drafts.method, geo.chunk_size,
        )

    def _warn_if_chunk_exceeds_block(self) -> None:
        """A chunk longer than vLLM's block needs state snapshots vLLM does not keep by
        default: it ends prefill steps, and retains states, on its own block grid only."""
        geo = self._geometry
        if not geo.state_groups or geo.chunk_size == geo.scheduler_block_size:
            return
        sc = self._vllm_config.scheduler_config
        retention = self._kv_cache_config.prefix_cache_retention_interval
        if sc.max_num_batched_tokens % geo.chunk_size == 0 and retention == geo.chunk_size:
            return
        logger.warning(
            "GlmCacheConnector: chunk size %d exceeds vLLM's block %d, so recurrent state "
            "snapshots exist at chunk boundaries only where prefill steps end there; set "
            "--max-num-batched-tokens to a multiple of %d and "
            "--prefix-cache-retention-interval %d (or start glm-cache-server with "
            "--chunk-size %d), otherwise many prompts will get no hit",
            geo.chunk_size, geo.scheduler_block_size, geo.chunk_size, geo.chunk_size,
            geo.scheduler_block_size,
        )

    # Keys ----------------------------------------------------------------------------------

    def _keys_of(self, state: RequestState, n_chunks: int, memo_only: bool = False) -> list[bytes]:
        """The request's chunk keys, at least ``n_chunks`` of them where it has the tokens
        (``memo_only``: only what is known or in the memo, nothing hashed)."""
        return state.extend_keys(self.keys, self._geometry.chunk_size, n_chunks, memo_only)

    def request_keys(self, request: Request, n_chunks: int) -> list[bytes]:
        """``request``'s chunk keys (at least ``n_chunks`` where it has the tokens)."""
        return self._keys_of(self._requests.of(request), n_chunks)

    # Requests whose data the connector cannot handle ----------------------------------------

    def _uncached(self, state: RequestState, where: str, error: BaseException) -> None:
        """Handling ``state``'s request raised: serve it without the external cache from now
        on (never looked up, loaded or saved again), count it, and say so in at most one log
        line a minute per hook (a client that sends such requests in a loop does not flood
        the log). Nothing about a request may stop the engine."""
        state.bypass = f"{where}: {type(error).__name__}"
        state.scheduled = False
        self._saves.stats["request_errors"] += 1
        now = time.monotonic()
        last = self._error_logged_at.get(where)
        if last is not None and now - last < ERROR_LOG_INTERVAL_S:
            self._errors_unlogged[where] = self._errors_unlogged.get(where, 0) + 1
            return
        self._error_logged_at[where] = now
        more = self._errors_unlogged.pop(where, 0)
        logger.warning(
            "GlmCacheConnector: %s of request %.64s raised %s: %.200s; serving it without the external "
            "cache%s", where, state.request.request_id, type(error).__name__, str(error),
            f" ({more} more since the last such line)" if more else "", exc_info=error,
        )

    def _guarded(self, state: RequestState, where: str, fn: Callable[[], _T], fallback: _T) -> _T:
        """``fn()``, or ``fallback`` with the request served uncached if it raises."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - request data must never stop the engine
            self._uncached(state, where, e)
            return fallback

    # Admission -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the server can provide; ``None`` ("ask
        again next step") while the answer is on its way from the lookup thread.

        vLLM 0.32 keeps a request that gets ``None`` waiting (it is skipped for this step,
        the requests behind it are still scheduled) and asks again next step, with the
        local prefix hit computed afresh. The prefix is hashed once per request (kept for
        the save path too); a lookup is sent once per admission. Its answer (and lease) is
        kept for :data:`REUSE_ANSWER_S` while vLLM asks again without allocating (no token
        budget or blocks this step), so a request at the head of a busy queue does not
        alternate between a lookup and a step of "not yet". An answer for a different
        local hit (vLLM's prefix cache changed between steps) is dropped and asked again.
        No request waits longer than the client's timeout plus slack: then it is admitted
        cold, and the failed lookup puts the link in back-off, so the next requests do not
        wait at all."""
        self._align_block_size()
        state = self._requests.of(request)
        self._guarded(state, "admission", lambda: self._rules.enter(state, num_computed_tokens, self._block_map()),
                      None)
        if state.bypass is None:
            result = self._guarded(state, "admission", lambda: self._admit(state, num_computed_tokens), None)
            if state.bypass is None and result is not None:
                return result
        return self._guarded(state, "admission", lambda: self._cold(state), (0, False))

    def _admit(self, state: RequestState, num_computed_tokens: int) -> tuple[int | None, bool] | None:
        """The answer for a request the rules admit (:meth:`AdmissionRules.enter`), or None:
        admit it cold (nothing external)."""
        request = state.request
        state.hit = None
        state.local_tokens = num_computed_tokens
        if state.load_failed:
            return None
        wait_s = self.remote.answer_wait_s()
        ready = self._server_ready()
        if ready is None and state.within_wait(wait_s):
            return None, False
        if not ready or not self.remote.usable():
            return None
        if self._rules.uncacheable(state) or state.skip_load:
            return None
        C = ready.chunk_size  # the session's grid
        if self._strict_prefix:
            max_chunks = strict_prefix_chunks(request.num_tokens, C)
        else:
            max_chunks = request.num_tokens // C
        # Only chunks with a key: with a drafter's lookahead L, those followed by L known
        # tokens. Under strict prefix with L = 1 that is every chunk asked about: the
        # last one ends at C * floor((N-1)/C) <= N - 1, so the token after it is a
        # prompt token (vLLM always computes the last one).
        known = self.keys.known_chunks(request, C)
        max_chunks = min(max_chunks, known)
        start_chunk = num_computed_tokens // C
        # Local hit already at the limit: still ask (without a lease) how deep the server
        # is, so a prefix the server lost can be saved again from vLLM's local blocks.
        want_load = max_chunks * C > num_computed_tokens and self._loads
        max_chunks = min(max(max_chunks, start_chunk), known)
        handoff = self._handoff_of(state, max_chunks) if self._loads else None
        if handoff is not None:  # the hand-off is one more link of the chain
            state.handoff_key = handoff
            max_chunks += 1
            want_load = True
        if max_chunks == 0:
            return None
        start = start_chunk if want_load else 0
        question = (ready.namespace, C, start, max_chunks, want_load)
        lookup = state.lookup
        if lookup is not None and lookup.answered_at is not None:
            if lookup.question == question and time.monotonic() - lookup.answered_at < REUSE_ANSWER_S:
                return self._use_answer(state, lookup.future.result(), start, num_computed_tokens)
            self._forget_answer(state)  # stale: its lease goes, ask again
        elif lookup is not None and lookup.question != question:
            self._discard_lookup(state)  # asked for another local hit: ask again
        if state.lookup is None:
            if not state.within_wait(wait_s):
                return None
            if time.monotonic() < state.prefill_retry_at:
                return None, False  # waiting for a prefill instance's saves
            state.lookup = Lookup(question, self._ask(state, start, max_chunks, want_load),
                                  time.monotonic() + wait_s)
            return None, False
        lookup = state.lookup
        if not lookup.future.done():
            if time.monotonic() < lookup.deadline:
                return None, False
            return None  # no answer in time: cold, never held
        state.admission_started = None
        answer = lookup.future.result()
        if answer.hashes is not None:
            self.keys.adopt(state.keys, request, C, answer.hashes)
        if answer.error is not None:
            state.lookup = None
            return 0, False
        if answer.lease_id is not None:
            state.lease_id = answer.lease_id
        if self._prefill_saves_pending(state, answer.chunks, max_chunks):
            self._forget_answer(state)
            return None, False
        lookup.answered_at = time.monotonic()
        return self._use_answer(state, answer, start, num_computed_tokens)

    def _ask(self, state: RequestState, start: int, max_chunks: int, want_load: bool):
        """Send the request's question to the lookup thread."""
        request = state.request
        if state.handoff_key is not None:
            chain = max_chunks - 1
            return self.remote.lookup(self.namespace, self._keys_of(state, chain)[:chain] + [state.handoff_key],
                                      start, want_load, request.cache_salt)
        hashes = self._keys_of(state, max_chunks, memo_only=True)
        if (not hashes and start == 0 and want_load and max_chunks >= PROBE_MIN_CHUNKS
                and not self.keys.lookahead):
            # A prefix nobody here has seen: ask for its first chunk before hashing it
            # all (most such prompts are nowhere; a hit hashes the rest off this thread).
            # Not with a drafter's lookahead: the lookup thread hashes plain chains only.
            first, rest = self.keys.probe(state.keys, request, self._geometry.chunk_size, max_chunks, state.media)
            return self.remote.probe(self.namespace, first, rest, request.cache_salt)
        hashes = self._keys_of(state, max_chunks)[:max_chunks]
        return self.remote.lookup(self.namespace, hashes, start, want_load, request.cache_salt)

    def _prefill_saves_pending(self, state: RequestState, depth: int, asked: int) -> bool:
        """A decode-side request whose prefill instance planned saves ``glm_chunks`` deep
        got a shallower answer: those saves may still be on their way (they travel after the
        prefill's response). Ask again shortly (backing off, at most
        :data:`~connector.handoff.MAX_HANDOFF_RETRIES` times), for at most ``timeout_s`` from
        the first answer (its admission restarts with each answer, so this deadline is the
        request's), then resume from what is there."""
        if not state.remote_prefill or depth >= min(asked, state.prefill_chunks):
            return False
        now = time.monotonic()
        if state.prefill_wait_until is None:
            state.prefill_wait_until = now + self._timeout_s
        delay = handoff_retry_delay(state.prefill_retries)
        if now >= state.prefill_wait_until or delay is None:
            return False
        state.prefill_retries += 1
        state.prefill_retry_at = now + delay
        return True

    def _handoff_of(self, state: RequestState, chain_chunks: int) -> bytes | None:
        """The hand-off key a decode-side request (``do_remote_prefill``) looks up after its
        ``chain_chunks`` whole chunks: its prompt less the last token is what the prefill
        instance computed (:mod:`connector.handoff`). None where no hand-off is made."""
        request = state.request
        if not state.remote_prefill or not self._strict_prefix or request.num_tokens != request.num_prompt_tokens:
            return None
        named = self._handoff_named(state, request.num_tokens - 1)
        return named[0] if named is not None and named[2] == chain_chunks else None

    def _handoff_named(self, state: RequestState, m: int) -> tuple[bytes, bytes | None, int] | None:
        """``(key, parent key, whole chunks)`` of the hand-off of ``state``'s first ``m``
        tokens, the same on both sides (the prefill's prompt is the decode's less its last
        token); None where none is made: a drafter's lookahead, images, an empty tail, or no
        chain keys that far (connector.handoff)."""
        if self.keys.lookahead or getattr(state.request, "mm_features", None):
            return None
        C = self._geometry.chunk_size
        whole, tail = handoff_span(m, C)
        keys = self._keys_of(state, whole)
        if tail == 0 or len(keys) < whole:
            return None
        parent = keys[whole - 1] if whole else None
        tail_tokens = list(request_tokens(state.request, m)[whole * C:m])
        return handoff_key(parent, tail_tokens, state.request.cache_salt), parent, whole

    def _handoff_saves(self, state: RequestState) -> list[ObjectMove]:
        """A prefill-side request (``do_remote_decode``) has computed its prompt: its
        hand-off, the pages of its tail blocks and the states after its last token, copied
        in this step after the forward (:mod:`connector.handoff`)."""
        state.handoff_planned = True
        request = state.request
        m = request.num_prompt_tokens
        cap = state.save_limit()
        named = None if cap is not None and cap < m else self._handoff_named(state, m)
        if named is None:
            return []
        key, parent, whole = named
        geo = self._geometry
        C = geo.chunk_size
        manager = self.kv_cache_manager
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
        self._saves.stats["handoffs_saved"] += 1
        state.handoff_made = True
        return moves

    def _use_answer(self, state: RequestState, answer: LookupAnswer, start: int,
                    num_computed_tokens: int) -> tuple[int, bool]:
        session = self._session
        assert session is not None  # answers are used only under a session
        C = session.chunk_size
        n = answer.chunks
        held, handoff = answer.held_chunks(start), None
        if state.handoff_key is not None:  # the chain's chunks, then the hand-off
            chain = handoff_span(state.request.num_tokens - 1, C)[0]
            if n > chain:
                handoff = state.request.num_tokens - 1
            held, n_chain = min(held, chain), min(n, chain)
        else:
            n_chain = n
        state.hit = Hit(start, n, num_computed_tokens, held, answer.start_state, session, handoff)
        if start == 0 or (answer.held is not None and answer.held >= start):  # resumable from chunk 0
            self.events.found(state.request, state.keys, n_chain, self.namespace)
        resume = state.hit.resume_tokens()
        if resume <= num_computed_tokens or not self._loads:
            self._drop_lease(state)
            return 0, False
        request = state.request
        logger.debug(
            "GlmCacheConnector: %s hit %d chunks%s (%d tokens beyond local %d of %d)",
            request.request_id, n, " with the hand-off" if handoff is not None else "",
            resume - num_computed_tokens, num_computed_tokens, request.num_tokens,
        )
        return resume - num_computed_tokens, True

    def _forget_answer(self, state: RequestState) -> None:
        """The request's kept answer is not used: drop it and release its lease."""
        state.lookup = None
        self._drop_lease(state)

    def _discard_lookup(self, state: RequestState) -> None:
        """Forget a request's lookup in flight: one still queued is cancelled (never sent,
        so abandoned lookups do not pile up in front of the ones still wanted); a lease one
        already sent gets is released."""
        if state.lookup is not None and state.lookup.answered_at is None:
            if not state.lookup.future.cancel():
                self.remote.release_when_answered(state.lookup.future)
            state.lookup = None

    def _cold(self, state: RequestState) -> tuple[int, bool]:
        """Answer "nothing external" and end the request's admission."""
        self._discard_lookup(state)  # one still out
        self._forget_answer(state)  # one answered, and its lease
        state.admission_started = None
        return 0, False

    def _drop_lease(self, state: RequestState) -> None:
        lease_id, state.lease_id = state.lease_id, None
        if lease_id is not None:
            self.remote.release(lease_id)

    # Allocation: a hit becomes a load --------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.of(request)
        if state.bypass is None:
            self._guarded(state, "allocation", lambda: self._after_alloc(state, blocks, num_external_tokens), None)
        if state.bypass is not None and num_external_tokens > 0 and not state.load_in_flight:
            # vLLM now waits for a load: hand the worker a refused one, which it reports
            # failed, and vLLM recomputes the request.
            state.load_in_flight = True
            self._pending_loads.append(LoadJob(request.request_id, [], refused=f"not loading ({state.bypass})"))
        if state.bypass is not None:
            self._guarded(state, "allocation", lambda: self._drop_lease(state), None)

    def _after_alloc(self, state: RequestState, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        request = state.request
        if state.lookup is not None and state.lookup.answered_at is not None:
            state.lookup = None  # used: its lease is the load's (or dropped below)
        if self._rules.uncacheable(state):
            return  # never tracked: nothing of it is saved
        state.scheduled = True
        hit, state.hit = state.hit, None
        if hit is None:
            return
        self._check_media(state, hit.local_tokens)  # rows vLLM's prefix cache gives it
        C = self._geometry.chunk_size
        if hit.local_tokens and hit.local_tokens % C == 0:
            state.state_chunk = max(state.state_chunk, hit.local_tokens // C)  # resumed locally there
        # The server holds attention for chunks [0, held): don't send them again.
        state.saved_chunks = max(state.saved_chunks, hit.held)  # (a hand-off's: its chain's)
        if num_external_tokens == 0:
            self._drop_lease(state)
            self._pending_saves.extend(self._saves.local_state_resave(state, blocks, hit, self._geometry))
            return
        resume = hit.local_tokens + num_external_tokens
        if state.handoff_key is not None:
            self._saves.stats["handoffs_missed" if hit.handoff_tokens is None else "handoffs_loaded"] += 1
        job = self._load_job(state, blocks, hit, resume)
        state.load_in_flight = True
        self._pending_loads.append(job)
        if job.refused is not None:
            # vLLM now waits for this load: the worker reports it failed and vLLM
            # recomputes the request (nothing planned for it is loaded).
            logger.warning("GlmCacheConnector: %s: not loading (%s); recomputing", request.request_id, job.refused)
            self._drop_lease(state)
            return
        state.loaded_tokens = resume
        for it in state.media_items:  # rows under these identifiers now come from the server's content
            if it.offset < resume and it.offset + it.length > hit.local_tokens:
                self._media_ledger.record(it.identifier, it.digest)
        state.saved_chunks = max(state.saved_chunks, hit.whole_chunks())
        state.state_chunk = max(state.state_chunk, hit.whole_chunks())

    def _load_job(self, state: RequestState, blocks: KVCacheBlocks, hit: Hit, resume: int) -> LoadJob:
        """The load of ``hit``, or a refused one where it cannot be loaded as planned."""
        req_id = state.request.request_id
        C = self._geometry.chunk_size
        if hit.session.chunk_size != C:
            return LoadJob(req_id, [], refused=f"the hit is in chunks of {hit.session.chunk_size}, the server's are "
                                               f"now {C}")
        if resume != hit.resume_tokens():
            return LoadJob(req_id, [], refused=f"vLLM took {resume - hit.local_tokens} external tokens, not "
                                               f"{hit.resume_tokens() - hit.local_tokens}")
        try:
            return LoadJob(req_id, self._load_moves(state, blocks, hit))
        except (LookupError, ValueError) as e:
            return LoadJob(req_id, [], refused=str(e))

    def _load_moves(self, state: RequestState, blocks: KVCacheBlocks, hit: Hit) -> list[ObjectMove]:
        """The hit's objects and the blocks they go to: attention for the chunks beyond
        vLLM's local hit, and the states at the resume point."""
        C = self._geometry.chunk_size
        hashes = self._keys_of(state, hit.whole_chunks())[:hit.whole_chunks()]
        if hit.handoff_tokens is not None:
            assert state.handoff_key is not None
            hashes = hashes + [state.handoff_key]
        if len(hashes) < hit.end_chunk:
            raise LookupError(f"{len(hashes)} chunk keys for a hit of {hit.end_chunk} chunks")
        resume = hit.resume_tokens()
        moves: list[ObjectMove] = []
        for g in self._geometry.attn_groups:
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
        for g in self._geometry.state_groups:
            # vLLM resumes a recurrent state from the block of the last computed token
            blk = blocks.blocks[g.vllm_group][(resume - 1) // g.block_size]
            if blk.is_null:
                raise LookupError(f"no state block allocated at position {resume} for group {g.group_id}")
            moves.append(ObjectMove(hashes[hit.end_chunk - 1], g.group_id, [blk.block_id]))
        return moves

    # Each step: the plan for the workers ----------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._align_block_size()
        meta = GlmConnectorMetadata(
            namespace=self.namespace, loads=self._pending_loads, saves=self._pending_saves
        )
        self._pending_loads, self._pending_saves = [], []
        if not self._weights_meta(meta) or self.remote.session is None:
            return meta
        if not self._strict_prefix or not self._stores:  # a non-strict engine's states may be wrong
            meta.saves = []
            return meta
        self._record_encodings(scheduler_output)
        block_state = scheduler_output.kv_connector_block_state
        offloads = block_state.boundary_state_offloads if block_state is not None else {}
        for req_id, end in _tokens_after_step(scheduler_output).items():
            state = self._scheduled(req_id)
            if state is not None:
                meta.saves.extend(self._guarded(state, "save planning",
                                                lambda: owned(req_id, self._attention_saves(state, end)), []))
                if state.remote_decode and not state.handoff_planned and end >= state.request.num_prompt_tokens:
                    meta.saves.extend(self._guarded(state, "hand-off", lambda: owned(req_id, self._handoff_saves(state)),
                                                    []))
        for req_id, entries in offloads.items():
            state = self._scheduled(req_id)
            if state is not None:
                meta.saves.extend(self._guarded(state, "save planning", lambda: owned(
                    req_id, self._saves.state_saves(state, entries, self._geometry)), []))
        return meta

    def _record_encodings(self, scheduler_output: SchedulerOutput) -> None:
        """The images the workers encode this step, each from its own request's pixels:
        what vLLM's encoder cache (and the rows computed from it) holds under their
        identifiers from now on (:class:`connector.media.MediaLedger`)."""
        if self._trust_media_ids:
            return  # vLLM's identifiers are trusted as they are
        for req_id, inputs in (getattr(scheduler_output, "scheduled_encoder_inputs", None) or {}).items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            features = getattr(state.request, "mm_features", None) or ()
            by_index = {it.index: it for it in state.media_items}
            for i in inputs:
                item = by_index.get(i)
                if item is not None:
                    self._media_ledger.record(item.identifier, item.digest)
                elif 0 <= i < len(features):  # pixels not named here: the identifier vouches for nothing
                    self._media_ledger.record(str(features[i].identifier), None)

    def _attention_saves(self, state: RequestState, end: int) -> list[ObjectMove]:
        """A request's attention saves once ``end`` tokens are computed, first stopping its
        saves before any image it has reached whose identifier vouches for other content."""
        self._check_media(state, end)
        return self._saves.attention_saves(state, end, self._geometry, self.kv_cache_manager)

    def _check_media(self, state: RequestState, reached: int) -> None:
        """Stop ``state``'s saves before the first image among its first ``reached`` tokens
        whose rows or embeddings vLLM's caches may hold for other pixels (the ledger does
        not vouch for its identifier with this image's digest). The limit only moves down."""
        if not state.media_items:
            return
        limit = unvouched_from(state.media_items, self._media_ledger, reached, state.local_tokens,
                               state.loaded_tokens)
        if limit is not None and (state.media_limit is None or limit < state.media_limit):
            if state.media_limit is None:
                self._saves.stats["media_withheld"] += 1
            state.media_limit = limit

    def _scheduled(self, req_id: str) -> RequestState | None:
        state = self._requests.get(req_id)
        return state if state is not None and state.scheduled and state.bypass is None else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        self._weights_report(worker_meta)
        if isinstance(worker_meta, GlmWorkerMeta) and worker_meta.failed_saves:
            self._saves.failed(worker_meta.failed_saves, self._scheduled, self._geometry)
        for req_id in set(connector_output.finished_recving or ()):
            state = self._requests.get(req_id)
            if state is not None:
                state.load_in_flight = False
                self._drop_lease(state)
                if state.finished:
                    del self._requests[req_id]
        for req_id in connector_output.failed_recving or ():
            # vLLM recomputes it from scratch; offering the same hit again would loop.
            state = self._requests.get(req_id)
            if state is None or state.finished:
                continue
            state.load_failed = True
            if state.scheduled:
                # The scheduler recomputes from 0: those chunks are ours to save again.
                state.saved_chunks = 0
                state.loaded_tokens = 0

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.get(request.request_id)
        if state is None:
            return False, None
        return self._guarded(state, "finish", lambda: self._finished(state), (state.load_in_flight, None))

    def _finished(self, state: RequestState) -> tuple[bool, dict[str, Any] | None]:
        request = state.request
        self._discard_lookup(state)  # finished (aborted) while its lookup was out
        self._announce_saves(state)
        if state.load_in_flight:
            # A worker is still writing into these blocks: keep them, and the lease, until
            # it reports (update_connector_output); nothing more is planned for it.
            state.finished, state.scheduled, state.lookup, state.hit = True, False, None, None
            return True, None
        del self._requests[request.request_id]
        self._drop_lease(state)
        if state.remote_decode:
            # What the proxy passes on to the decode instance. Our key only: beside a
            # transfer connector (NIXL in a MultiConnector) the do_remote_* keys are its
            # (vLLM refuses a key two children return), and ours marks the hand-off.
            planned = min(state.saved_chunks, state.state_chunk) if self._stores else 0
            if state.handoff_made and self._stores:
                planned = state.saved_chunks + 1  # the whole chunks, then the hand-off
            return False, {HANDOFF_PARAM: state.handoff_made and self._stores, CHUNKS_PARAM: planned}
        return False, None

    def _announce_saves(self, state: RequestState) -> None:
        """A finished request's saves, for the KV events (connector.events): its chain is
        announced as deep as the server reports it resumable once the saves landed."""
        if not self.events.enabled or not state.scheduled or state.bypass is not None:
            return
        keys = state.keys[:max(state.saved_chunks, state.state_chunk)]
        self.events.saved(state.request, keys, min(state.saved_chunks, state.state_chunk), self.namespace)

    def events_pending(self) -> bool:
        """Whether an idle engine should step to publish KV events: vLLM reset its prefix
        cache since the last step (vLLM queues its ``AllBlocksCleared`` and publishes it only
        from a step: without one a router keeps scoring the dropped blocks), or a finished
        request's chunks are being confirmed on the server."""
        if not self.events.enabled:
            return False
        if self._events_map is not None and self._block_map() is not self._events_map:
            return True
        return self.events.pending()

    def take_events(self) -> list[Any]:
        """KV events of the server's chunks since the last step, published by vLLM after its
        own pool's events in the same batch; after a reset of vLLM's prefix cache (its
        ``AllBlocksCleared`` comes first in that batch) the server's chunks again."""
        current = self._block_map()
        cleared, self._events_map = self._events_map is not None and current is not self._events_map, current
        try:
            return self.events.take(cleared)
        except Exception as e:  # noqa: BLE001 - events never stop the engine
            logger.warning("GlmCacheConnector: KV events failed (%s: %.200s); none this step", type(e).__name__, e,
                           exc_info=e)
            return []

    # Weights at run time ---------------------------------------------------------------
    #
    # The namespace names the weights the workers compute with (connector.identity: the
    # workers name them by content and report changes with each step's output). After an
    # in-place change the engine moves to the new weights' namespace: requests under way
    # are not cached further (their KV mixes both weights), loads planned for the old
    # weights fail (vLLM recomputes), saves planned for them are dropped, and until vLLM's
    # prefix cache is reset, requests resuming from it are not cached (it holds blocks of
    # the old weights). Each step's plan names the weights it was made for, so a worker
    # whose weights changed before the scheduler heard of it moves nothing of it.

    def reset_cache(self) -> bool | None:
        """vLLM reset its caches and the connector's: a sleep (any level: 0.32 does not tell
        which), a pause that clears caches (``/pause``, ``pause_generation``: how an RL
        weight update starts), ``reset_prefix_cache(reset_connector=True)``. Nothing is
        cleared on the server: its objects belong to every replica on these weights, and an
        engine whose weights change moves to another namespace instead. The weights may
        change before the next step, so lookups and saves wait until every worker has named
        its weights again (the next step's output; :class:`~connector.identity.WeightsView`).
        Clearing the server is the server's: ``POST /cache/clear``."""
        self._reset_fresh = self._block_map() is not self._last_map  # vLLM replaced its prefix cache
        self._weights.reset()
        self._pending_saves = []
        logger.info("GlmCacheConnector: vLLM reset its caches (sleep, pause or reset_prefix_cache): glm-cache-server "
                    "keeps its objects; lookups and saves wait until the workers have named their weights again")
        return True

    def _block_map(self) -> Any:
        """vLLM's prefix-cache map (a new object after each reset of its prefix cache)."""
        return getattr(getattr(self.kv_cache_manager, "block_pool", None), "cached_block_hash_to_block", None)

    def _server_ready(self) -> Session | Literal[False] | None:
        """:meth:`_ready`, or None (not yet) while the weights are not known."""
        return self._ready() if self._weights.verified else None

    def _weights_meta(self, meta: GlmConnectorMetadata) -> bool:
        """Name in the plan the weights it is made for; False (nothing saved this step)
        while they are not known."""
        meta.weights, meta.weights_seq = self._weights.expected(), self._weights.seq
        self._prev_map, self._last_map = self._last_map, self._block_map()
        if self._weights.verified and self._fingerprint is not None:
            return True
        meta.saves = []
        return False

    def _weights_report(self, worker_meta: Any) -> None:
        """The workers' weights, reported with a step's output."""
        reports = worker_meta.weights if isinstance(worker_meta, GlmWorkerMeta) else None
        if not reports:
            return
        outcome = self._weights.report(reports)
        if outcome is None:
            return
        old, new, answered_reset = outcome
        if new == old:
            logger.info("GlmCacheConnector: the workers named their weights again: unchanged (namespace %s)",
                        self._fingerprint)
            return
        self._weights_changed(new, answered_reset)

    def _weights_changed(self, tokens: tuple[str | None, ...], answered_reset: bool) -> None:
        before, self._fingerprint = self._fingerprint, self._names.of(tokens)
        under_way = 0
        for state in self._requests.values():
            if state.bypass is None and (state.scheduled or state.load_in_flight):
                # it holds KV computed (or being loaded) for the old weights: what it computes
                # next mixes both; a request not yet allocated is admitted afresh
                state.bypass, state.scheduled = "under way while the weights changed", False
                under_way += 1
        for job in self._pending_loads:
            job.objects, job.refused = [], job.refused or "the weights changed in place"
        self._pending_saves = []
        # What vLLM's prefix cache holds was computed by the weights the workers just named
        # after a reset that replaced it, or when it was replaced between the last two steps
        # (LLM.reset_prefix_cache() after reload_weights: no step ran in between); otherwise
        # it still holds the old weights' blocks.
        current = self._block_map()
        replaced = current is not None and current is self._last_map and self._last_map is not self._prev_map
        self._rules.stale_map = None if (answered_reset and self._reset_fresh) or replaced else current
        self._saves.stats["weights_changes"] += 1
        self.events.forget_all("the weights changed in place")
        self._session = None  # a handshake under the new namespace brings the next
        self.remote.rename(self._fingerprint)
        if self._fingerprint is None:
            logger.error("GlmCacheConnector: the weights changed and a worker cannot name them (%s); serving "
                         "without the external cache", tokens)
            return
        logger.warning(
            "GlmCacheConnector: the weights changed in place (%s, content digests %s): namespace %s -> %s; "
            "%d request(s) under way are not cached further%s", "seen after a reset" if answered_reset
            else "seen after load_weights", [t or "start-up" for t in tokens], before, self._fingerprint, under_way,
            "" if self._rules.stale_map is None else "; vLLM's prefix cache still holds blocks of the old weights: "
            "requests resuming from it are not cached until it is reset",
        )

    def shutdown(self) -> None:
        self.remote.shutdown()


def _tokens_after_step(so: SchedulerOutput) -> dict[str, int]:
    """Tokens each scheduled request will have computed once this step's forward ran."""
    out: dict[str, int] = {}
    for new in so.scheduled_new_reqs:
        out[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        out[req_id] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
    return out
