"""The worker side's data path against a real glm-cache-server, no engine: loads stream in
bounded batches with deadlines scaled by their bytes, a load that loses an object
part-way fails its whole request (vLLM recomputes it), and saves that do not land are
reported back per request and chunk with the reason."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from cache_server.client import CacheClient
from connector.config import Settings
from connector.geometry import CacheGroup, Geometry, LayerPage
from connector.metadata import (
    SAVE_DROPPED,
    SAVE_NO_SPACE,
    GlmConnectorMetadata,
    GlmWorkerMeta,
    LoadJob,
    ObjectMove,
    SaveFailure,
)
from connector.saves import MAX_SAVE_RETRIES, SavePlanner
from connector.worker import WorkerSide, batches
from testing.server_process import ServerProcess
from testing.worker_loads import wait_load

vkv = pytest.importorskip("vllm.v1.kv_cache_interface")

NB = 32  # blocks
STRIDE = 8192
PAGE_A = 4096  # attention page per layer per block
PAGE_S = 8192  # state page (one layer)
STATE, ATTN = 0, 1
BLOCK = 16
C = 2 * BLOCK  # a chunk is two attention blocks
NS = "worker-stream"


def _engine_cache():
    """One shared buffer: two attention layers and one state layer, as vLLM places them."""
    size = 3 * NB * STRIDE
    ta = vkv.KVCacheTensor(size=size, layers=["a.0", "a.1"], layer_stride=NB * STRIDE, block_stride=STRIDE,
                           offset=0)
    ts = vkv.KVCacheTensor(size=size, layers=["s.0"], layer_stride=NB * STRIDE, block_stride=STRIDE,
                           offset=2 * NB * STRIDE)
    config = vkv.KVCacheConfig(num_blocks=NB, kv_cache_tensors=[ta, ts], kv_cache_groups=[])
    buf = torch.zeros(size, dtype=torch.int8)
    views = {"a.0": torch.as_strided(buf, (NB, PAGE_A), (STRIDE, 1), 0),
             "a.1": torch.as_strided(buf, (NB, PAGE_A), (STRIDE, 1), NB * STRIDE),
             "s.0": torch.as_strided(buf, (NB, PAGE_S), (STRIDE, 1), 2 * NB * STRIDE)}
    groups = (
        CacheGroup(STATE, True, BLOCK, (LayerPage("s.0", PAGE_S, "float32", BLOCK, 1, "MambaSpec"),)),
        CacheGroup(ATTN, False, BLOCK, tuple(LayerPage(n, PAGE_A, "int8", BLOCK, BLOCK, "FullAttentionSpec")
                                              for n in ("a.0", "a.1"))),
    )
    geo = Geometry(groups, (BLOCK, BLOCK), BLOCK, C)
    return config, views, buf, geo


# The worker's timeout_s (its clients' per-request floor) unless a test sets one: generous,
# as none of these tests is about a deadline passing (a loaded machine must not fail a load)
TIMEOUT_S = 30.0


def _worker(url: str, **settings) -> tuple[WorkerSide, torch.Tensor]:
    config, views, buf, geo = _engine_cache()
    vcfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    w = WorkerSide(vcfg, config, Settings(url=url, **{"timeout_s": TIMEOUT_S, **settings}), geo, None)
    w.register_kv_caches(views)
    return w, buf


def _hash(k: int) -> bytes:
    return k.to_bytes(4, "big") * 8


def _attn_object(k: int) -> bytes:
    g = torch.Generator().manual_seed(k)
    return torch.randint(0, 256, (2 * 2 * PAGE_A,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _state_object() -> bytes:
    return bytes(range(256)) * (PAGE_S // 256)


def _populate(url: str, chunks: int) -> None:
    with CacheClient(url, timeout_s=60) as cli:
        cli.hello(NS, BLOCK, attn_groups=[ATTN], state_groups=[STATE])
        items = [(_hash(k), ATTN, 0, _attn_object(k)) for k in range(chunks)]
        ok = {"stored", "exists"}
        assert set(cli.put(NS, items, parent=[_hash(k - 1) if k else None for k in range(chunks)])) <= ok
        assert set(cli.put(NS, [(_hash(chunks - 1), STATE, 0, _state_object())], parent=[_hash(chunks - 2)])) <= ok


def _load_job(chunks: int) -> LoadJob:
    moves = [ObjectMove(_hash(k), ATTN, [2 * k, 2 * k + 1]) for k in range(chunks)]
    moves.append(ObjectMove(_hash(chunks - 1), STATE, [NB - 1]))
    return LoadJob("req-1", moves)


SERVER_ARGS = ("--chunk-size", str(C), "--l1-size-gb", "0.05")  # the server fixture's (conftest.py)


def test_batches_cover_every_item_once_and_respect_the_limit():
    sizes = [5, 5, 5, 20, 1, 1, 9]
    plan = batches(sizes, 10)
    assert [list(r) for r in plan] == [[0, 1], [2], [3], [4, 5], [6]]
    assert batches([], 10) == []
    # a smaller first batch (the copy starts while the larger ones are fetched), then the limit
    assert [list(r) for r in batches(sizes, 30, first=10)] == [[0, 1], [2, 3, 4, 5], [6]]
    assert [list(r) for r in batches([20, 1], 30, first=10)] == [[0], [1]]


def test_deadline_is_a_floor_plus_the_bytes_at_the_slowest_rate():
    s = Settings(timeout_s=2.0, min_rate_mb_s=100.0)
    assert s.deadline_s(0) == 2.0
    assert s.deadline_s(1_000_000_000) == pytest.approx(12.0)  # 1 GB at 100 MB/s, plus the floor


def test_load_streams_in_batches_with_scaled_deadlines_and_lands_every_page(server):
    chunks = 6
    _populate(server.url, chunks)
    obj = 2 * 2 * PAGE_A
    process_cpu = time.process_time()  # this process's CPU time (every thread's) from before the worker is made
    w, _ = _worker(server.url, batch_bytes=2 * obj, min_rate_mb_s=10.0)
    calls: list[tuple[int, float]] = []
    real_get = w._load_client.get_in_place  # the worker's gets (arena objects read in place)

    def counting_get(ns, keys, timeout_s=None):
        calls.append((len(keys), timeout_s))
        return real_get(ns, keys, timeout_s=timeout_s)

    w._load_client.get_in_place = counting_get
    try:
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[_load_job(chunks)]))
        assert wait_load(w, "req-1")
    finally:
        w.shutdown()
    # the load's and its fetches' thread CPU time is counted: some, and no more than this
    # process spent over the same span (those threads' CPU is part of it; a loaded machine
    # stretches the wall time, never this order)
    assert 0 < w.stats["load_cpu_seconds"] <= time.process_time() - process_cpu
    # The state goes first (a missing resume state fails before attention moves), then
    # attention, at most two objects' bytes per batch: 4 gets, not one get of everything,
    # each with a deadline of the floor plus its bytes at min_rate_mb_s.
    assert [n for n, _ in calls] == [2, 2, 2, 1]
    assert calls[0][1] == pytest.approx(TIMEOUT_S + (PAGE_S + obj) / 10e6)
    assert calls[1][1] == pytest.approx(TIMEOUT_S + 2 * obj / 10e6)
    pages = w._pages
    for k in range(chunks):
        assert pages.read(ATTN, [2 * k, 2 * k + 1]) == _attn_object(k)
    assert pages.read(STATE, [NB - 1]) == _state_object()
    assert w.stats["loaded_objects"] == chunks + 1


def test_a_load_that_loses_an_object_part_way_fails_the_whole_request(server):
    chunks = 6
    _populate(server.url, chunks)
    with CacheClient(server.url, timeout_s=60) as cli:
        assert cli.delete(NS, [(_hash(4), ATTN, 0)]) == 1
    w, _ = _worker(server.url, batch_bytes=2 * 2 * PAGE_A)
    try:
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[_load_job(chunks)]))
        assert wait_load(w, "req-1") is False  # failed_recving: vLLM recomputes the request
    finally:
        w.shutdown()
    assert w.stats["load_failures"] == 1
    # State, then chunks 0-3 arrived (three batches); chunk 4's batch did not, nor did 5.
    assert w.stats["load_objects_not_arrived"] == 2
    from connector.glm_connector import GlmCacheConnector

    # Never block ids: vLLM 0.32 refuses them with several KV cache groups.
    assert GlmCacheConnector.get_block_ids_with_load_errors(None) == set()


def _filled_server():
    """A server whose whole budget is pinned by a leased object of another namespace:
    every put of ours is answered no_space until the lease is released (through the
    returned client: a lease is its connection's)."""
    srv = ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "0.0001",
                        "--max-leased-fraction", "1").start()
    cap = int(0.0001 * (1 << 30))
    cli = CacheClient(srv.url, timeout_s=60)
    cli.hello("filler", BLOCK, attn_groups=[ATTN], state_groups=[STATE])
    big = cap - 4096
    assert cli.put("filler", [(_hash(99), ATTN, 0, bytes(big // 2)),
                              (_hash(99), STATE, 0, bytes(big - big // 2))], parent=[None, None]) \
        == ["stored", "stored"]
    n, lease = cli.lookup("filler", [_hash(99)], [ATTN], [STATE])
    assert n == 1 and lease is not None
    return srv, cli, lease


def test_saves_that_do_not_land_are_reported_per_request_and_chunk():
    srv, cli, lease = _filled_server()
    try:
        w, buf = _worker(srv.url)
        buf.copy_(torch.randint(-100, 100, buf.shape, dtype=torch.int8))
        saves = [ObjectMove(_hash(k), ATTN, [2 * k, 2 * k + 1], parent=None, req_id="r-a") for k in range(2)]
        saves.append(ObjectMove(_hash(1), STATE, [NB - 1], req_id="r-a"))
        w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=saves))
        assert w.wait_for_pending_saves()
        meta = w.build_connector_worker_meta()
        assert isinstance(meta, GlmWorkerMeta)
        assert sorted((f.req_id, f.chunk_hash, f.group_id, f.reason) for f in meta.failed_saves) == sorted(
            [("r-a", _hash(0), ATTN, SAVE_NO_SPACE), ("r-a", _hash(1), ATTN, SAVE_NO_SPACE),
             ("r-a", _hash(1), STATE, SAVE_NO_SPACE)])
        assert w.build_connector_worker_meta() is None  # reported once
        # Space again: the same saves land, and nothing is reported.
        assert cli.release(lease)
        w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=saves))
        assert w.wait_for_pending_saves()
        assert w.build_connector_worker_meta() is None
        assert w.stats["saved_objects"] == 3
        w.shutdown()
    finally:
        cli.close()
        srv.stop()


def test_saves_over_the_pending_budget_are_not_copied_and_are_reported_dropped(server):
    obj = 2 * 2 * PAGE_A
    w, buf = _worker(server.url, max_pending_save_bytes=obj + 1)
    buf.copy_(torch.randint(-100, 100, buf.shape, dtype=torch.int8))
    saves = [ObjectMove(_hash(100 + k), ATTN, [2 * k, 2 * k + 1], parent=None, req_id="r-b") for k in range(3)]
    w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=saves))
    assert w.wait_for_pending_saves()
    w.shutdown()
    meta = w.build_connector_worker_meta()
    assert meta is not None
    assert [(f.chunk_hash, f.reason) for f in meta.failed_saves] == [(_hash(101), SAVE_DROPPED),
                                                                      (_hash(102), SAVE_DROPPED)]
    with CacheClient(server.url, timeout_s=60) as cli:
        got = cli.get(NS, [(_hash(100 + k), ATTN, 0) for k in range(3)])
    assert got[0] is not None and got[1] is None and got[2] is None


def test_worker_metadata_of_every_rank_is_kept_when_aggregated():
    a = GlmWorkerMeta([SaveFailure("r", b"x", 1, "timeout")])
    b = GlmWorkerMeta([SaveFailure("r", b"y", 1, "no_space")])
    assert [f.chunk_hash for f in a.aggregate(b).failed_saves] == [b"x", b"y"]


def _scheduler_with(tracked_chunks: int):
    """A save planner and one tracked request of ``tracked_chunks`` saved chunks (only the
    save-outcome bookkeeping is exercised: no engine, no server)."""
    from cache_server.chunk_keys import chunk_hashes
    from connector.keys import ChunkKeys
    from connector.namespace import KeyScheme
    from connector.requests import RequestState

    _, _, _, geo = _engine_cache()
    tokens = list(range(16, 16 + tracked_chunks * C + 5))
    req = SimpleNamespace(request_id="r", num_tokens=len(tokens), num_prompt_tokens=len(tokens),
                          all_token_ids=tokens, cache_salt=None)
    t = RequestState(req, keys=chunk_hashes(tokens, C), scheduled=True,
                     saved_chunks=tracked_chunks)
    planner = SavePlanner(ChunkKeys(KeyScheme(), None), save_decode=False)
    return planner, t, lambda failures: planner.failed(failures, {"r": t}.get, geo)


def test_scheduler_moves_the_saved_depth_back_to_the_first_hole_and_backs_off():
    planner, t, fail = _scheduler_with(5)
    fail([SaveFailure("r", t.keys[3], ATTN, SAVE_NO_SPACE),
          SaveFailure("r", t.keys[1], ATTN, "timeout"),
          SaveFailure("r", t.keys[4], STATE, SAVE_NO_SPACE)])
    assert t.saved_chunks == 1 and t.save_retries == 1 and not t.saves_given_up
    assert t.resave_at > time.monotonic()
    assert planner.attention_saves(t, 5 * C, _engine_cache()[3], None) == []  # backing off: nothing is re-sent yet
    # A failure of a save sent before that correction is the same incident: no new retry.
    fail([SaveFailure("r", t.keys[0], ATTN, SAVE_DROPPED)])
    assert t.saved_chunks == 0 and t.save_retries == 1
    # Failures of an unknown (finished) request, or of states only, change nothing.
    fail([SaveFailure("gone", t.keys[0], ATTN, "timeout"),
          SaveFailure("r", t.keys[2], STATE, "timeout")])
    assert t.saved_chunks == 0 and planner.stats["lost"] == 2


def test_scheduler_gives_up_after_bounded_retries_or_a_permanent_failure():
    planner, t, fail = _scheduler_with(4)
    for i in range(MAX_SAVE_RETRIES):
        t.resave_at = 0.0  # the back-off has passed
        fail([SaveFailure("r", t.keys[2], ATTN, SAVE_NO_SPACE)])
        assert not t.saves_given_up and t.save_retries == i + 1
    t.resave_at = 0.0
    fail([SaveFailure("r", t.keys[2], ATTN, SAVE_NO_SPACE)])
    assert t.saves_given_up and t.saved_chunks == 2
    assert planner.attention_saves(t, 4 * C, _engine_cache()[3], None) == []  # given up: never sent again

    planner, t, fail = _scheduler_with(4)
    fail([SaveFailure("r", t.keys[3], ATTN, "too_large")])
    assert t.saves_given_up and t.save_retries == 0


# Same-host shared memory on the load path: the server copies each object into the load
# client's segment, the client verifies its checksum there in place, and the page writes
# copy from a view of the segment straight into the KV cache (no other copy).


def test_saved_pages_come_back_byte_exact_through_shared_memory(server):
    w, buf = _worker(server.url)
    try:
        buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(7)))
        saved = buf.clone()
        saves = [ObjectMove(_hash(300 + k), ATTN, [2 * k, 2 * k + 1], parent=_hash(299 + k) if k else None,
                            req_id="r-s") for k in range(3)]
        saves.append(ObjectMove(_hash(302), STATE, [NB - 1], req_id="r-s"))
        w.wait_for_save(GlmConnectorMetadata(namespace=NS, saves=saves))
        assert w.wait_for_pending_saves() and w.build_connector_worker_meta() is None
        assert w._save_client.transport == "shm"
        buf.zero_()
        with CacheClient(server.url, timeout_s=60) as cli:
            shm_before = cli.stats()["shm"]["get_bytes"]
        # Load them into other blocks: pages land by block id, not where they were read from.
        loads = [ObjectMove(_hash(300 + k), ATTN, [10 + 2 * k, 11 + 2 * k]) for k in range(3)]
        loads.append(ObjectMove(_hash(302), STATE, [NB - 2]))
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[LoadJob("req-shm", loads)]))
        assert wait_load(w, "req-shm")
        assert w._load_client.transport == "shm"
        with CacheClient(server.url, timeout_s=60) as cli:  # every byte came through the segment, none as frames
            assert cli.stats()["shm"]["get_bytes"] - shm_before == 3 * 2 * 2 * PAGE_A + PAGE_S
    finally:
        w.shutdown()
    expect = torch.zeros_like(saved)
    for k in range(3):
        for layer in range(2):
            for src, dst in ((2 * k, 10 + 2 * k), (2 * k + 1, 11 + 2 * k)):
                at, frm = layer * NB * STRIDE + dst * STRIDE, layer * NB * STRIDE + src * STRIDE
                expect[at:at + PAGE_A] = saved[frm:frm + PAGE_A]
    at, frm = 2 * NB * STRIDE + (NB - 2) * STRIDE, 2 * NB * STRIDE + (NB - 1) * STRIDE
    expect[at:at + PAGE_S] = saved[frm:frm + PAGE_S]
    assert torch.equal(buf, expect)  # the loaded pages are the saved bytes; nothing else was touched


def test_a_byte_flipped_in_the_shared_memory_region_fails_the_load_and_reaches_no_page(server):
    chunks = 3
    _populate(server.url, chunks)
    w, buf = _worker(server.url, batch_bytes=1)  # one object per get
    client = w._load_client
    real_place = client._place_shm_locked
    flipped: list[int] = []

    def flip_after_the_servers_copy(seg, reply, frames):
        # The server has copied the objects into the segment; flip one byte of the second
        # attention object there, before the client verifies it.
        out = real_place(seg, reply, frames)
        if sum(1 for x in reply["shm"] if x is not None) == 1 and reply["shm"][0][1] == 2 * 2 * PAGE_A:
            flipped.append(reply["shm"][0][0])
            if len(flipped) == 2:
                seg.view[reply["shm"][0][0] + 1234] ^= 0x01
        return out

    client._place_shm_locked = flip_after_the_servers_copy
    try:
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[_load_job(chunks)]))
        assert wait_load(w, "req-1") is False  # failed_recving: vLLM recomputes the request
        assert client.transport == "shm" and len(flipped) >= 2
        assert client.corrupt_objects == 1
    finally:
        w.shutdown()
    # The state and chunk 0 were verified and written; no byte of chunk 1 (flipped) nor of
    # chunk 2 (after the failure) reached the cache.
    pages = w._pages
    assert pages.read(STATE, [NB - 1]) == _state_object()
    assert pages.read(ATTN, [0, 1]) == _attn_object(0)
    assert not buf.view(torch.uint8)[STRIDE * 2: STRIDE * 6].any()
    assert not buf.view(torch.uint8)[NB * STRIDE + STRIDE * 2: NB * STRIDE + STRIDE * 6].any()
    # The corrupt object was deleted on the server as corrupt; the others are intact there.
    with CacheClient(server.url, timeout_s=60) as cli:
        got = cli.get(NS, [(_hash(k), ATTN, 0) for k in range(chunks)])
        assert got[1] is None and bytes(got[0]) == _attn_object(0) and bytes(got[2]) == _attn_object(2)


def test_a_refused_load_writes_nothing_and_fails_the_request(server):
    """A hit the scheduler side cannot load as planned is sent as a refused job: the worker
    moves no byte and reports the load failed, so vLLM recomputes the request."""
    chunks = 3
    _populate(server.url, chunks)
    w, buf = _worker(server.url)
    try:
        before = buf.clone()
        job = _load_job(chunks)
        job.refused = "no state block allocated at position 768"
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[job]))
        assert wait_load(w, "req-1") is False
        assert torch.equal(buf, before)
    finally:
        w.shutdown()
    assert w.stats["load_failures"] == 1 and w.stats.get("loaded_objects", 0) == 0


def test_an_object_of_the_wrong_size_fails_the_load_and_is_deleted(server):
    """An object whose checksum matches its key but whose size is not its group's can
    never load here: the load fails before any page is written, and the object is deleted
    on the server (counted), so the next request recomputes and saves it again instead of
    hitting it and failing every time."""
    keys = [_hash(500), _hash(501)]
    with CacheClient(server.url, timeout_s=60) as cli:
        cli.hello(NS, BLOCK, attn_groups=[ATTN], state_groups=[STATE])
        assert cli.put(NS, [(keys[0], ATTN, 0, _attn_object(0)), (keys[1], ATTN, 0, _attn_object(1)[:-64])],
                       parent=[None, keys[0]]) == ["stored", "stored"]
        assert cli.put(NS, [(keys[1], STATE, 0, _state_object())], parent=[keys[0]]) == ["stored"]
    moves = [ObjectMove(keys[k], ATTN, [2 * k, 2 * k + 1]) for k in range(2)] + [ObjectMove(keys[1], STATE, [NB - 1])]
    w, buf = _worker(server.url)
    try:
        before = buf.clone()
        w.start_load_kv(GlmConnectorMetadata(namespace=NS, loads=[LoadJob("req-w", moves)]))
        assert wait_load(w, "req-w") is False
        assert torch.equal(buf, before)
    finally:
        w.shutdown()
    assert w.stats["load_wrong_size_objects"] == 1 and w.stats["load_failures"] == 1
    with CacheClient(server.url, timeout_s=60) as cli:
        wrong, right = cli.get(NS, [(keys[1], ATTN, 0), (keys[0], ATTN, 0)])
    assert wrong is None and right is not None
