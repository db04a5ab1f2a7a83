"""KV events for routers: what glm-cache-server can resume, announced in vLLM's own format.

A KV-aware router (Dynamo's KV router and standalone indexer, llm-d's scheduler, a custom
one) indexes the ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events each
replica publishes with ``--kv-events-config``. vLLM publishes its own pool's blocks
(``medium="GPU"``); this module adds what the replica can load from glm-cache-server,
through vLLM's connector event path (``KVConnectorBase_V1.take_events``, which vLLM's
scheduler drains after its own pool's events every step and publishes in the same
``KVEventBatch``, with the same sequence numbers and replay buffer), so every existing
subscriber sees it without new software:

* ``BlockStored(medium="CPU")`` (vLLM's ``MEDIUM_CPU``: the server's L1, host memory) for the
  attention group's blocks of each chunk the server can resume, with vLLM's own block
  hashes for those tokens and salt (``request.block_hashes`` at the group's block size, as
  vLLM's pool events carry them), ``parent_block_hash``, ``token_ids``, ``extra_keys``,
  ``group_idx`` and ``kv_cache_spec_kind`` as vLLM fills them. A chunk an L2 tier holds is
  resumable too (the server promotes it at lookup), and is announced as ``CPU`` as well: the
  lookup does not say which tier answered.
* Only what a strict-prefix hit can resume: a chain of chunk keys is announced up to the
  depth the server itself reports for it (a lookup without a lease: attention objects of
  chunks ``0..d-1`` for every group and rank, and the KDA states at chunk ``d-1``), never
  past it. Nothing is announced from the plan alone: saves travel asynchronously and may
  not land.
* ``BlockRemoved(medium="CPU")`` when a later lookup of an announced chain finds it
  shallower (an eviction by any replica's traffic, a ``/cache/clear``, a restart): chains
  are looked up again every :data:`RECHECK_S` while the engine steps; a step that finds
  chains due starts a round that rechecks all of them before the engine idles, so one
  request after a clear is enough to announce every removal. A chunk several
  chains reach stays announced while one of them still resumes past it.
* After vLLM resets its own prefix cache it publishes ``AllBlocksCleared`` (no medium), and
  routers drop every tier of the replica on it (measured: Dynamo 1.6.1's indexer scores 0
  at ``cpu`` after it); the server still holds the chunks, so they are announced again in
  the same batch, after the clear.

Which chains: those this replica saved (looked up shortly after the request finishes, again
after back-offs until the server reports the depth the saves should reach), and those its
admission lookups found (saved by any replica attached to the server), so every replica
announces what it can load.

Bounded: at most :data:`MAX_CHAINS` chains, :data:`MAX_CHUNKS` chunks and
:data:`MAX_TOKENS` token ids are remembered (the oldest chain is forgotten first, its
chunks announced as removed); rechecks are paced (:data:`RECHECKS_PER_S`); at most
:data:`MAX_QUEUED_EVENTS` events wait for ``take_events`` (the oldest are dropped and
counted). Disabled (no work, nothing kept) unless ``--kv-events-config`` enables events.

Not announced: what a router cannot index correctly. A resume needs a KDA state at its
end, and block events cannot say at which blocks a state exists: a request sharing only
the first ``j`` chunks of an announced chain is scored ``j`` chunks, though the server
resumes it at the deepest state it holds at or before chunk ``j`` (snapshot-aware
retention keeps states at fork points, so this is usually ``j``).
"""

from __future__ import annotations

import array
import collections
import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.config import logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from connector.geometry import Geometry
    from connector.remote import LookupAnswer

# vLLM's medium names (vllm.distributed.kv_events.MEDIUM_CPU): the server's L1 is host memory.
MEDIUM_SERVER = "CPU"

MAX_CHAINS = 1024  # chains remembered (each: its chunk keys and state)
MAX_CHUNKS = 32768  # chunks remembered (each: block hashes and token ids, 4 bytes a token)
MAX_TOKENS = 1 << 23  # token ids remembered in all (32 MiB; 7282 chunks of 1152 tokens)
MAX_QUEUED_EVENTS = 8192  # events waiting for take_events
MAX_INFLIGHT = 4  # verification lookups on the lookup thread at once (admissions share it)
# After a request finishes, its chain is looked up after each of these delays (from the
# last answer) until the server reports the depth its saves should reach: saves are sent
# from a worker thread after the step's forward, and may land after the first lookup.
VERIFY_DELAYS_S = (0.05, 0.3, 1.0, 3.0)
RECHECK_S = 2.0  # announced chains are looked up again this often (while the engine steps)
# ... but at most this many rechecks a second in all (each a lookup of about 0.4 ms on the
# lookup thread, which admissions share): 1024 chains are each rechecked every ~20 s.
RECHECKS_PER_S = 50.0
# While a verification is pending and vLLM has no request, the engine steps only to let us
# publish (has_pending_push_work); each idle step waits this long at most, so an idle
# engine steps at most ~200 times a second during the few seconds a verification takes.
IDLE_STEP_WAIT_S = 0.005


@dataclass
class _Group:
    """One attention KV cache group of vLLM's, as its events name it."""

    idx: int  # vLLM's KV cache group index (group_idx)
    block_size: int
    kind: str | None  # vLLM's KVCacheSpecKind value (kv_cache_spec_kind)
    window: int | None  # kv_cache_spec_sliding_window


@dataclass
class _Chunk:
    """What one chunk's events carry (per attention group), and who reaches it."""

    hashes: list[tuple[int, ...]]  # per group: vLLM's block hashes of the chunk's blocks
    parents: list[int | None]  # per group: the block hash before the chunk (None: first)
    tokens: array.array  # the chunk's token ids (uint32)
    extra: list[list[Any] | None]  # per group: vLLM's extra_keys per block (None: none)
    holders: int = 0  # chains whose keys reach it
    refs: int = 0  # chains the server resumes past it: announced while > 0


@dataclass
class _Chain:
    """A prefix's chunk keys and how deep the server resumes it."""

    keys: list[bytes]
    depth: int = 0  # chunks announced for this chain (the server's depth at the last lookup)
    expected: int = 0  # the depth its saves should reach (verifications retry until then)
    tries: int = 0  # verifications done
    due: float = 0.0  # next lookup (monotonic time)
    future: Future[LookupAnswer] | None = None
    namespace: str = ""


@dataclass
class EventStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    reannounced_blocks: int = 0
    dropped_events: int = 0
    lookups: int = 0
    forgotten_chains: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether ``--kv-events-config`` enables KV cache events on this engine."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def attention_groups(geometry: Geometry, kv_cache_config: KVCacheConfig) -> list[_Group]:
    """The distinct vLLM KV cache groups the geometry's attention objects read, with the
    spec kind vLLM's own helpers give them (the MLA latent and indexer share one)."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # a vLLM without them: the kind stays unspecified
        get_kv_cache_spec_kind = get_kv_cache_spec_sliding_window = None  # type: ignore[assignment]
    groups: list[_Group] = []
    for g in geometry.attn_groups:
        if any(x.idx == g.vllm_group for x in groups):
            continue
        spec = kv_cache_config.kv_cache_groups[g.vllm_group].kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value if get_kv_cache_spec_kind is not None else None
        window = get_kv_cache_spec_sliding_window(spec) if get_kv_cache_spec_sliding_window is not None else None
        groups.append(_Group(g.vllm_group, g.block_size, kind, window))
    return groups


def _event_hash(h: Any) -> Any:
    """A block hash as vLLM's events carry it (an int by default: the low 64 bits,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)


class ServerEvents:
    """The connector's KV events (scheduler side). ``lookup(namespace, keys)`` returns a
    future of the server's :class:`~connector.remote.LookupAnswer` for ``keys`` from chunk 0
    without a lease; ``geometry`` the engine's, on the current session's grid (the scheduler
    sets it with each session)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 geometry: Geometry,
                 lookup: Callable[[str, list[bytes]], Future[LookupAnswer]]) -> None:
        self.enabled = events_enabled(vllm_config)
        self._kv_cache_config = kv_cache_config
        self.geometry = geometry
        self._lookup = lookup
        self._groups: list[_Group] | None = None
        self._hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        self._chains: collections.OrderedDict[bytes, _Chain] = collections.OrderedDict()
        self._chunks: dict[bytes, _Chunk] = {}
        self._tokens = 0  # token ids held by _chunks
        self._queue: collections.deque[Any] = collections.deque()
        self._inflight: dict[bytes, _Chain] = {}  # chains whose lookup is out
        self._verifying: set[bytes] = set()  # chains confirming a finished request's saves
        # when each chain is looked up next: (time, n, chain id), stale entries skipped
        self._verify_at: list[tuple[float, int, bytes]] = []
        self._recheck_at: list[tuple[float, int, bytes]] = []
        self._n = itertools.count()
        self._recheck_budget = 0.0  # rechecks that may be sent now (refilled at RECHECKS_PER_S)
        # A recheck round: started by a step that finds chains due, it rechecks every chain
        # due at its start before the engine may idle (the pacing spreads it over steps).
        self._round_from: float | None = None
        self._budget_at = time.monotonic()
        self._vllm_map: Any = None  # vLLM's prefix-cache map at the last step (take_step)
        self.stats = EventStats()

    # What the scheduler tells us --------------------------------------------------------

    def saved(self, request: Request, keys: list[bytes], expected: int, namespace: str) -> None:
        """``request`` finished with saves planned that should make its prefix ``keys``
        resumable ``expected`` chunks deep: look the chain up shortly (the saves may still
        be on their way), and again until the server reports that depth."""
        if not self.enabled or expected <= 0 or not namespace:
            return
        chain = self._track(request, keys, namespace)
        if chain is None:
            return
        chain.expected = max(chain.expected, expected)
        if chain.depth < chain.expected:
            chain.tries = 0
            self._verifying.add(chain.keys[-1])
            if chain.future is None:  # else the answer schedules the next one
                self._at(self._verify_at, chain, time.monotonic() + VERIFY_DELAYS_S[0])

    def found(self, request: Request, keys: list[bytes], depth: int, namespace: str) -> None:
        """A lookup found ``request``'s prefix resumable on the server ``depth`` chunks
        deep from chunk 0 (saved by any replica): announce it now."""
        if not self.enabled or depth <= 0 or not namespace:
            return
        chain = self._track(request, keys[:depth], namespace)
        if chain is None:
            return
        chain.expected = max(chain.expected, depth)
        if depth > chain.depth:
            self._set_depth(chain, depth)
        chain.tries = len(VERIFY_DELAYS_S)
        self._verifying.discard(chain.keys[-1])
        if chain.future is None:
            self._at(self._recheck_at, chain, time.monotonic() + RECHECK_S)

    def forget_all(self, why: str) -> None:
        """Nothing announced can be loaded any more (the namespace or the chunk grid
        changed): announce every chunk removed and forget every chain."""
        if not self.enabled or not self._chains:
            return
        n = len(self._chains)
        for chain in list(self._chains.values()):
            self._drop_chain(chain)
        logger.info("GlmCacheConnector: KV events: %d chain(s) announced as removed (%s)", n, why)

    # What vLLM asks -------------------------------------------------------------------------

    def take(self, vllm_cleared: bool = False) -> list[Any]:
        """The events since the last call. ``vllm_cleared``: vLLM reset its prefix cache
        since the last call, and the ``AllBlocksCleared`` it published in this batch (before
        ours) made routers forget the server's chunks too: announce them again."""
        if not self.enabled:
            return []
        if vllm_cleared:
            self._reannounce()
        self._harvest()
        self._submit()
        if not self._queue:
            return []
        out = list(self._queue)
        self._queue.clear()
        return out

    def take_step(self, vllm_map: Any) -> list[Any]:
        """:meth:`take` for an engine step, ``vllm_map`` being vLLM's prefix-cache map (a new
        object after each reset of it); where events fail, the step has none."""
        cleared, self._vllm_map = self._vllm_map is not None and vllm_map is not self._vllm_map, vllm_map
        try:
            return self.take(cleared)
        except Exception as e:  # noqa: BLE001 - events never stop the engine
            logger.warning("GlmCacheConnector: KV events failed (%s: %.200s); none this step", type(e).__name__, e,
                           exc_info=e)
            return []

    def step_pending(self, vllm_map: Any) -> bool:
        """Whether an idle engine should step: vLLM reset its prefix cache since the last step
        (``vllm_map`` as for :meth:`take_step`; vLLM publishes its ``AllBlocksCleared`` only
        from a step: without one a router keeps scoring the dropped blocks), or :meth:`pending`."""
        if self.enabled and self._vllm_map is not None and vllm_map is not self._vllm_map:
            return True
        return self.pending()

    def pending(self) -> bool:
        """Whether the engine should step without requests, to publish what a pending
        verification brings (vLLM publishes only from a step); waits a little while
        nothing is ready, so an idle engine does not spin."""
        if not self.enabled:
            return False
        if self._queue:
            return True
        if any(c.future is not None and c.future.done() for c in self._inflight.values()):
            return True
        if self._verify_at and self._verify_at[0][0] <= time.monotonic():
            return True
        waiting = bool(self._inflight or self._verifying or self._round_from is not None)
        if waiting:
            time.sleep(IDLE_STEP_WAIT_S)
        return waiting

    # Chains and chunks ------------------------------------------------------------------

    def _groups_now(self) -> list[_Group]:
        if self._groups is None:
            self._groups = attention_groups(self.geometry, self._kv_cache_config)
        return self._groups

    def _track(self, request: Request, keys: list[bytes], namespace: str) -> _Chain | None:
        """The chain of ``keys`` (created, with its chunks' event data taken from
        ``request``, if new), most recently used."""
        if not keys:
            return None
        cid = keys[-1]
        chain = self._chains.get(cid)
        if chain is not None and chain.namespace == namespace:
            self._chains.move_to_end(cid)
            return chain
        if chain is not None:  # another namespace: the old one's chunks cannot be loaded
            self._drop_chain(chain)
        try:
            self._snapshot(request, keys)
        except Exception as e:  # noqa: BLE001 - request data never stops the engine
            logger.debug("GlmCacheConnector: KV events: cannot describe %.64s (%s)", request.request_id, e)
            return None
        chain = _Chain(keys=list(keys), namespace=namespace)
        for k in keys:
            self._chunks[k].holders += 1
        self._chains[cid] = chain
        self._bound()
        return chain

    def _snapshot(self, request: Request, keys: list[bytes]) -> None:
        """Event data of the chunks of ``keys`` not yet known, from ``request``."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, resolve_block_hashes

        try:
            from vllm.v1.core.kv_cache_utils import to_event_extra_keys
        except ImportError:  # older vLLM: extra keys as they are
            to_event_extra_keys = lambda x: x  # noqa: E731
        C = self.geometry.chunk_size
        groups = self._groups_now()
        missing = [k for k, key in enumerate(keys) if key not in self._chunks]
        if not missing:
            return
        if self._hash_block_size is None or not groups:
            raise ValueError("no block hashes or no attention group")
        tokens = request.all_token_ids
        need = len(keys) * C
        if len(tokens) < need:
            raise ValueError(f"{len(tokens)} tokens, {need} needed")
        views = [resolve_block_hashes(request.block_hashes, self._hash_block_size, g.block_size) for g in groups]
        for k in missing:
            hashes, parents, extra = [], [], []
            for g, view in zip(groups, views):
                per = C // g.block_size
                first = k * per
                if len(view) < first + per:
                    raise ValueError(f"vLLM has hashed {len(view)} blocks of {g.block_size}, {first + per} needed")
                hashes.append(tuple(_event_hash(view[i]) for i in range(first, first + per)))
                parents.append(_event_hash(view[first - 1]) if first > 0 else None)
                keys_per_block, mm = [], 0
                for i in range(first, first + per):
                    ek, mm = generate_block_hash_extra_keys(request, i * g.block_size, (i + 1) * g.block_size, mm)
                    keys_per_block.append(ek)
                extra.append(to_event_extra_keys(keys_per_block))
            self._chunks[keys[k]] = _Chunk(hashes, parents, array.array("I", tokens[k * C:(k + 1) * C]), extra)
            self._tokens += C

    def _bound(self) -> None:
        while len(self._chains) > MAX_CHAINS or (
                (len(self._chunks) > MAX_CHUNKS or self._tokens > MAX_TOKENS) and len(self._chains) > 1):
            _, oldest = next(iter(self._chains.items()))
            self._drop_chain(oldest)
            self.stats.forgotten_chains += 1

    def _drop_chain(self, chain: _Chain) -> None:
        cid = chain.keys[-1]
        if chain.future is not None:  # its answer is not wanted (a lookup without a lease)
            chain.future.cancel()
            chain.future = None
            self._inflight.pop(cid, None)
        self._verifying.discard(cid)
        self._set_depth(chain, 0)
        self._chains.pop(chain.keys[-1], None)
        for k in chain.keys:
            c = self._chunks.get(k)
            if c is not None:
                c.holders -= 1
                if c.holders <= 0:
                    del self._chunks[k]
                    self._tokens -= len(c.tokens)

    def _set_depth(self, chain: _Chain, depth: int) -> None:
        """The server resumes ``chain`` ``depth`` chunks deep: stores for chunks newly
        reached by any chain, removals for chunks no chain reaches any more."""
        depth = max(0, min(depth, len(chain.keys)))
        old, chain.depth = chain.depth, depth
        if depth > old:
            new = []
            for k in range(old, depth):
                c = self._chunks[chain.keys[k]]
                c.refs += 1
                if c.refs == 1:
                    new.append(k)
            self._announce(chain, new)
        elif depth < old:
            gone = []
            for k in range(old - 1, depth - 1, -1):  # deepest first
                c = self._chunks[chain.keys[k]]
                c.refs -= 1
                if c.refs == 0:
                    gone.append(c)
            self._remove(gone)

    # Events ---------------------------------------------------------------------------------

    def _push(self, event: Any) -> None:
        if len(self._queue) >= MAX_QUEUED_EVENTS:
            self._queue.popleft()
            self.stats.dropped_events += 1
        self._queue.append(event)

    def _announce(self, chain: _Chain, ks: Iterable[int], counter: str = "stored_blocks") -> None:
        """BlockStored for chunks ``ks`` (ascending) of ``chain``: one event per group and
        run of consecutive chunks, as vLLM's pool emits one per group and step."""
        from vllm.distributed.kv_events import BlockStored

        runs: list[list[int]] = []
        for k in ks:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        for run in runs:
            chunks = [self._chunks[chain.keys[k]] for k in run]
            tokens = [t for c in chunks for t in c.tokens]
            for gi, g in enumerate(self._groups_now()):
                hashes = [h for c in chunks for h in c.hashes[gi]]
                extra = [e for c in chunks for e in (c.extra[gi] or [None] * len(c.hashes[gi]))]
                self._push(BlockStored(
                    block_hashes=hashes, parent_block_hash=chunks[0].parents[gi], token_ids=tokens,
                    block_size=g.block_size, lora_id=None, medium=MEDIUM_SERVER, lora_name=None,
                    extra_keys=extra if any(e is not None for e in extra) else None,
                    group_idx=g.idx, kv_cache_spec_kind=g.kind, kv_cache_spec_sliding_window=g.window,
                ))
                setattr(self.stats, counter, getattr(self.stats, counter) + len(hashes))

    def _remove(self, chunks: list[_Chunk]) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        if not chunks:
            return
        for gi, g in enumerate(self._groups_now()):
            hashes = [h for c in chunks for h in reversed(c.hashes[gi])]
            self._push(BlockRemoved(block_hashes=hashes, medium=MEDIUM_SERVER, group_idx=g.idx))
            self.stats.removed_blocks += len(hashes)

    def _reannounce(self) -> None:
        """Every announced chunk again, parents first (after vLLM's AllBlocksCleared)."""
        done: set[bytes] = set()
        for chain in self._chains.values():
            ks = [k for k in range(chain.depth) if chain.keys[k] not in done]
            done.update(chain.keys[:chain.depth])
            if ks:
                self._announce(chain, ks, counter="reannounced_blocks")

    # Lookups ----------------------------------------------------------------------------------

    def _at(self, heap: list[tuple[float, int, bytes]], chain: _Chain, when: float) -> None:
        """Look ``chain`` up at ``when`` (an earlier entry of it becomes stale)."""
        chain.due = when
        heapq.heappush(heap, (when, next(self._n), chain.keys[-1]))

    def _due(self, heap: list[tuple[float, int, bytes]], now: float) -> _Chain | None:
        """The next chain of ``heap`` due by ``now`` (stale entries dropped), or None."""
        while heap and heap[0][0] <= now:
            when, _, cid = heapq.heappop(heap)
            chain = self._chains.get(cid)
            if chain is not None and chain.future is None and chain.due == when:
                return chain
        return None

    def _submit(self) -> None:
        """Send the lookups that are due: confirmations of saves first, then rechecks of
        announced chains (at most :data:`RECHECKS_PER_S`), at most :data:`MAX_INFLIGHT` out
        at once. Only due chains are touched (a step costs no walk over every chain)."""
        now = time.monotonic()
        self._recheck_budget = min(float(MAX_INFLIGHT),
                                   self._recheck_budget + (now - self._budget_at) * RECHECKS_PER_S)
        self._budget_at = now
        while len(self._inflight) < MAX_INFLIGHT:
            chain = self._due(self._verify_at, now)
            if chain is None:
                if self._recheck_budget < 1.0:
                    return
                # a round covers the chains due when it began (later ones wait for the next)
                chain = self._due(self._recheck_at, now if self._round_from is None else self._round_from)
                if chain is None:
                    self._round_from = None
                    return
                if self._round_from is None:
                    self._round_from = now
                self._recheck_budget -= 1.0
            try:
                chain.future = self._lookup(chain.namespace, chain.keys)
            except RuntimeError:  # the lookup thread is shut down
                chain.future = None
                self._round_from = None
                return
            self._inflight[chain.keys[-1]] = chain
            self.stats.lookups += 1

    def _harvest(self) -> None:
        """Apply the answers that came back."""
        now = time.monotonic()
        for cid, chain in list(self._inflight.items()):
            future = chain.future
            if future is None or not future.done():
                continue
            chain.future = None
            del self._inflight[cid]
            answer = None if future.cancelled() else future.result()
            verifying = cid in self._verifying
            if answer is not None and answer.error is None:
                self._set_depth(chain, answer.chunks)
            # (no answer: the server is away; what was announced stays until it answers)
            if verifying:
                if chain.depth < chain.expected and chain.tries < len(VERIFY_DELAYS_S) - 1:
                    chain.tries += 1
                    self._at(self._verify_at, chain, now + VERIFY_DELAYS_S[chain.tries])
                    continue
                self._verifying.discard(cid)
                chain.tries = len(VERIFY_DELAYS_S)
            if chain.depth == 0:
                self._drop_chain(chain)  # nothing resumable: nothing to watch
            else:
                self._at(self._recheck_at, chain, now + RECHECK_S)
