"""Two hosts on one L2, end to end: a real vLLM engine (tiny Qwen3-Next, C == N == 256), a
three-node Redis cluster, and glm-cache-server processes that take turns on one port.

An engine's server URL is fixed, so "host A" and "host B" are two server processes (two
separate L1s) that listen on the engine's port one after the other: what B serves right
after it starts (empty L1) can only come from L2. One engine for the module.
"""

from __future__ import annotations

import random
import re
import time
import uuid

import pytest

from cache_server.client import CacheClient
from testing.engines import connector_engine, stop_engine
from testing.l2_fixtures import l2_args, wait_written
from testing.server_process import ServerProcess, free_port
from testing.tiny_qwen3_next import BLOCK_SIZE, make_tiny_qwen3_next

pytestmark = pytest.mark.engine

C = 256
PORT, HTTP_PORT = free_port(), free_port()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2048) for _ in range(n)]


def _run(llm, prompt, salt, max_tokens=16):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, cache_salt=salt)], params, use_tqdm=False)
    c = out.outputs[0]
    return list(c.token_ids), c.logprobs[0][c.token_ids[0]].logprob, out.num_cached_tokens or 0


def _host(cluster, *extra: str, query: str = "") -> ServerProcess:
    # The engine's sockets reconnect to the new process by themselves (ZMQ); its requests
    # wait for that within the connector's timeout_s (TIMEOUT_S), so nothing is slept here.
    return ServerProcess("--separate-object-groups", "--chunk-size", str(C), *l2_args(cluster.url + query), *extra,
                         port=PORT, http_port=HTTP_PORT).start()


def _stats(srv: ServerProcess) -> dict:
    with CacheClient(srv.url, timeout_s=60) as c:
        return c.stats()


def _settled(srv: ServerProcess, puts: int = 1, evictions: int = 0, timeout_s: float = 60.0) -> dict:
    """The server's stats once the engine's saves have landed: at least ``puts`` objects
    stored and ``evictions`` evicted, and neither count moving across three reads 0.2 s
    apart (the connector saves from a background thread, after vLLM has answered)."""
    deadline = time.monotonic() + timeout_s
    seen = [_stats(srv)]
    while True:
        last = [(s["puts_stored"], s["evictions"]) for s in seen[-3:]]
        if len(last) == 3 and len(set(last)) == 1 and last[0][0] >= puts and last[0][1] >= evictions:
            return seen[-1]
        assert time.monotonic() < deadline, (
            f"the engine's saves did not settle at >= {puts} stored, >= {evictions} evicted within {timeout_s}s: {last}")
        time.sleep(0.2)
        seen.append(_stats(srv))


def _saved_through(srv: ServerProcess, puts: int) -> dict:
    """Once the engine's saves of a prompt have landed on ``srv`` (a fresh server: every
    object it stored is queued for L2) and its L2 writer has written them all."""
    return wait_written(lambda: _stats(srv), _settled(srv, puts)["puts_stored"])


TIMEOUT_S = 60.0  # the connector's timeout_s: generous, as these tests check hits (and a miss the
# server answers), not the connector's deadline; 60 s outlasts a stall of the whole machine
# (testing.engines.TIMEOUT_S)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, cluster):
    model = make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny_qwen3_next"))
    first = _host(cluster)  # the connector says hello at start-up
    engine = connector_engine(model, f"tcp://127.0.0.1:{PORT}", connector={"timeout_s": TIMEOUT_S, "retry_after_s": 1.0},
                              seed=0, block_size=BLOCK_SIZE)
    first.stop()
    yield engine
    stop_engine(engine)
    del engine


def test_resume_through_another_host_after_a_kill_and_a_restart(llm, cluster):
    """Stored through A; A SIGKILLed; B (empty L1) resumes it from L2; A restarted resumes it
    from L2 again; a small L1 on A evicts it and A resumes it from L2 once more. Every
    reloaded output equals the cold one."""
    prompt = _prompt(1000, seed=1)
    salt = f"l2-{uuid.uuid4().hex}"
    hit = C * ((len(prompt) - 1) // C)

    a = _host(cluster)
    cold = _run(llm, prompt, salt)
    assert cold[2] == 0
    written = _saved_through(a, 4)["written_objects"]
    assert written >= 4  # 3 attention chunks and at least one state
    a.kill()

    llm.reset_prefix_cache()
    b = _host(cluster)
    try:
        assert _stats(b)["objects"] == 0
        on_b = _run(llm, prompt, salt)
        l2 = _stats(b)["l2"]
    finally:
        b.stop()
    assert on_b[2] == hit and on_b[0] == cold[0] and on_b[1] == cold[1]
    assert l2["hits"] >= 1 and l2["promoted_objects"] >= 4

    llm.reset_prefix_cache()
    a = _host(cluster, "--l1-size-gb", "0.0025")  # restarted, with room for about two such prompts
    try:
        again = _run(llm, prompt, salt)
        assert again[2] == hit and again[0] == cold[0]
        for k in range(3):  # other conversations push the first one out of A's L1
            _run(llm, _prompt(1000, seed=10 + k), f"{salt}-other-{k}", max_tokens=2)
        status = _settled(a, evictions=1)  # their saves landed, and pushed objects out
        assert status["evictions"] > 0
        hits_before = status["l2"]["hits"]
        llm.reset_prefix_cache()
        evicted = _run(llm, prompt, salt)
        status = _stats(a)
    finally:
        a.stop()
    assert evicted[2] == hit and evicted[0] == cold[0] and evicted[1] == cold[1]
    assert status["l2"]["hits"] == hits_before + 1


def _l2_round_trips(srv: ServerProcess) -> dict[str, float]:
    """How many L2 round trips of each op (exists, get, set) the server completed: its
    ``glm_cache_l2_request_seconds`` histogram counts one per answered pipeline."""
    import urllib.request

    text = urllib.request.urlopen(srv.http_url + "/metrics", timeout=60).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("glm_cache_l2_request_seconds_count{"):
            op = line.split('op="', 1)[1].split('"', 1)[0]
            out[op] = float(line.rsplit(" ", 1)[1])
    return out


def _late_requests(srv: ServerProcess) -> float:
    """Requests the server answered (or dropped) after their client's deadline had passed
    (``glm_cache_late_requests_total``, all ops and outcomes)."""
    import urllib.request

    text = urllib.request.urlopen(srv.http_url + "/metrics", timeout=60).read().decode()
    return sum(float(m[1]) for m in re.finditer(r"^glm_cache_late_requests_total\{[^}]*\} (\S+)$", text, re.M))


PROMOTE_DELAY_S = 10.0  # the promotion's hold between EXISTS and GET: the window the nodes are killed in


def test_store_killed_mid_promotion_computes_cold(llm, cluster):
    """Every L2 node SIGKILLed while a host promotes, between its EXISTS and its GET (a
    debug delay holds the promotion there for PROMOTE_DELAY_S, a window much wider than
    the killer needs; the nodes are killed once the server's metrics show the EXISTS
    answered, and the GET is then never answered): the store's error ends the promotion
    (no L2 timeout counted), the server answers the lookup a miss within the engine's
    deadline (no late request), the request computes cold, and its output equals cold.
    The server's L2 round-trip histogram shows which case it was: one EXISTS answered, no
    GET answered."""
    import threading

    prompt = _prompt(900, seed=2)
    salt = f"l2-fault-{uuid.uuid4().hex}"
    a = _host(cluster)
    try:
        cold = _run(llm, prompt, salt)
        _saved_through(a, 4)
    finally:
        a.stop()
    llm.reset_prefix_cache()
    b = _host(cluster, "--debug-fault-hooks",
              query=f"?timeout_s=60&retry_after_s=30&debug_promote_delay_s={PROMOTE_DELAY_S}")
    try:
        before = _l2_round_trips(b)
        killed: list[dict[str, float]] = []

        def kill_after_exists() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                seen = _l2_round_trips(b)
                if seen.get("exists", 0) > before.get("exists", 0):
                    cluster.kill()
                    killed.append(seen)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_after_exists)
        killer.start()
        after = _run(llm, prompt, salt)
        killer.join()
        l2 = _stats(b)["l2"]
        trips = _l2_round_trips(b)
        late = _late_requests(b)
    finally:
        b.stop()
    assert killed, "no EXISTS reached L2"
    # One EXISTS answered before the kill, no GET answered (it came after, into dead nodes).
    assert trips.get("exists", 0) - before.get("exists", 0) == 1, (before, killed, trips)
    assert trips.get("get", 0) == before.get("get", 0), (before, killed, trips)
    assert after[2] == 0 and after[0] == cold[0] and after[1] == cold[1]
    assert l2["hits"] == 0 and l2["misses"] >= 1 and l2["promoted_objects"] == 0, l2
    # The store's error ended the promotion, not the L2 deadline (60 s here), and the lookup
    # was answered within the engine's own deadline (TIMEOUT_S), not given up on.
    assert l2["timeouts"] == 0 and sum(l2["errors"].values()) >= 1, l2
    assert late == 0, f"the server answered {late} request(s) after the engine had given up"
