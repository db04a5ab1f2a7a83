"""The worker side of :class:`~connector.glm_connector.GlmCacheConnector`: it moves bytes.

It loads asynchronously (the request waits in WAITING_FOR_REMOTE_KVS, so vLLM's state
pre-copy cannot race the load), streaming in bounded batches whose fetches overlap the
page writes, and reports each request's load as finished or failed; it copies save pages
out after the forward in batches, sends them from a background thread, and reports every
save that did not land back to the scheduler (``build_connector_worker_meta``).

It also names the weights it computes with (:class:`connector.live_weights.LiveWeights`): at
start-up, after any in-place load, and when the scheduler asks after a reset. A step's plan
made for other weights than these moves nothing (its loads fail, so vLLM recomputes them;
its saves are dropped), and the new weights' name goes back to the scheduler with the
step's output, which moves the namespace.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from cache_server.client import CacheClient, InPlace
from cache_server.client.errors import CLIENT_ERRORS, CacheServerUnavailable, unauthorized
from cache_server.protocol import PutResult
from connector.config import Settings, logger
from connector.geometry import Geometry
from connector.kv_pages import NON_TEMPORAL_PAGES
from connector.live_weights import LiveWeights, expected_token
from connector.metadata import (
    SAVE_DROPPED,
    SAVE_NO_SPACE,
    SAVE_SERVER_ERROR,
    SAVE_TIMEOUT,
    SAVE_TOO_LARGE,
    GlmConnectorMetadata,
    GlmWorkerMeta,
    LoadJob,
    ObjectMove,
    SaveFailure,
)
from connector.transfer_threads import thread_pool, transfer_cpus

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

def batches(sizes: list[int], limit: int, first: int | None = None) -> list[range]:
    """Consecutive index ranges whose sizes sum to at most ``limit`` each (the first to at
    most ``first``, if given; an item larger than its limit is a range of its own); every
    index in exactly one range."""
    out: list[range] = []
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > (limit if out or first is None else first):
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


# Load batches when the server's arena is mapped: each get then moves no bytes (it pins them),
# so its round trip is the batch's overhead; measured (bench_reload, 2.82 GB, pages copied past
# the cache): 16 MiB batches 0.353 s, 64 MiB 0.321 s, 256 MiB 0.288 s against 0.24 s for one
# memmove. The first batch stays at batch_bytes: nothing is copied until it arrives (a 2-core
# Intel Xeon host, torch's copies: 0.309-0.310 s with a 256 MiB first batch, 0.298-0.300 s
# with 16 MiB).
ARENA_BATCH_BYTES = 256 << 20


class WorkerSide:
    """The connector's worker role (one per TP/PP rank)."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 settings: Settings, geometry: Geometry, refused_layout: str | None) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._geometry = geometry
        self._settings = settings
        self._refused_layout = refused_layout
        self._auth_broken = settings.auth_broken
        self._max_pending_save_bytes = settings.max_pending_save_bytes
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        # One object per (chunk, group, rank): the rank is the worker's place in TP x PP.
        # Groups identical on every TP rank are one object per (chunk, group) instead, kept
        # under the TP group's first rank: TP rank 0 saves it, every rank loads it.
        try:
            tp = self._vllm_config.parallel_config.tensor_parallel_size
            self._tp_rank = get_tensor_model_parallel_rank()
            self._rank = get_pp_group().rank_in_group * tp + self._tp_rank
        except (AssertionError, RuntimeError):
            self._rank = self._tp_rank = 0
        self._replicated = {g.group_id for g in self._geometry.groups if g.replicated_across_tp}
        self._state_ids = {g.group_id for g in self._geometry.state_groups}
        self._pages = None
        self._kv_caches: dict[str, Any] | None = None  # what vLLM registered (sleep mode)
        self._load_client = CacheClient(
            settings.url, timeout_s=settings.timeout_s, auth_token=settings.auth_token,
            shm=settings.shm
        )
        self._save_client = CacheClient(
            settings.url, timeout_s=settings.timeout_s, auth_token=settings.auth_token,
            shm=settings.shm
        )
        self._refused_logged = False
        # Transfer threads off the model's OpenMP cores (CPU engines); the clients' ZMQ I/O
        # thread starts from the first request, made on these threads, and follows them.
        self._transfer_cpus = transfer_cpus(settings.transfer_cpus, vllm_config)
        if self._transfer_cpus:
            logger.info("GlmCacheConnector worker rank %d: transfer threads on CPUs %s (the model's: %s)",
                        self._rank, sorted(self._transfer_cpus), sorted(os.sched_getaffinity(0)))
        self._loader = thread_pool("glm-load", self._transfer_cpus)
        self._fetcher = thread_pool("glm-fetch", self._transfer_cpus)
        self._arena_lock_note: str | None = "not tried"  # why the arena is not page-locked for CUDA (None: it is)
        self._hasher = thread_pool("glm-hash", self._transfer_cpus)  # write_verified's concurrent hash
        self._saver = thread_pool("glm-save", self._transfer_cpus)
        self._lock = threading.Lock()
        self._loads_done: set[str] = set()
        self._loads_failed: set[str] = set()
        self._pending_save_bytes = 0
        self._failed_saves: list[SaveFailure] = []
        # The weights this worker computes with (set once the KV caches are registered: the
        # model is loaded by then), the token each load was started under, and the report
        # for the scheduler (connector.live_weights.LiveWeights.check).
        self._live: LiveWeights | None = None
        self._load_tokens: dict[str, str | None] = {}
        self._weights_report: tuple[int, str | None] | None = None
        self.stats: collections.Counter[str] = collections.Counter(
            loaded_objects=0, saved_objects=0, load_failures=0)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from connector.kv_pages import PagedKVCache

        self._kv_caches = kv_caches  # for restore_kv_caches
        self._pages = PagedKVCache(kv_caches, self._kv_cache_config, self._geometry.groups)
        if self._live is None:  # once (restore_kv_caches registers again)
            self._live = LiveWeights.of_engine(self._vllm_config, self._rank, logger)
        logger.info(
            "GlmCacheConnector worker rank %d: bytes per block per group %s; page copies on CPU %s",
            self._rank,
            {g.group_id: g.object_bytes_per_block for g in self._geometry.groups},
            "store past the cache" if NON_TEMPORAL_PAGES else
            "go through the cache (connector._streamcopy is not built: no C compiler at install?)",
        )

    # Sleep mode (vLLM 0.33: gpu_worker.py's sleep and discard call unregister_kv_caches
    # before the KV cache's memory goes, wake_up calls restore_kv_caches once it is back).
    # Meanwhile nothing may touch the buffer. Only the load thread writes pages outside the
    # model's steps, so unregistering drops the pages, then waits until the load thread has
    # finished what it was given (a load that finds no pages fails: its request is
    # recomputed) and the device has run the copies it queued. Saves copy pages on the
    # model's thread (wait_for_save) and skip while there are none. Restoring rebuilds the
    # pages over the same tensors (vLLM maps the memory back at the same addresses; what was
    # in it is gone, as is vLLM's prefix cache, which the sleep resets). Both idempotent.

    def unregister_kv_caches(self) -> None:
        pages, self._pages = self._pages, None
        if pages is None:
            return
        self._loader.submit(lambda: None).result()  # one load thread: everything before has run
        import torch

        cache = next(iter(self._kv_caches.values()), None)
        tensor = cache[0] if isinstance(cache, (list, tuple)) else cache
        if tensor is not None and tensor.device.type != "cpu":
            torch.accelerator.synchronize(tensor.device)
        logger.info("GlmCacheConnector worker rank %d: KV caches unregistered (sleep)", self._rank)

    def restore_kv_caches(self) -> None:
        if self._pages is None and self._kv_caches is not None:
            self.register_kv_caches(self._kv_caches)
        if self._live is not None:  # awake again: a level-2 sleep drops the weights too
            self._live.recheck()

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, GlmConnectorMetadata):
            return
        self._check_weights(meta)  # the step's first connector call: before any load or save
        if not meta.loads:
            return
        other = self._other_weights(meta)
        token = self._token()
        for job in meta.loads:
            if other is not None:  # planned for other weights: reported failed, vLLM recomputes
                job = LoadJob(job.req_id, [], refused=other)
            self._load_tokens[job.req_id] = token
            self._loader.submit(self._run_load, meta.namespace, job)

    # Weights -----------------------------------------------------------------------------

    def _token(self) -> str | None:
        return self._live.token if self._live is not None else None

    def _check_weights(self, meta: GlmConnectorMetadata) -> None:
        """Name the weights again where they may have changed (connector.live_weights.LiveWeights.check)."""
        if self._live is None:
            return
        report = self._live.check(meta.weights_seq, expected_token(meta.weights, self._rank))
        if report is not None:
            self._weights_report = report

    def _other_weights(self, meta: GlmConnectorMetadata) -> str | None:
        """Why this step's plan must not move bytes here (None: it was made for these weights)."""
        expected = expected_token(meta.weights, self._rank)
        if expected == self._token():
            return None
        return f"planned for other weights ({expected}) than this worker's ({self._token()})"

    # Loads ------------------------------------------------------------------------------
    #
    # A load streams in batches of about ``batch_bytes``: batch i+1 is fetched (network,
    # on the fetch thread) while batch i is checked and written into the paged cache (on
    # the load thread). Each batch has its own deadline, scaled by its bytes. State objects
    # go first, so a missing resume state fails the load before any attention is moved.
    #
    # A load that fails part-way fails the whole request (``failed_recving``), and vLLM
    # recomputes it from the start (its local prefix cache may still hit), never resuming
    # on bytes that did not arrive. Why not report only the missing blocks
    # (``get_block_ids_with_load_errors``): (1) in vLLM 0.32 the scheduler raises
    # RuntimeError for block-level load errors when there is more than one KV cache group
    # (block ids are per group), and this model always has several; (2) the KDA state at a
    # resume point k exists only as the one state object we load, at the hit's end: if
    # attention chunks [0, k) arrived but anything later did not, there is no state at k
    # to resume from, so no partial resume is valid. The worker logs exactly which objects
    # did not arrive (and counts them) so the operator sees what failed.

    def _load_order(self, job: LoadJob) -> list[ObjectMove]:
        return sorted(job.objects, key=lambda m: m.group_id not in self._state_ids)

    def _run_load(self, namespace: str, job: LoadJob) -> None:
        cpu = time.thread_time()
        ok = False
        fut: Future | None = None
        moves = self._load_order(job)
        written = 0
        got: InPlace | None = None
        plan: list[range] = []
        try:
            if self._pages is None:
                raise RuntimeError("no KV caches registered (vLLM asleep)")
            if self._auth_broken:
                raise RuntimeError("no usable auth_token_file")
            if self._refused_layout is not None:
                raise RuntimeError(f"external cache disabled: {self._refused_layout}")
            if job.refused is not None:
                raise RuntimeError(job.refused)
            sizes = [self._pages.object_bytes(m.group_id, len(m.block_ids)) for m in moves]
            batch = first = self._settings.batch_bytes
            if self._load_client.reads_in_place:  # a get pins arena bytes, copies none: fewer, larger batches
                batch = max(batch, ARENA_BATCH_BYTES)
            plan = batches(sizes, batch, first)
            if plan:
                fut = self._fetcher.submit(self._fetch, namespace, moves, sizes, plan[0])
            for i, idx in enumerate(plan):
                got = fut.result()
                payloads = got.payloads
                fut = None
                if i + 1 < len(plan):  # the network works on the next batch meanwhile
                    fut = self._fetcher.submit(self._fetch, namespace, moves, sizes, plan[i + 1])
                # Check the whole batch before writing any of it.
                absent = [moves[j] for j, p in zip(idx, payloads) if p is None]
                if absent:
                    raise LookupError(
                        f"{len(absent)} object(s) of batch {i + 1}/{len(plan)} did not arrive, "
                        f"first {absent[0].chunk_hash.hex()[:16]} group {absent[0].group_id}"
                    )
                wrong = [moves[j] for j, payload in zip(idx, payloads) if not self._right_size(moves[j], payload)]
                if wrong:
                    self._delete_wrong_size(namespace, wrong)
                    raise ValueError(f"{len(wrong)} object(s) of batch {i + 1}/{len(plan)} are not their group's "
                                     f"size, first group {wrong[0].group_id}")
                bad = self._write_batch([moves[j] for j in idx], payloads, got.unverified)
                if bad is not None:
                    self._delete_corrupt(namespace, bad)
                    raise ValueError(f"an object of batch {i + 1}/{len(plan)} failed its checksum "
                                     f"(group {bad.group_id}); deleted on the server")
                if time.monotonic() > got.deadline:  # the server may have reused what we read
                    raise TimeoutError(f"batch {i + 1}/{len(plan)} was copied out of the server's arena after "
                                       "its read pin ended")
                self._load_client.release_pin(got.pin)
                got = None
                written += len(idx)
                self.stats["loaded_bytes"] += sum(sizes[j] for j in idx)
            ok = True
            self.stats["loaded_objects"] += len(moves)
        except Exception as e:  # any failure is a recompute, never a crash
            logger.warning(
                "GlmCacheConnector: load for %s failed after %d of %d objects (%s); recomputing",
                job.req_id, written, len(moves), e,
            )
            self.stats["load_failures"] += 1
            self.stats["load_objects_not_arrived"] += len(moves) - written
        finally:
            if fut is not None and not fut.cancel():  # a fetch still in flight: it only reads the network
                fut.add_done_callback(self._release_fetched)
            if got is not None:
                self._load_client.release_pin(got.pin)
            if plan:
                self._load_client.unpin()  # the pins this load held, now rather than at the next load
        with self._lock:
            self._loads_done.add(job.req_id)
            if not ok:
                self._loads_failed.add(job.req_id)
            self.stats["load_cpu_seconds"] += time.thread_time() - cpu

    def _fetch(self, namespace: str, moves: list[ObjectMove], sizes: list[int],
               idx: range) -> InPlace:
        """One batch's objects: those in the server's arena as views of it, under a read pin,
        verified by the server when it placed them or, where it did not, as they are
        written (PagedKVCache.write_verified); the rest verified by the client."""
        cpu = time.thread_time()
        try:
            got = self._get_in_place(namespace, moves, sizes, idx)
        finally:
            with self._lock:
                self.stats["load_cpu_seconds"] += time.thread_time() - cpu
        return got

    def _get_in_place(self, namespace: str, moves: list[ObjectMove], sizes: list[int], idx: range) -> InPlace:
        keys = [(moves[j].chunk_hash, moves[j].group_id, self._key_rank(moves[j].group_id))
                for j in idx]
        nbytes = sum(sizes[j] for j in idx)
        got = self._load_client.get_in_place(namespace, keys, timeout_s=self._settings.deadline_s(nbytes))
        if got.pin is not None and self._pages is not None and self._pages.device.type == "cuda":
            # page copies out of the arena then start as DMAs from its pages (a no-op once the
            # mapping is registered; a server restart brings a new mapping)
            why = self._load_client.register_arena_cuda()
            if why != self._arena_lock_note:
                self._arena_lock_note = why
                logger.info("GlmCacheConnector: the server's arena is %s", "page-locked for CUDA" if why is None
                            else f"not page-locked ({why}): host-to-device copies go through a staging buffer")
        return got

    def _write_batch(self, moves: list[ObjectMove], payloads: list[Any], checks: list[Any]) -> ObjectMove | None:
        """Write one batch's objects into the pages, verifying those read in place as they
        are copied; the first one that failed its checksum (None: none did). One thread:
        two writers measured no faster on 2 loaded cores (5.2-5.7 GB/s against 5.4-7.5,
        30k-token bench_reload) and take a core from the engine."""
        assert self._pages is not None
        hasher = self._hasher if NON_TEMPORAL_PAGES else None
        # verified already (by the client on arrival, or by the server in its arena): one
        # table of copies for them all (PagedKVCache.write_many)
        self._pages.write_many([(m.group_id, m.block_ids, p) for m, p, c in zip(moves, payloads, checks) if c is None])
        for move, payload, check in zip(moves, payloads, checks):
            if check is not None and not self._pages.write_verified(move.group_id, move.block_ids, payload, *check,
                                                                     hasher=hasher):
                return move
        return None

    def _release_fetched(self, fut: Future) -> None:
        """Hand back the read pin of a fetch whose load ended without it."""
        if not fut.cancelled() and fut.exception() is None:
            self._load_client.release_pin(fut.result().pin)

    def _delete_corrupt(self, namespace: str, move: ObjectMove) -> None:
        self.stats["load_corrupt_objects"] += 1
        self._load_client.delete_corrupt(namespace, [(move.chunk_hash, move.group_id, self._key_rank(move.group_id))])

    def _key_rank(self, group_id: int) -> int:
        """The rank an object of ``group_id`` is stored under (see ``__init__``)."""
        return self._rank - self._tp_rank if group_id in self._replicated else self._rank

    def _right_size(self, move: ObjectMove, payload: Any) -> bool:
        assert self._pages is not None
        return len(payload) == self._pages.object_bytes(move.group_id, len(move.block_ids))

    def _delete_wrong_size(self, namespace: str, moves: list[ObjectMove]) -> None:
        """Objects that can never load here are removed, so the next request recomputes
        and saves them again instead of hitting them and failing its load every time."""
        self.stats["load_wrong_size_objects"] += len(moves)
        keys = [(m.chunk_hash, m.group_id, self._key_rank(m.group_id)) for m in moves]
        try:
            self._load_client.delete(namespace, keys, reason="size")
        except CLIENT_ERRORS as e:  # they stay until evicted; this load fails either way
            logger.warning("GlmCacheConnector: could not delete %d wrong-size object(s): %s", len(keys), e)

    # Saves ------------------------------------------------------------------------------
    #
    # Pages are copied out after this step's forward (the blocks may be reused later) in
    # batches of about ``batch_bytes``; each batch is handed to the send thread as soon as
    # it is copied, so the network sends batch i while batch i+1 is copied. Saves beyond
    # ``max_pending_save_bytes`` are not copied at all and are reported as dropped, like
    # every save that does not land (timeout, no_space, too_large, error reply): the
    # scheduler learns of them through ``build_connector_worker_meta`` and saves the
    # holes again while the request still holds its blocks.

    def wait_for_save(self, meta: Any) -> None:
        if not isinstance(meta, GlmConnectorMetadata) or not meta.saves or self._pages is None:
            return
        if self._auth_broken or self._refused_layout is not None:
            return
        if self._other_weights(meta) is not None:
            return  # computed by other weights than the plan's namespace names: never sent
        moves: list[ObjectMove] = []
        for move in meta.saves:
            if any(b is None for b in move.block_ids):
                continue
            if move.group_id in self._replicated and self._tp_rank != 0:
                continue  # the TP group's first rank stores the one copy
            moves.append(move)
        if not moves:
            return
        sizes = [self._pages.object_bytes(m.group_id, len(m.block_ids)) for m in moves]
        with self._lock:
            room = self._max_pending_save_bytes - self._pending_save_bytes
            admitted, total = 0, 0
            for n in sizes:
                # Always admit one object when nothing is pending, so that a budget
                # below one object's size still makes progress.
                if total + n > room and not (admitted == 0 and self._pending_save_bytes == 0):
                    break
                admitted += 1
                total += n
            self._pending_save_bytes += total
            dropped = moves[admitted:]
            if dropped:
                self._record_failures(dropped, SAVE_DROPPED)
        if dropped:
            logger.warning(
                "GlmCacheConnector: %d save objects dropped (%d bytes pending, limit %d); "
                "the scheduler saves them again later", len(dropped), self._pending_save_bytes,
                self._max_pending_save_bytes,
            )
        sizes = sizes[:admitted]
        for idx in batches(sizes, self._settings.batch_bytes):
            batch = [moves[j] for j in idx]
            items = [(m.chunk_hash, m.group_id, self._key_rank(m.group_id),
                      self._pages.read(m.group_id, list(m.block_ids))) for m in batch]
            nbytes = sum(sizes[j] for j in idx)
            self._saver.submit(self._run_save, meta.namespace, batch, items, nbytes)

    def _record_failures(self, moves: list[ObjectMove], reason: str) -> None:
        """Caller holds ``_lock``."""
        self.stats["save_failures"] += len(moves)
        self._failed_saves.extend(SaveFailure(m.req_id, m.chunk_hash, m.group_id, reason)
                                  for m in moves)

    def _run_save(self, namespace: str, moves: list[ObjectMove], items: list,
                  nbytes: int) -> None:
        failed: list[tuple[ObjectMove, str]] = []
        try:
            results = self._save_client.put(
                namespace, items, prev=[m.prev for m in moves], parent=[m.parent for m in moves],
                timeout_s=self._settings.deadline_s(nbytes),
            )
            self.stats["saved_objects"] += sum(r == PutResult.STORED for r in results)
            self.stats["saved_bytes"] += sum(len(it[3]) for it, r in zip(items, results)
                                             if r == PutResult.STORED)
            failed = [(m, r) for m, r in zip(moves, results) if r not in (PutResult.STORED, PutResult.EXISTS)]
            if failed:
                logger.debug("GlmCacheConnector: put results %s", [r for _, r in failed])
        except CLIENT_ERRORS as e:
            reason = SAVE_TIMEOUT if isinstance(e, CacheServerUnavailable) else SAVE_SERVER_ERROR
            failed = [(m, reason) for m in moves]
            if unauthorized(e):
                if not self._refused_logged:
                    logger.error(
                        "GlmCacheConnector: glm-cache-server refused our token (%s); saves are "
                        "dropped until auth_token_file matches its --auth-token-file", e,
                    )
                self._refused_logged = True
            else:
                logger.warning("GlmCacheConnector: save of %d objects failed: %s", len(items), e)
        finally:
            with self._lock:
                self._pending_save_bytes -= nbytes
                for m, reason in failed:
                    known = reason in (SAVE_NO_SPACE, SAVE_TOO_LARGE, SAVE_TIMEOUT, SAVE_SERVER_ERROR)
                    self._record_failures([m], reason if known else SAVE_SERVER_ERROR)

    def build_connector_worker_meta(self) -> GlmWorkerMeta | None:
        """Saves that did not land since the last call, and this rank's weights when they
        changed or the scheduler asked (None: nothing to say)."""
        with self._lock:
            failed, self._failed_saves = self._failed_saves, []
        report, self._weights_report = self._weights_report, None
        if not failed and report is None:
            return None
        return GlmWorkerMeta(failed, {} if report is None else {self._rank: report})

    def wait_for_pending_saves(self, timeout_s: float = 30.0) -> bool:
        """Block until every queued save was sent (benchmarks, tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending_save_bytes == 0:
                    return True
            time.sleep(0.005)
        return False

    def get_transfer_results(self) -> KVConnectorTransferResults:
        with self._lock:
            done, failed = self._loads_done, self._loads_failed
            self._loads_done, self._loads_failed = set(), set()
        token = self._token()
        for req_id in done:
            # Loaded while the weights changed (a load spans steps): the bytes came from
            # the old weights' namespace, so vLLM recomputes the request instead.
            if self._load_tokens.pop(req_id, token) != token and req_id not in failed:
                logger.warning("GlmCacheConnector: load for %s finished after the weights changed; recomputing",
                               req_id)
                failed.add(req_id)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._hasher.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=True, cancel_futures=False)
        self._load_client.close()
        self._save_client.close()
