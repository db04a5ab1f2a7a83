"""The scheduler side of :class:`~connector.glm_connector.GlmCacheConnector`: vLLM's
scheduler hooks. It decides; the worker side moves bytes.

It looks prefixes up under the strict-prefix rule, turns a hit into a load plan once vLLM
has allocated the request's blocks, and each step writes a plain
:class:`~connector.metadata.GlmConnectorMetadata`: which objects to load into which
blocks, which blocks to save under which keys. The server is asked through
:class:`~connector.remote.RemoteCache`, which answers "not yet" rather than wait; saves
are planned by :class:`~connector.saves.SavePlanner`; each request's state is one
:class:`~connector.requests.RequestState`.

What it plans is in modules of their own, each given what it needs: loads
(:mod:`connector.loads`), the PD hand-off's keys and saves (:mod:`connector.handoff_plans`),
the weights the workers compute with (:mod:`connector.weights_view`), which recurrent states
vLLM keeps for it to save (:mod:`connector.state_retention`), and the log of requests served
uncached (:mod:`connector.request_errors`). What stays here is vLLM's hooks, the session, and
each request's lookup on its way to admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from connector.admission import AdmissionRules
from connector.config import SchedulerBlockAligner, Settings, kv_role, logger, require_recompute_on_load_failure, strict_prefix
from connector.events import ServerEvents
from connector.geometry import Geometry, strict_prefix_chunks
from connector.handoff import handoff_span, prefill_saves_pending
from connector.handoff_plans import handoff_lookup, handoff_params, handoff_saves
from connector.keys import ChunkKeys
from connector.loads import fence_under_way, loads_reported, plan_load
from connector.media import MediaLedger
from connector.metadata import GlmConnectorMetadata, GlmWorkerMeta, LoadJob, ObjectMove
from connector.namespace import Namespace
from connector.remote import LookupAnswer, RemoteCache, Session
from connector.request_errors import ErrorLog
from connector.requests import Hit, Lookup, Requests, RequestState, record_encodings
from connector.saves import SavePlanner, owned, tokens_after_step
from connector.state_retention import retention_warnings
from connector.weights_view import WeightsView, change_line

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
        self._strict_prefix = strict_prefix(settings)
        self._url = settings.url
        self._timeout_s = settings.timeout_s
        self._loads, self._stores = kv_role(vllm_config, settings)  # PD instances: one of the two
        self._align_block_size = SchedulerBlockAligner(vllm_config, geometry)
        parallel = vllm_config.parallel_config
        world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        # the namespace: key scheme, weights, engine, drafts, media (connector.namespace)
        self._names = names = Namespace(vllm_config, kv_cache_config, settings, geometry, row_format, numerics)
        self._trust_media_ids = settings.trust_media_ids
        # a drafter's lookahead joins every chunk key (cache_server.chunk_keys.lookahead_keys)
        self.keys = ChunkKeys(names.scheme, names.hash_span, names.drafts.lookahead)
        self._drafts = names.drafts
        self._weights = WeightsView(world_size)  # and vLLM's prefix-cache map as of its plans
        self._fingerprint = self._names.of(self._weights.tokens)
        self._session: Session | None = None  # the server's, as last handed over (None: none under these weights)
        self._logged_geometry: Geometry | None = None
        self._requests = Requests()
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[ObjectMove] = []
        self._error_log = ErrorLog()  # of requests served uncached after their data raised
        self._media_ledger = MediaLedger()  # what vLLM's caches hold under each media identifier
        self._saves = SavePlanner(self.keys, settings.save_decode, self._media_ledger)
        self.save_stats = self._saves.stats
        self._rules = AdmissionRules(names.scheme.span is not None, settings.trust_media_ids, self._saves.stats)
        disabled = settings.auth_broken or refused_layout is not None or names.identity is None
        self.remote = RemoteCache(settings, disabled, world_size, geometry, self._fingerprint, names.chunk_keys())
        # KV events for routers: what the server can resume, published by vLLM (connector.events)
        self.events = ServerEvents(vllm_config, kv_cache_config, geometry,
                                   lambda ns, keys: self.remote.lookup(ns, keys, 0, False))
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
            for line in retention_warnings(self._geometry, self._drafts,
                                           self._vllm_config.scheduler_config.max_num_batched_tokens,
                                           self._kv_cache_config.prefix_cache_retention_interval):
                logger.warning("%s", line)
            self._logged_geometry = self._geometry
            if previous is not None and previous.chunk_size != self._geometry.chunk_size:
                logger.warning("GlmCacheConnector: glm-cache-server %s now negotiates chunk size %d (was %d): "
                               "requests under way save again from their first chunk under the new grid", self._url,
                               self._geometry.chunk_size, previous.chunk_size)
                self._saves.new_grid(self._requests.values())
                self._pending_saves = []  # planned on the old grid
                self.events.forget_all("the server's chunk size changed")
        geo = self._geometry
        logger.info("GlmCacheConnector: server %s, namespace %s, state groups %s, attention groups %s", self._url,
                    self.namespace, [g.group_id for g in geo.state_groups], [g.group_id for g in geo.attn_groups])

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
        on (never looked up, loaded or saved again), count it, and say so (at most one line
        a minute per hook: :class:`~connector.request_errors.ErrorLog`)."""
        state.bypass = f"{where}: {type(error).__name__}"
        state.scheduled = False
        self._saves.stats["request_errors"] += 1
        self._error_log.warn(where, state.request.request_id, error)

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
        ready = self._ready() if self._weights.verified else None  # not yet while the weights are not known
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
        handoff = (handoff_lookup(state, self.keys, self._geometry.chunk_size, max_chunks)
                   if self._loads and self._strict_prefix else None)
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
        if prefill_saves_pending(state, answer.chunks, max_chunks, self._timeout_s):
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
        self._saves.check_media(state, hit.local_tokens)  # rows vLLM's prefix cache gives it
        job = plan_load(state, blocks, hit, num_external_tokens, self._geometry, self.keys, self._media_ledger,
                        self._saves.stats)
        if job is None:
            self._drop_lease(state)
            self._pending_saves.extend(self._saves.local_state_resave(state, blocks, hit, self._geometry))
            return
        self._pending_loads.append(job)
        if job.refused is not None:
            # vLLM now waits for this load: the worker reports it failed and vLLM
            # recomputes the request (nothing planned for it is loaded).
            logger.warning("GlmCacheConnector: %s: not loading (%s); recomputing", request.request_id, job.refused)
            self._drop_lease(state)

    # Each step: the plan for the workers ----------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._align_block_size()
        meta = GlmConnectorMetadata(
            namespace=self.namespace, loads=self._pending_loads, saves=self._pending_saves
        )
        self._pending_loads, self._pending_saves = [], []
        if not self._weights.stamp(meta, self._block_map()) or self._fingerprint is None:
            meta.saves = []  # planned for weights not known: nothing is saved
            return meta
        if self.remote.session is None:
            return meta
        if not self._strict_prefix or not self._stores:  # a non-strict engine's states may be wrong
            meta.saves = []
            return meta
        if not self._trust_media_ids:  # else vLLM's identifiers are trusted as they are
            record_encodings(self._media_ledger, getattr(scheduler_output, "scheduled_encoder_inputs", None) or {},
                                                self._requests)
        block_state = scheduler_output.kv_connector_block_state
        offloads = block_state.boundary_state_offloads if block_state is not None else {}
        for req_id, end in tokens_after_step(scheduler_output).items():
            state = self._scheduled(req_id)
            if state is not None:
                meta.saves.extend(self._guarded(state, "save planning", lambda: owned(req_id, self._saves.attention_saves(
                    state, end, self._geometry, self.kv_cache_manager)), []))
                if state.remote_decode and not state.handoff_planned and end >= state.request.num_prompt_tokens:
                    meta.saves.extend(self._guarded(state, "hand-off", lambda: owned(req_id, handoff_saves(
                        state, self.keys, self._geometry, self.kv_cache_manager, self._saves.stats)), []))
        for req_id, entries in offloads.items():
            state = self._scheduled(req_id)
            if state is not None:
                meta.saves.extend(self._guarded(state, "save planning", lambda: owned(
                    req_id, self._saves.state_saves(state, entries, self._geometry)), []))
        return meta

    def _scheduled(self, req_id: str) -> RequestState | None:
        state = self._requests.get(req_id)
        return state if state is not None and state.scheduled and state.bypass is None else None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        self._weights_report(worker_meta)
        if isinstance(worker_meta, GlmWorkerMeta) and worker_meta.failed_saves:
            self._saves.failed(worker_meta.failed_saves, self._scheduled, self._geometry)
        for state in loads_reported(self._requests, connector_output.finished_recving or (),
                                    connector_output.failed_recving or ()):
            self._drop_lease(state)  # the load's, now it is done

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
        return False, handoff_params(state, self._stores) if state.remote_decode else None

    def _announce_saves(self, state: RequestState) -> None:
        """A finished request's saves, for the KV events (connector.events): its chain is
        announced as deep as the server reports it resumable once the saves landed."""
        if not self.events.enabled or not state.scheduled or state.bypass is not None:
            return
        keys = state.keys[:max(state.saved_chunks, state.state_chunk)]
        self.events.saved(state.request, keys, min(state.saved_chunks, state.state_chunk), self.namespace)

    def events_pending(self) -> bool:
        """Whether an idle engine should step to publish KV events: vLLM reset its prefix
        cache since the last step, or a finished request's chunks are being confirmed on the
        server (:meth:`~connector.events.ServerEvents.step_pending`)."""
        return self.events.step_pending(self._block_map())

    def take_events(self) -> list[Any]:
        """KV events of the server's chunks since the last step, published by vLLM after its
        own pool's events in the same batch (:meth:`~connector.events.ServerEvents.take_step`)."""
        return self.events.take_step(self._block_map())

    # Weights at run time (connector.weights_view) ------------------------------------------

    def reset_cache(self) -> bool | None:
        """vLLM reset its caches and the connector's: a sleep (any level: 0.32 does not tell
        which), a pause that clears caches (``/pause``, ``pause_generation``: how an RL
        weight update starts), ``reset_prefix_cache(reset_connector=True)``. Nothing is
        cleared on the server: its objects belong to every replica on these weights, and an
        engine whose weights change moves to another namespace instead. The weights may
        change before the next step, so lookups and saves wait until every worker has named
        its weights again (the next step's output; :class:`~connector.weights_view.WeightsView`).
        Clearing the server is the server's: ``POST /cache/clear``."""
        self._weights.reset(self._block_map())
        self._pending_saves = []
        logger.info("GlmCacheConnector: vLLM reset its caches (sleep, pause or reset_prefix_cache): glm-cache-server "
                    "keeps its objects; lookups and saves wait until the workers have named their weights again")
        return True

    def _block_map(self) -> Any:
        """vLLM's prefix-cache map (a new object after each reset of its prefix cache)."""
        return getattr(getattr(self.kv_cache_manager, "block_pool", None), "cached_block_hash_to_block", None)

    def _weights_report(self, worker_meta: Any) -> None:
        """The workers' weights, reported with a step's output: after a change, the engine
        moves to the new weights' namespace (:mod:`connector.weights_view`)."""
        reports = worker_meta.weights if isinstance(worker_meta, GlmWorkerMeta) else None
        outcome = self._weights.report(reports) if reports else None
        if outcome is None:
            return
        old, tokens, answered_reset = outcome
        if tokens == old:
            logger.info("GlmCacheConnector: the workers named their weights again: unchanged (namespace %s)",
                        self._fingerprint)
            return
        before, self._fingerprint = self._fingerprint, self._names.of(tokens)
        under_way = fence_under_way(self._requests.values(), self._pending_loads)
        self._pending_saves = []
        self._rules.stale_map = self._weights.stale_map(self._block_map(), answered_reset)
        self._saves.stats["weights_changes"] += 1
        self.events.forget_all("the weights changed in place")
        self._session = None  # a handshake under the new namespace brings the next
        self.remote.rename(self._fingerprint)
        if self._fingerprint is None:
            logger.error("GlmCacheConnector: the weights changed and a worker cannot name them (%s); serving "
                         "without the external cache", tokens)
        else:
            logger.warning("%s", change_line(tokens, answered_reset, before, self._fingerprint, under_way,
                                             self._rules.stale_map is not None))

    def shutdown(self) -> None:
        self.remote.shutdown()

