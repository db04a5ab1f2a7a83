"""The scheduler never waits on the network: lookups run on a
background thread and ``get_num_new_matched_tokens`` answers ``None`` ("ask again next
step", which vLLM 0.32 handles by leaving the request waiting) until the answer is in.

A real glm-cache-server process, stopped with SIGSTOP to play a server that accepts
connections but answers nothing; the scheduler side is built without an engine from
hand-made vLLM configs and real vLLM requests (see sched_fixtures)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cache_server.chunk_keys import chunk_hashes
from cache_server.client import CacheClient
from testing.sched_harness import request, scheduler_side

C = 256  # the shared server fixture's minimum chunk (conftest.py)
TIMEOUT_S = 1.0  # the stopped-server test's deadline (the server SIGSTOPped: the timeout is certain)
HIT_TIMEOUT_S = 60.0  # the other tests check hits: correctness, not a deadline (60 s: testing.engines.TIMEOUT_S)
RETRY_S = 1.0
PROMPT = list(range(16, 1016))  # 1000 tokens: strict prefix 3 chunks (768)
# What one scheduler call costs is a figure (validation/bench_overhead.py's admission); here
# the property is ordering: a call returns before the server could have answered (it is
# SIGSTOPped, or the call says "not yet"), never after waiting for it.


@pytest.fixture()
def side(server):
    # Keys hashed from token ids (the probe and the memo exist for them; the block-hash
    # keys of chunk_keys=vllm are tested in test_connector_vllm_keys.py).
    s = scheduler_side(server.url, block=C, timeout_s=HIT_TIMEOUT_S, retry_after_s=RETRY_S, chunk_keys="lmcache")
    yield s
    s.shutdown()


@pytest.fixture()
def short_side(server):
    """A side whose lookups are given up after TIMEOUT_S (for a SIGSTOPped server)."""
    s = scheduler_side(server.url, block=C, timeout_s=TIMEOUT_S, retry_after_s=RETRY_S, chunk_keys="lmcache")
    yield s
    s.shutdown()


def _store_prefix(server, namespace: str, tokens: list[int], salt: str, chunks: int) -> None:
    """Attention objects (group 1) for chunks [0, chunks) and a state (group 0) at the last."""
    hashes = chunk_hashes(tokens, C, salt)[:chunks]
    items = [(h, 1, 0, b"a" * 64) for h in hashes] + [(hashes[-1], 0, 0, b"s" * 64)]
    parents = [None, *hashes[:-1], hashes[-2] if chunks > 1 else None]
    with CacheClient(server.url) as c:
        assert set(c.put(namespace, items, parent=parents)) == {"stored"}


def _timed(side, req, computed=0):
    t0 = time.perf_counter()
    out = side.get_num_new_matched_tokens(req, computed)
    return out, time.perf_counter() - t0


def _ask_until_answered(side, req, computed=0, limit_s=60.0):
    """Call as vLLM does (once per step) until the answer is not None; every call timed."""
    calls = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out, dt = _timed(side, req, computed)
        calls.append(dt)
        if out[0] is not None:
            return out, calls
        time.sleep(0.005)  # a scheduler step
    raise AssertionError(f"no answer within {limit_s}s")


def test_answer_arrives_on_a_later_call(server, side):
    _store_prefix(server, side.namespace, PROMPT, "live", 3)
    req = request("live", PROMPT, "live")
    first, _ = _timed(side, req)
    assert first == (None, False)  # the lookup is out; the request waits this step, not for the answer
    out, _ = _ask_until_answered(side, req)
    assert out == (768, True)
    # Hashed once for the request: the save path reuses the same list.
    assert side._requests["live"].keys == chunk_hashes(PROMPT, C, "live")[:3]


def test_stopped_server_never_holds_the_scheduler_and_the_hit_returns(server, short_side):
    side = short_side
    _store_prefix(server, side.namespace, PROMPT, "stop", 3)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        first, _ = _timed(side, request("stopped", PROMPT, "stop"))
        assert first == (None, False)  # the call returned while the server cannot answer: no wait
        # asked once a step; answered cold by the connector's deadline while the server is still stopped
        out, calls = _ask_until_answered(side, request("stopped", PROMPT, "stop"))
        assert out == (0, False)  # no answer in time: cold
        # In back-off now: the next request is cold at once, without waiting a step.
        out, _ = _timed(side, request("behind", PROMPT, "stop"))
        assert out == (0, False)
        # Finishing a request whose lease must be released returns too, the server still stopped.
        side.request_finished_all_groups(request("stopped", PROMPT, "stop"), ([],))
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # The hit returns once the back-off has passed. This side gives up after TIMEOUT_S: on a
    # loaded machine a lookup of the running server may take longer, which is a cold answer
    # and another back-off, so ask again (a new request each time) until the hit, bounded.
    deadline, attempt, out = time.monotonic() + 60, 0, None
    while out != (768, True):
        assert time.monotonic() < deadline, f"no hit after the server resumed: {out}"
        time.sleep(RETRY_S + 0.2)  # the back-off passes (a sleep of at least RETRY_S: a lower bound)
        out, _ = _ask_until_answered(side, request(f"after-{attempt}", PROMPT, "stop"))
        attempt += 1


def test_answer_for_another_local_hit_is_asked_again(server, side):
    """vLLM's local prefix hit grew between two steps: the answer computed for the old
    one is not used (its lease is released); the request is asked again."""
    tokens = list(range(3000, 4800))  # 1800 tokens: strict prefix 7 chunks
    _store_prefix(server, side.namespace, tokens, "grow", 5)
    with CacheClient(server.url) as c:
        before = c.stats()["active_leases"]  # earlier tests' (the stopped one's expires later)
    req = request("grow", tokens, "grow")
    assert _timed(side, req, 0)[0] == (None, False)
    deadline = time.monotonic() + 60  # the answer (5 chunks, leased) is in
    while not side._requests["grow"].lookup.future.done():
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.01)
    out, calls = _ask_until_answered(side, req, computed=2 * C)
    assert out == (5 * C - 2 * C, True)
    assert len(calls) >= 2  # the first answer was for another start: asked again
    side.request_finished_all_groups(req, ([],))
    deadline = time.monotonic() + 60
    with CacheClient(server.url) as c:
        while c.stats()["active_leases"] > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["active_leases"] == before  # both leases released


def test_lookup_reports_what_the_server_holds_from_chunk_zero(server, side):
    """A lookup from past a local hit that finds nothing deeper still says how deep the
    server's attention goes: those chunks are not saved again."""
    tokens = list(range(5000, 6300))  # 1300 tokens
    _store_prefix(server, side.namespace, tokens, "held", 3)
    hashes = chunk_hashes(tokens, C, "held")
    with CacheClient(server.url) as c:
        n, lease, held, state = c.lookup_held(side.namespace, hashes[:5], [1], [0], 1, start_chunk=3,
                                              lease=False)
        assert (n, lease, held, state) == (0, None, 3, True)  # chunks 0-2 and the state at 2
        assert c.lookup_held(side.namespace, hashes[:5], [1], [0], 1, start_chunk=2,
                             lease=False)[3] is False  # no state at chunk 1
        # Older clients do not ask and get the old reply.
        reply, _ = c.request({"op": "lookup", "ns": side.namespace, "hashes": hashes[:5],
                              "attn_groups": [1], "state_groups": [0], "world_size": 1, "start_chunk": 3})
        assert "held" not in reply
    req = request("held", tokens, "held")
    out, _ = _ask_until_answered(side, req, computed=3 * C)
    assert out == (0, False)
    assert side._requests["held"].hit.held == 3 and side._requests["held"].hit.start_state


def test_next_turn_takes_its_history_hashes_from_the_memo(server, side):
    """A conversation's next turn: the chunks the previous turn hashed come from the
    memo (keyed by vLLM's own block hashes), only the new ones are hashed; the keys are
    exactly those of a fresh hash."""
    turn1 = list(range(7000, 8000))
    turn2 = turn1 + list(range(9000, 9600))
    r1 = request("t1", turn1, "memo", hash_block=C)
    assert side.request_keys(r1, 3) == chunk_hashes(turn1, C, "memo")
    r2 = request("t2", turn2, "memo", hash_block=C)
    memo = side.keys.memo
    taken = []
    memo.extend(taken, r2, C, 6, C)
    assert taken == chunk_hashes(turn1, C, "memo")  # the 3 chunks turn 1 hashed
    assert side.request_keys(r2, 6) == chunk_hashes(turn2, C, "memo")
    # Another salt shares nothing (vLLM's block hash covers the salt).
    other = []
    memo.extend(other, request("t3", turn2, "other", hash_block=C), C, 6, C)
    assert other == []


def test_no_memo_unless_vllm_hashes_blocks_with_a_cryptographic_hash(server):
    """With ``--prefix-caching-hash-algo xxhash`` a block-hash collision would give one
    prompt another's chunk keys (and its KV on every replica): the memo is not used, and
    every chunk is hashed from its tokens."""
    side = scheduler_side(server.url, block=C, hash_algo="xxhash", chunk_keys="lmcache")
    try:
        turn1 = list(range(7000, 8000))
        assert side.request_keys(request("x1", turn1, "memo", hash_block=C), 3) == chunk_hashes(turn1, C, "memo")
        assert len(side.keys.memo.entries) == 0
        turn2 = turn1 + list(range(9000, 9600))
        assert side.request_keys(request("x2", turn2, "memo", hash_block=C), 6) == chunk_hashes(turn2, C, "memo")
    finally:
        side.shutdown()


def test_answer_is_reused_while_the_request_waits_for_budget(server, side, monkeypatch):
    """vLLM asks again when it could not allocate the request (no token budget this
    step): the answer given is reused for a while, without a new lookup or a step of
    "not yet", and its one lease is kept; later it is asked afresh."""
    from connector import scheduler

    # "a while" is REUSE_ANSWER_S: an hour while the answer must be reused, none once it must not
    monkeypatch.setattr(scheduler, "REUSE_ANSWER_S", 3600.0)
    tokens = list(range(11000, 12000))
    _store_prefix(server, side.namespace, tokens, "reuse", 3)
    req = request("reuse", tokens, "reuse")
    out, _ = _ask_until_answered(side, req)
    assert out == (768, True)
    with CacheClient(server.url) as c:
        lookups, leases = c.stats()["lookups"], c.stats()["active_leases"]
        for _ in range(3):
            assert _timed(side, req)[0] == (768, True)
        assert c.stats()["lookups"] == lookups and c.stats()["active_leases"] == leases
        monkeypatch.setattr(scheduler, "REUSE_ANSWER_S", 0.0)
        assert _timed(side, req)[0] == (None, False)  # stale: asked again, old lease released
        out, _ = _ask_until_answered(side, req)
        assert out == (768, True)
        side.request_finished_all_groups(req, ([],))
        deadline = time.monotonic() + 60
        while c.stats()["active_leases"] > leases - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.stats()["active_leases"] == leases - 1


def test_a_prefix_not_on_the_server_is_probed_not_hashed(server, side):
    """A long prompt nobody has seen: one lookup of its first chunk's key says the server
    has none of it, and its other chunks are not hashed at admission (a 300k-token prompt
    took about 2 ms of the scheduler thread); the save path hashes them as they are saved,
    to the same keys, and knows nothing is held (no resend logic is fooled)."""
    tokens = list(range(20000, 21400))  # 1400 tokens: strict prefix 5 chunks
    req = request("probe-miss", tokens, "probe")
    with CacheClient(server.url) as c:
        lookups = c.stats()["lookups"]
        out, _ = _ask_until_answered(side, req)
        assert out == (0, False)
        assert c.stats()["lookups"] == lookups + 1  # the probe alone
    assert side._requests["probe-miss"].keys == chunk_hashes(tokens, C, "probe")[:1]
    assert side._requests["probe-miss"].hit.held == 0
    assert side.request_keys(req, 5) == chunk_hashes(tokens, C, "probe")[:5]


def test_a_probe_hit_is_looked_up_whole_with_hashes_from_the_lookup_thread(server, side):
    """The first chunk is there: the lookup thread hashes the rest and asks for all of it
    (leased); the answer brings the request's hashes back, the same as hashing here."""
    tokens = list(range(22000, 23400))
    _store_prefix(server, side.namespace, tokens, "probe", 4)
    req = request("probe-hit", tokens, "probe")
    with CacheClient(server.url) as c:
        lookups, leases = c.stats()["lookups"], c.stats()["active_leases"]
        out, _ = _ask_until_answered(side, req)
        assert out == (4 * C, True)
        assert c.stats()["lookups"] == lookups + 2  # the probe, then the whole prefix
        assert c.stats()["active_leases"] == leases + 1
    assert side._requests["probe-hit"].keys == chunk_hashes(tokens, C, "probe")[:5]
    side.request_finished_all_groups(req, ([],))


def test_lookups_given_up_on_are_never_sent():
    """Requests whose lookups queue behind a slow one and are then given up (finished,
    or admitted cold) have their queued lookups cancelled: the server sees only the
    lookup that was already on the wire, so abandoned ones cannot pile up in front of
    later requests."""
    from testing.server_process import ServerProcess

    srv = ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1").start()
    side = scheduler_side(srv.url, block=C, timeout_s=HIT_TIMEOUT_S, retry_after_s=RETRY_S, chunk_keys="lmcache")
    try:
        with CacheClient(srv.url) as c:
            before = c.stats()["lookups"]
            os.kill(srv.proc.pid, signal.SIGSTOP)  # the first lookup waits on the wire
            try:
                reqs = [request(f"q{i}", [i + 1, *PROMPT], "queued") for i in range(4)]
                for r in reqs:
                    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
                for r in reqs[1:]:  # given up on while queued behind the first
                    side.request_finished_all_groups(r, ([],))
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            out, _ = _ask_until_answered(side, reqs[0])
            assert out == (0, False)
            # a barrier instead of a pause: lookups go out in order, so once a later one is
            # answered any cancelled one still queued would have been sent before it
            out, _ = _ask_until_answered(side, request("barrier", [9999, *PROMPT], "queued"))
            assert out == (0, False)
            assert c.stats()["lookups"] == before + 2  # the one on the wire and the barrier
    finally:
        side.shutdown()
        srv.stop()
