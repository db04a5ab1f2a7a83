"""The connector's KV events (connector.events) against a real glm-cache-server, with real
vLLM requests (vLLM's sha256 block hasher): what is announced is what the server reports
resumable, never deeper; removals when a chain gets shallower, a chunk shared by two
chains staying while one reaches it; re-announcement after vLLM's clear; bounded memory
when nobody takes the events; nothing at all when events are off. Seconds, no engine
(tests/engine/test_replicas_e2e.py runs the engines and real consumers)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from connector import events as ev
from connector.geometry import CacheGroup, Geometry, LayerPage
from connector.remote import LookupAnswer

C = 16  # chunk = block
STATE, ATTN = 0, 1  # object groups = vLLM's KV cache groups
NS = "kv-events"


SERVER_ARGS = ("--chunk-size", str(C), "--l1-size-gb", "0.1")  # the server fixture's (conftest.py)


@pytest.fixture
def client(server):
    c = CacheClient(server.url)
    c.hello(NS, C, attn_groups=[ATTN], state_groups=[STATE])
    c.clear(NS)
    yield c
    c.close()


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(ev, "VERIFY_DELAYS_S", (0.0, 0.05, 0.1))
    monkeypatch.setattr(ev, "RECHECK_S", 0.05)


def _kv_cache_config():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=C, num_kv_heads=1, head_size=8, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["s.0"], spec), KVCacheGroupSpec(["a.0"], spec)])
    cfg.hash_block_size = C
    return cfg


GEO = Geometry((CacheGroup(STATE, True, C, (LayerPage("s.0", 8, "float32", C, 1, "MambaSpec"),)),
                CacheGroup(ATTN, False, C, (LayerPage("a.0", 8, "float32", C, C, "FullAttentionSpec"),))),
               (C, C), C, C)


# An idle engine's extra steps end within seconds; the bound on the loops that take them is
# generous, as a CPU of this VM can stand still for minutes (CI at 51cba8a: both CPUs for 60 s,
# one for 107 s, while the chains' rechecks were under way: the loop ran out at 60 s).
IDLE_STEPS_BOUND_S = 600.0


def _events(client: CacheClient, enabled: bool = True) -> ev.ServerEvents:
    pool = ThreadPoolExecutor(1)

    def lookup(ns: str, keys: list[bytes]):
        def io() -> LookupAnswer:
            n, lease, held, start_state = client.lookup_held(ns, keys, [ATTN], [STATE], 1, 0, lease=False)
            return LookupAnswer(n, lease, held, start_state)
        return pool.submit(io)

    cfg = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=enabled))
    return ev.ServerEvents(cfg, _kv_cache_config(), GEO, lookup)


def _request(tokens: list[int], rid: str = "r", salt: str | None = None):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(C, sha256))


def _store(client: CacheClient, keys: list[bytes], attention: int, states: list[int]) -> None:
    """Attention objects of chunks 0..attention-1, KDA states at the chunks ``states``."""
    items = [(keys[k], ATTN, 0, b"a" * 8) for k in range(attention)] + [(keys[k], STATE, 0, b"s" * 8) for k in states]
    parents = [keys[k - 1] if k else None for k in range(attention)] + [keys[k - 1] if k else None for k in states]
    assert set(client.put(NS, items, parent=parents)) <= {"stored", "exists"}


def _drain(events: ev.ServerEvents, until, timeout_s: float = 5.0) -> list:
    """take() as vLLM's steps do until ``until(all events so far)``."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += events.take()
        if until(got):
            return got
        time.sleep(0.01)
    pytest.fail(f"events not as expected: {got}")


def _int(h: bytes) -> int:
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def test_announced_as_deep_as_the_server_resumes_and_no_deeper(client):
    tokens = list(range(100, 100 + 4 * C + 3))
    req = _request(tokens, salt="tenant-a")
    keys = chunk_hashes(tokens, C, "tenant-a")
    _store(client, keys, attention=4, states=[1])  # resumable 2 chunks deep
    events = _events(client)
    events.saved(req, keys[:4], 4, NS)
    got = _drain(events, lambda g: len(g) >= 1)
    (first,) = got
    assert type(first).__name__ == "BlockStored" and first.medium == "CPU"
    assert first.block_hashes == [_int(h) for h in req.block_hashes[:2]]  # vLLM's own, salt included
    assert first.parent_block_hash is None and first.token_ids == tokens[:2 * C]
    assert (first.block_size, first.group_idx, first.kv_cache_spec_kind) == (C, ATTN, "full_attention")
    assert first.extra_keys == [("tenant-a",), None]  # as vLLM's pool events carry the salt
    assert events.pending()  # a confirmation is still due (the saves should reach 4)
    _store(client, keys, attention=4, states=[3])  # the last save lands late
    got = _drain(events, lambda g: len(g) >= 1)
    assert [e.block_hashes for e in got] == [[_int(h) for h in req.block_hashes[2:4]]]
    assert got[0].parent_block_hash == _int(req.block_hashes[1]) and got[0].token_ids == tokens[2 * C:4 * C]
    deadline = time.monotonic() + 60
    while events.pending() and time.monotonic() < deadline:  # the engine may go idle now
        events.take()
    assert not events.pending()


def test_removed_when_the_server_loses_a_tail_shared_chunks_stay(client):
    common = list(range(300, 300 + 2 * C))
    a, b = common + list(range(1000, 1000 + C + 1)), common + list(range(2000, 2000 + C + 1))
    ra, rb = _request(a, "a"), _request(b, "b")
    ka, kb = chunk_hashes(a, C), chunk_hashes(b, C)
    _store(client, ka, 3, [2])
    _store(client, kb, 3, [2])
    events = _events(client)
    events.found(ra, ka, 3, NS)
    events.found(rb, kb, 3, NS)
    stored = events.take()
    assert [len(e.block_hashes) for e in stored] == [3, 1]  # b's first two chunks are a's
    assert stored[1].parent_block_hash == _int(rb.block_hashes[1])
    client.delete(NS, [(ka[2], STATE, 0)])  # evicted: a resumes nowhere now (no state before)
    got = _drain(events, lambda g: any(type(e).__name__ == "BlockRemoved" for e in g))
    removed = [e for e in got if type(e).__name__ == "BlockRemoved"]
    # only a's own chunk goes: b still resumes past the shared ones
    assert [e.block_hashes for e in removed] == [[_int(ra.block_hashes[2])]]
    assert removed[0].medium == "CPU" and removed[0].group_idx == ATTN
    client.clear(NS)
    got = _drain(events, lambda g: sum(len(e.block_hashes) for e in g if type(e).__name__ == "BlockRemoved") == 3)
    assert sorted(h for e in got if type(e).__name__ == "BlockRemoved" for h in e.block_hashes) == sorted(
        _int(h) for h in rb.block_hashes[:3])


def test_announced_again_after_vllms_clear(client):
    tokens = list(range(500, 500 + 3 * C + 1))
    req, keys = _request(tokens), chunk_hashes(tokens, C)
    _store(client, keys, 3, [2])
    events = _events(client)
    events.found(req, keys, 3, NS)
    first = events.take()
    assert events.take() == []
    again = events.take(vllm_cleared=True)  # after vLLM's AllBlocksCleared in the same batch
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in again] == [
        (e.block_hashes, e.parent_block_hash, e.token_ids) for e in first]
    assert events.stats.reannounced_blocks == 3


def test_bounded_when_nobody_takes(client, monkeypatch):
    monkeypatch.setattr(ev, "MAX_QUEUED_EVENTS", 16)
    monkeypatch.setattr(ev, "MAX_CHAINS", 8)
    events = _events(client)
    for i in range(40):
        tokens = list(range(i * 100 + 16, i * 100 + 16 + C + 1))
        events.found(_request(tokens, f"r{i}"), chunk_hashes(tokens, C), 1, NS)
    assert len(events._chains) == 8 and len(events._chunks) == 8
    assert events.stats.forgotten_chains == 32
    assert len(events._queue) == 16 and events.stats.dropped_events == 40 + 32 - 16
    # the newest survive: the last events announce the 8 chains kept (each after the
    # removal of the chain it displaced)
    tail = events.take()
    assert [e.token_ids[0] for e in tail if type(e).__name__ == "BlockStored"] == [i * 100 + 16 for i in range(32, 40)]


def test_nothing_when_events_are_off(client):
    tokens = list(range(700, 700 + 2 * C + 1))
    req, keys = _request(tokens), chunk_hashes(tokens, C)
    _store(client, keys, 2, [1])
    events = _events(client, enabled=False)
    events.found(req, keys, 2, NS)
    events.saved(req, keys, 2, NS)
    assert events.take() == [] and not events.pending() and not events._chains


def test_a_server_away_does_not_keep_an_idle_engine_stepping(client):
    """Confirmations that get no answer count as tries: the idle engine's extra steps end
    (within the confirmation schedule), nothing is announced, nothing kept."""
    pool = ThreadPoolExecutor(1)
    away = lambda ns, keys: pool.submit(lambda: LookupAnswer(error=ConnectionError("server in back-off")))  # noqa: E731
    cfg = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    events = ev.ServerEvents(cfg, _kv_cache_config(), GEO, away)
    tokens = list(range(900, 900 + 2 * C + 1))
    events.saved(_request(tokens), chunk_hashes(tokens, C), 2, NS)
    assert events.pending()
    deadline = time.monotonic() + IDLE_STEPS_BOUND_S
    got = []
    while events.pending() and time.monotonic() < deadline:
        got += events.take()
    assert not events.pending() and got == [] and not events._chains


def test_one_step_after_a_clear_rechecks_every_chain(client):
    """More announced chains than lookups in flight (MAX_INFLIGHT): the step a request
    brings starts a round, and the idle engine steps on (pending) until every chain due
    then is rechecked, so all are announced removed after one request; then it idles."""
    n = 3 * ev.MAX_INFLIGHT
    events = _events(client)
    requests = []
    for i in range(n):
        tokens = list(range(5000 + i * 100, 5000 + i * 100 + 2 * C + 1))
        keys = chunk_hashes(tokens, C)
        _store(client, keys, 2, [1])
        requests.append(_request(tokens, f"r{i}"))
        events.found(requests[-1], keys, 2, NS)
    assert sum(len(e.block_hashes) for e in events.take()) == 2 * n
    client.clear(NS)
    time.sleep(ev.RECHECK_S + 0.05)  # a minimum time: every chain's recheck is due
    got = events.take()  # the one step of a request
    deadline = time.monotonic() + IDLE_STEPS_BOUND_S
    while events.pending() and time.monotonic() < deadline:  # idle steps vLLM takes
        got += events.take()
    removed = sorted(h for e in got if type(e).__name__ == "BlockRemoved" for h in e.block_hashes)
    assert removed == sorted(_int(h) for r in requests for h in r.block_hashes[:2])
    assert not events.pending() and not events._chains
