"""GlmCacheConnector end to end: a real glm-cache-server process and a real vLLM engine.

The model is a tiny random Qwen3-Next (3 Gated-DeltaNet state layers + 1 attention
layer), which vLLM's CPU build runs natively with align-mode prefix caching. Its
unified block is 256 tokens and the server's minimum chunk is 256, so C == N == 256.

"Cold" is a prompt computed from scratch (under a cache_salt not used before, so neither
vLLM's prefix cache nor ours can hit; the cold run is also what saves to the server);
"reloaded" is the prompt sent again after ``reset_prefix_cache()``, so every reused token
comes from glm-cache-server.

Requests are compared one at a time (the paper's serial workload): vLLM's CPU kernels
are not batch-invariant (the same prompt batched with others gives first-token
log-probs ~0.03 apart), so only equal batch composition gives bit-equal outputs.

One engine and one server for the module (engine start-up ~30-60 s on 2 cores). The
server-killed test runs last and restarts the server on the same port.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid

import pytest

from cache_server.client import CacheClient
from testing.engines import connector_engine, stop_engine
from testing.server_process import ServerProcess
from testing.tiny_qwen3_next import BLOCK_SIZE, make_tiny_qwen3_next

pytestmark = pytest.mark.engine

C = 256  # chunk == vLLM's unified block for the tiny model
CONTINUATION = 64


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2048) for _ in range(n)]


def _strict_hit(n: int) -> int:
    return C * ((n - 1) // C)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))


TIMEOUT_S = 60.0  # the connector's timeout_s (per request, the floor of a batch's deadline): generous, as
# these tests check hits, not deadlines (testing.engines.TIMEOUT_S says why 60); the paused-server
# tests wait this long once each


@pytest.fixture(scope="module")
def llm(model_dir, server):
    engine = connector_engine(model_dir, server.url, connector={"timeout_s": TIMEOUT_S, "retry_after_s": 2.0},
                              seed=0, disable_log_stats=False, block_size=BLOCK_SIZE)  # metrics on: the connector's counters
    yield engine
    stop_engine(engine)
    del engine


def _counters(llm) -> dict[str, float]:
    """The engine's ``vllm:glm_cache_*`` counters (what ``vllm serve`` shows on /metrics), read
    from this process's Prometheus registry, where ``LLM``'s stat loggers keep them
    (``llm.get_metrics()`` rounds counters down to integers: CPU seconds would read 0)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:glm_cache_") and sample.name.endswith("_total"):
                key = sample.name.removeprefix("vllm:glm_cache_").removesuffix("_total")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _delta(after: dict, before: dict, *keys: str) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def _run(llm, prompts, salt=None, max_tokens=CONTINUATION, extra=None):
    """Greedy generation; returns (token ids, first-token logprob, cached tokens) per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True, extra_args=extra
    )
    inputs = []
    for p in prompts:
        tp = TokensPrompt(prompt_token_ids=p)
        if salt is not None:
            tp["cache_salt"] = salt
        inputs.append(tp)
    outs = llm.generate(inputs, params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        first = c.logprobs[0][c.token_ids[0]].logprob
        results.append((list(c.token_ids), first, o.num_cached_tokens or 0))
    return results


def _cold(llm, prompts, max_tokens=CONTINUATION):
    return _run(llm, prompts, salt=f"cold-{uuid.uuid4().hex}", max_tokens=max_tokens)


def _cold_then_reloaded(llm, prompt, salt, max_tokens=CONTINUATION):
    (cold,) = _run(llm, [prompt], salt=salt, max_tokens=max_tokens)
    assert cold[2] == 0, "a fresh salt must start cold"
    llm.reset_prefix_cache()
    (reloaded,) = _run(llm, [prompt], salt=salt, max_tokens=max_tokens)
    return cold, reloaded


def test_reload_after_reset_resumes_at_strict_prefix(llm):
    before = _counters(llm)
    prompt = _prompt(1000, seed=1)
    cold, reloaded = _cold_then_reloaded(llm, prompt, salt="reload-1000")
    assert reloaded[2] == _strict_hit(1000) == 768
    assert reloaded[0] == cold[0]
    assert reloaded[1] == cold[1]
    # what the connector took from the steps (both sides) and its load threads is counted
    grown = _delta(_counters(llm), before, "loaded_objects", "load_cpu_seconds", "step_cpu_seconds",
                   "scheduler_cpu_seconds")
    assert all(v > 0 for v in grown.values()), grown
    assert grown["scheduler_cpu_seconds"] < 10 and grown["step_cpu_seconds"] < 10, grown


@pytest.mark.parametrize("k", [1, 2, 3])
def test_boundary_sweep_reloaded_equals_cold(llm, k):
    """The paper's workload: lengths k*C-1, k*C, k*C+1; 64-token greedy continuations."""
    for i, n in enumerate([k * C - 1, k * C, k * C + 1]):
        prompt = _prompt(n, seed=100 * k + i)
        cold, reloaded = _cold_then_reloaded(llm, prompt, salt=f"sweep-{n}")
        assert reloaded[2] == _strict_hit(n), f"length {n}"
        assert reloaded[0] == cold[0], f"length {n}: continuation differs from cold"
        assert reloaded[1] == cold[1], f"length {n}"


def test_full_prompt_hit_without_strict_prefix_diverges_and_is_never_saved(llm, model_dir, server):
    """Taking the strict-prefix rule out (operator policy ``strict_prefix: false``, a second
    engine on the same server) lets a k*C prompt resume at k*C: vLLM recomputes the last
    token on a state that already holds it (the token is applied twice), and the output
    drifts. That engine never saves, so its wrong states reach no other replica. A request
    asking for the switch per request is ignored by the strict engine."""
    diverged = []
    loose_engine = connector_engine(model_dir, server.url, connector={"strict_prefix": False}, seed=0,
                                   block_size=BLOCK_SIZE)
    try:
        for k in (1, 2, 3):
            longer = _prompt(k * C + 1, seed=500 + k)
            prompt = longer[: k * C]
            salt = f"nonstrict-{k}"
            (cold,) = _cold(llm, [prompt])
            _run(llm, [longer], salt=salt)  # leaves a state snapshot at k*C on the server
            llm.reset_prefix_cache()
            objects = CacheClient(server.url).stats()["objects"]
            (loose,) = _run(loose_engine, [prompt], salt=salt)
            (fresh,) = _run(loose_engine, [_prompt(k * C + 5, seed=900 + k)], salt=salt)
            time.sleep(0.5)  # saves would leave from a background thread
            assert CacheClient(server.url).stats()["objects"] == objects, "a non-strict engine saved"
            (asked,) = _run(llm, [prompt], salt=salt, extra={"kv_transfer_params": {"glm_strict_prefix": False}})
            assert loose[2] == k * C  # the whole prompt came from the cache
            # Strict: at most (k-1)*C; here 0, as the longer prompt's cold run left a state
            # snapshot only at k*C (vLLM keeps the replay boundary, not every block).
            assert asked[2] <= (k - 1) * C
            assert asked[0] == cold[0] and asked[1] == cold[1]
            diverged.append(loose[0] != cold[0] or abs(loose[1] - cold[1]) > 1e-3)
    finally:
        stop_engine(loose_engine)
        del loose_engine
    assert all(diverged), f"non-strict full hits should drift from cold: {diverged}"


def _salted_lookups(server, salt: str | None) -> float:
    """The server's LMCache-labelled lookup count under ``salt``'s (hashed) label."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from cache_server.metrics import salt_label

    with urllib.request.urlopen(server.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    label = salt_label(salt)
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "lmcache_mp_lookups_requests_total" and s.labels.get("cache_salt") == label)


def test_different_cache_salt_gets_no_hit(llm, server):
    prompt = _prompt(700, seed=7)
    salted_before = _salted_lookups(server, "tenant-a")
    _run(llm, [prompt], salt="tenant-a", max_tokens=4)
    llm.reset_prefix_cache()
    (other,) = _run(llm, [prompt], salt="tenant-b", max_tokens=4)
    assert other[2] == 0
    llm.reset_prefix_cache()
    (same,) = _run(llm, [prompt], salt="tenant-a", max_tokens=4)
    assert same[2] == _strict_hit(700)
    # the connector tells the server each lookup's salt, for LMCache's cache_salt label
    # (a keyed hash there, never the salt in clear)
    assert _salted_lookups(server, "tenant-a") - salted_before >= 2
    assert _salted_lookups(server, "tenant-b") >= 1


def test_concurrent_requests_reload_their_own_prefixes(llm):
    """Six prompts loaded in one batch each get their own chunks and states: the whole
    greedy continuation of each equals, token for token, what the same batch gives when
    it resumes at the same points from vLLM's own prefix cache (same prompts, same hits,
    same batch: the composition the CPU kernels' numerics depend on), first log-probs
    included; and the tokens equal the cold batch's. A mixed-up load would be far off.

    The reloaded batch's loads land asynchronously, so which requests share its first
    prefill step can in principle differ from the local run's; measured on this build,
    the reloaded, local, cold and serial runs give bit-equal log-probs, so the tolerance
    is only float noise."""
    prompts = [_prompt(300 + 97 * i, seed=900 + i) for i in range(6)]
    cold = _run(llm, prompts, salt="batch", max_tokens=16)
    local = _run(llm, prompts, salt="batch", max_tokens=16)  # vLLM's own prefix cache
    llm.reset_prefix_cache()
    reloaded = _run(llm, prompts, salt="batch", max_tokens=16)
    for p, c, loc, r in zip(prompts, cold, local, reloaded):
        assert c[2] == 0
        assert loc[2] == r[2] == _strict_hit(len(p)), f"length {len(p)}"
        assert r[0] == loc[0] == c[0], f"length {len(p)}: continuation differs"
        assert r[1] == pytest.approx(loc[1], abs=1e-6), f"length {len(p)}"


def test_corrupt_objects_fail_the_load_and_recompute(llm, server):
    """Objects of the wrong size under the right keys (and their right checksums): the
    lookup hits (3 chunks, with a lease), the worker fetches the hit's objects and refuses
    them before writing any, the load fails (the engine's ``load_failures`` counts it, no
    object counts as loaded), vLLM is told (failed_recving) and recomputes from token 0;
    the lease is released and the output equals the cold one."""
    from testing.vllm_keys import vllm_chunk_keys

    prompt = _prompt(800, seed=21)
    (cold,) = _cold(llm, [prompt], max_tokens=16)
    client = CacheClient(server.url)
    stats = client.stats()
    (namespace,) = stats["namespaces"]
    groups = sorted(int(g) for g in stats["bytes_by_group"])
    hashes = vllm_chunk_keys(prompt, C, C, "corrupt")  # the engine's keys: vLLM's block hashes
    results = client.put(namespace, [(h, g, 0, b"garbage") for h in hashes for g in groups])
    assert set(results) == {"stored"}
    llm.reset_prefix_cache()
    server_before, engine_before = _settled_stats(client), _counters(llm)
    (after,) = _run(llm, [prompt], salt="corrupt", max_tokens=16)
    server_after, engine_after = _settled_stats(client), _counters(llm)
    hit = _strict_hit(len(prompt)) // C
    n_objects = hit + len(groups) - 1  # attention for every chunk of the hit, the states at its end
    assert _delta(server_after, server_before, "lookups", "hits", "hit_chunks", "leases_granted", "get_hits") == {
        "lookups": 1, "hits": 1, "hit_chunks": hit, "leases_granted": 1, "get_hits": n_objects}
    assert server_after["active_leases"] == 0
    assert _delta(engine_after, engine_before, "load_failures", "loaded_objects", "loaded_bytes") == {
        "load_failures": 1, "loaded_objects": 0, "loaded_bytes": 0}
    assert after[2] == 0  # recomputed from the start: nothing counts as cached
    assert after[0] == cold[0]
    assert after[1] == pytest.approx(cold[1], abs=1e-6)


def test_flipped_byte_in_a_stored_object_is_caught_and_recomputed(llm, server):
    """Right size, right key, one byte wrong (the server's debug fault hook): the loader's
    checksum check refuses it before any byte reaches vLLM's cache, the server deletes it
    and counts it, and the request computes cold."""
    import urllib.request

    from testing.vllm_keys import vllm_chunk_keys

    prompt = _prompt(800, seed=23)
    salt = "bitrot"
    (cold,) = _run(llm, [prompt], salt=salt, max_tokens=16)
    client = CacheClient(server.url)
    stats = client.stats()
    (namespace,) = stats["namespaces"]
    first = vllm_chunk_keys(prompt, C, C, salt)[0]
    flipped = [client.request({"op": "debug_corrupt", "ns": namespace, "keys": [[first, int(g), 0]],
                               "offset": 4097})[0]["corrupted"] for g in stats["bytes_by_group"]]
    assert any(flipped)
    llm.reset_prefix_cache()
    (after,) = _run(llm, [prompt], salt=salt, max_tokens=16)
    assert after[0] == cold[0]
    assert after[1] == pytest.approx(cold[1], abs=1e-6)
    metrics = urllib.request.urlopen(server.http_url + "/metrics", timeout=5).read().decode()
    assert f'glm_cache_deleted_objects_total{{reason="checksum"}} {float(sum(flipped))}' in metrics
    client.close()


def test_abort_during_external_load_keeps_the_engine_healthy(llm, server):
    """A request aborted while its blocks are being loaded: the connector keeps the blocks
    until the worker reports the load, its lease is released, and the engine goes on.

    The load is held in flight by stopping the server (SIGSTOP) as soon as it has granted
    the lookup's lease, before it answers the worker's get: while it is stopped the
    request is aborted, and its blocks must stay allocated (vLLM cannot reset its prefix
    cache while any block is in use). Once the server goes on, it answers the get, the
    worker writes the pages and reports, and only then are the blocks freed and the lease
    released. An attempt whose get was answered before the stop (the load had finished), or
    aborted before the scheduler took the lookup's answer (no load began, no get: seen in CI
    beside a busy loop), establishes nothing and is not counted; two attempts must hold a
    load in flight."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = _prompt(1100, seed=41)
    salt = "abort"
    (cold,) = _run(llm, [prompt], salt=salt, max_tokens=8)
    engine = llm.llm_engine
    client = CacheClient(server.url, timeout_s=5)
    # what a hit loads: attention for every chunk of it, the states at its end
    n_objects = _strict_hit(1100) // C + len(_settled_stats(client)["bytes_by_group"]) - 1
    in_flight = []
    for attempt in range(6):
        assert llm.reset_prefix_cache()
        before = client.stats()
        req_id = f"abort-{attempt}"
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        deadline = time.monotonic() + TIMEOUT_S
        while client.stats()["leases_granted"] == before["leases_granted"]:  # the lookup hit
            assert time.monotonic() < deadline, "no lookup reached the server"
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)
            engine.abort_request([req_id])
            time.sleep(0.3)
            held = not llm.reset_prefix_cache()  # blocks still allocated half a second after the abort
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + TIMEOUT_S + 1.0
        while not llm.reset_prefix_cache():  # freed once the worker reported
            assert time.monotonic() < deadline, "the aborted request's blocks were never freed"
            time.sleep(0.01)
        while client.stats()["active_leases"] and time.monotonic() < deadline:
            time.sleep(0.01)  # releases are sent from a background thread
        after = client.stats()
        assert after["active_leases"] == 0
        delta = _delta(after, before, "hit_chunks", "leases_granted", "leases_released", "get_hits")
        if delta["get_hits"] == 0:  # aborted before the scheduler took the lookup's answer: no load began
            assert not held and delta == {"hit_chunks": _strict_hit(1100) // C, "leases_granted": 1,
                                          "leases_released": 1, "get_hits": 0}
            continue
        assert delta == {"hit_chunks": _strict_hit(1100) // C, "leases_granted": 1, "leases_released": 1,
                         "get_hits": n_objects}
        if held:
            in_flight.append(attempt)
        if len(in_flight) == 2:
            break
    assert len(in_flight) == 2, f"no load was in flight at the abort in {attempt + 1} attempts"
    llm.reset_prefix_cache()
    (after,) = _run(llm, [prompt], salt=salt, max_tokens=8)
    assert after[2] == _strict_hit(1100)
    assert after[0] == cold[0]


def test_reset_with_connector_keeps_the_shared_entries(llm, server):
    """``reset_prefix_cache(reset_connector=True)``, what a sleep or a cache-clearing pause
    runs, leaves glm-cache-server's objects alone (the namespace is every replica's on these
    weights); the engine names its weights again (unchanged) and resumes from them."""
    prompt = _prompt(600, seed=31)
    _run(llm, [prompt], salt="reset-connector", max_tokens=2)
    assert "Negotiated chunk size to 256" in server.log()
    client = CacheClient(server.url)
    counts = [client.stats()["objects"]]
    while len(counts) < 3 or counts[-1] != counts[-2]:  # saves are sent in the background
        time.sleep(0.2)
        counts.append(client.stats()["objects"])
    assert counts[-1] > 0
    assert llm.reset_prefix_cache(reset_connector=True)
    assert client.stats()["objects"] == counts[-1]
    (after,) = _run(llm, [prompt], salt="reset-connector", max_tokens=2)
    assert after[2] == _strict_hit(600)  # from the server: vLLM's own prefix cache was reset too


def _settled_stats(client):
    """Server stats once the background saves have stopped changing them."""
    seen = [client.stats()]
    while len(seen) < 3 or seen[-1]["objects"] != seen[-2]["objects"]:
        time.sleep(0.2)
        seen.append(client.stats())
    return seen[-1]


def test_next_turn_marks_the_previous_turns_state_superseded(llm, server):
    """Snapshot-aware retention: a conversation's new state names the one it replaces."""
    client = CacheClient(server.url)
    turn1 = _prompt(1000, seed=41)  # state kept at 768
    turn2 = turn1 + _prompt(600, seed=42)  # resumes at 768, state kept at 1536
    _run(llm, [turn1], salt="turns", max_tokens=2)
    before = _settled_stats(client)["superseded_objects"]
    _run(llm, [turn2], salt="turns", max_tokens=2)
    after = _settled_stats(client)
    n_state_groups = len(after["bytes_by_group"]) - 1  # every group but the attention one
    assert after["superseded_objects"] - before == n_state_groups
    llm.reset_prefix_cache()
    (reloaded,) = _run(llm, [turn2], salt="turns", max_tokens=2)  # the newest state still resumes
    assert reloaded[2] == _strict_hit(len(turn2))


def _server_late_lookups(server) -> float:
    """The server's lookups answered after, or skipped for, their client's deadline."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.http_url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "glm_cache_late_requests_total" and s.labels.get("op") == "lookup")


def _until_hit(llm, prompt, salt, hit: int, max_tokens: int = 8, bound_s: float = 120.0):
    """Send ``prompt`` (vLLM's prefix cache reset first) until it resumes ``hit`` tokens
    from the server: the connector's back-off after a failure lets the first ones go cold."""
    deadline = time.monotonic() + bound_s
    while True:
        llm.reset_prefix_cache()
        (out,) = _run(llm, [prompt], salt=salt, max_tokens=max_tokens)
        if out[2] == hit:
            return out
        assert out[2] == 0 and time.monotonic() < deadline, f"no hit of {hit} within {bound_s}s: {out[2]}"


def test_a_lookup_the_paused_server_answers_late_is_counted_late_and_the_next_ones_are_answered(llm, server):
    """The server is paused (SIGSTOP) across a lookup: the request is served cold (same
    tokens) once the lookup's deadline (``timeout_s`` from when vLLM asked) has passed. After
    SIGCONT the server skips that lookup (its client gave up: counted late, ``dropped``, on
    the server), the engine takes the late answer on its kept connection and counts it
    ``lookups_late``, not ``lookups_unanswered``, and its next lookups are answered in time
    and hit. No lease stays held."""
    prompt = _prompt(900, seed=51)
    (cold,) = _run(llm, [prompt], salt="stalled", max_tokens=8)
    client = CacheClient(server.url, timeout_s=60)
    _settled_stats(client)
    late_on_server = _server_late_lookups(server)
    before = _counters(llm)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        llm.reset_prefix_cache()
        (after,) = _run(llm, [prompt], salt="stalled", max_tokens=8)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert after[2] == 0 and after[0] == cold[0]
    again = _until_hit(llm, prompt, "stalled", _strict_hit(900))
    assert again[0] == cold[0]
    keys = ("lookups_sent", "lookups_in_time", "lookups_late", "lookups_unanswered")
    deadline = time.monotonic() + 120
    while _delta(_counters(llm), before, *keys)["lookups_late"] == 0:  # the late answer is taken by a later
        assert time.monotonic() < deadline, _delta(_counters(llm), before, *keys)  # lookup on that connection
        _until_hit(llm, prompt, "stalled", _strict_hit(900))
    counts = _delta(_counters(llm), before, *keys)
    assert counts["lookups_late"] == 1 and counts["lookups_unanswered"] == 0, counts
    assert counts["lookups_in_time"] >= 1 and counts["lookups_sent"] == counts["lookups_in_time"] + 1, counts
    assert _server_late_lookups(server) == late_on_server + 1  # it reached the server, after its deadline
    deadline = time.monotonic() + 60
    while client.stats()["active_leases"]:  # releases are sent from a background thread
        assert time.monotonic() < deadline, "a lease stayed held"
        time.sleep(0.05)


def test_server_killed_mid_run_serves_cold(llm, server):
    prompt = _prompt(900, seed=11)
    (cold,) = _run(llm, [prompt], salt="killed", max_tokens=16)  # cold, and saved
    server.kill()
    llm.reset_prefix_cache()
    (after,) = _run(llm, [prompt], salt="killed", max_tokens=16)
    assert after[2] == 0
    assert after[0] == cold[0]
    # A restarted (empty) server is picked up again once the back-off has passed.
    restarted = ServerProcess(
        "--separate-object-groups", "--chunk-size", "256", "--l1-size-gb", "1",
        port=server.port, http_port=server.http_port,
    ).start()
    try:
        deadline = time.monotonic() + 120
        while CacheClient(restarted.url, timeout_s=60).stats()["objects"] == 0:  # saved again, once reconnected
            assert time.monotonic() < deadline, "the restarted server never got the prompt's objects"
            llm.reset_prefix_cache()
            _run(llm, [prompt], salt="killed", max_tokens=4)
        _settled_stats(CacheClient(restarted.url, timeout_s=60))
        again = _until_hit(llm, prompt, "killed", _strict_hit(900), max_tokens=16)
        assert again[0] == cold[0]
    finally:
        restarted.stop()
