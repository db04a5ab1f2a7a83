"""Save outcomes flow back from the worker to the scheduler, on a real vLLM CPU engine
(the tiny GLM-5.3-Flash checkpoint: KDA state groups + sparse MLA) and a real
glm-cache-server.

The server's whole budget is pinned by a leased object of another namespace, so the
engine's puts are answered ``no_space``. The worker reports each save that did not land
(``build_connector_worker_meta``); the scheduler moves the request's saved depth back to
the first hole and saves the holes again while the request still holds its blocks
(``update_connector_output``), or gives its saves up after a bounded number of retries.
Either way the outputs equal a cold compute.

Engine set-up as in test_connector_glm.py (C = 2N = 256, prefill steps and states on
chunk boundaries).
"""

from __future__ import annotations

import threading
import time

import pytest

from cache_server.client import CacheClient
from testing.engines import generate_one, random_prompt, stop_engine, tiny_glm_engine

pytestmark = pytest.mark.engine

C = 256
CONTINUATION = 64
L1_GB = 0.05
FILLER_GROUPS = (0, 1)


_prompt = random_prompt


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


SERVER_ARGS = ("--chunk-size", str(C), "--l1-size-gb", str(L1_GB), "--max-leased-fraction", "1")  # the server fixture's (conftest.py)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, server):
    engine = tiny_glm_engine(tmp_path_factory, server.url, C, disable_log_stats=False)  # metrics on
    yield engine
    stop_engine(engine)
    del engine


def _fill_and_pin(url: str, tag: int) -> tuple[CacheClient, int]:
    """Empty the server, fill its whole budget with a leased object of another
    namespace, and return the client that holds the lease (only its connection may
    release it) and the lease: until it is released every put is no_space."""
    cli = CacheClient(url, timeout_s=60)
    cli.clear()
    stats = cli.stats()
    cap = stats["capacity_bytes"]
    cli.hello("filler", C, attn_groups=[FILLER_GROUPS[0]], state_groups=[FILLER_GROUPS[1]])
    big = cap - 1024 - 2 * stats["object_overhead_bytes"]  # each object is charged its index too
    res = cli.put("filler", [(_hash(tag), FILLER_GROUPS[0], 0, bytes(big // 2)),
                             (_hash(tag), FILLER_GROUPS[1], 0, bytes(big - big // 2))], parent=[None, None])
    assert res == ["stored", "stored"]
    n, lease = cli.lookup("filler", [_hash(tag)], [FILLER_GROUPS[0]], [FILLER_GROUPS[1]])
    assert n == 1 and lease is not None
    return cli, lease


def _release_on_first_no_space(cli: CacheClient, lease: int, stop: threading.Event) -> threading.Thread:
    """Release the pin (through the connection that took it) as soon as the server has
    refused a put: the saves of the first step(s) fail, the later ones find space."""

    def watch() -> None:
        while not stop.is_set():
            if cli.stats()["puts_no_space"] > 0:
                assert cli.release(lease)
                return
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _run(llm, prompt, salt, max_tokens=CONTINUATION):
    return generate_one(llm, prompt, salt, max_tokens)


def _stats(url: str) -> dict:
    with CacheClient(url, timeout_s=60) as cli:
        return cli.stats()


_flushes = iter(range(1_000_000))
PUTS = ("puts_stored", "puts_existing", "puts_no_space")  # the server's count of every object put to it
SAVE_COUNTERS = ("saved_objects", "saved_bytes", "save_failures", "saves_reported_failed", "saves_corrected",
                 "saves_given_up", "saves_lost")


def _settled_puts(url: str, timeout_s: float = 60.0) -> None:
    """Return once the server's put counts have not moved across three reads 0.2 s apart:
    the engine's saves, sent from its workers' threads, have all reached the server."""
    deadline = time.monotonic() + timeout_s
    seen = [tuple(_stats(url)[k] for k in PUTS)]
    while len(seen) < 3 or len(set(seen[-3:])) > 1:
        assert time.monotonic() < deadline, f"the engine's puts did not settle within {timeout_s}s: {seen[-3:]}"
        time.sleep(0.2)
        seen.append(tuple(_stats(url)[k] for k in PUTS))


def _counters(llm, url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The engine's ``vllm:glm_cache_*`` counters (what ``vllm serve`` shows on /metrics),
    once the last saves' replies reached the scheduler: the saves have reached the server
    (its put counts settled), and a step carries their replies, so short requests (no whole
    chunk: nothing to save) run until two in a row leave the save counters as they were."""
    _settled_puts(url, timeout_s)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        _run(llm, _prompt(C // 2, seed=600 + next(_flushes)), f"flush-{time.monotonic_ns()}", max_tokens=2)
        now = {m.name.removeprefix("vllm:glm_cache_").removesuffix("_total"): m.value
               for m in llm.get_metrics() if m.name.startswith("vllm:glm_cache_")}
        if last is not None and all(now.get(k) == last.get(k) for k in SAVE_COUNTERS):
            return now
        assert time.monotonic() < deadline, f"the engine's save counters still moved after {timeout_s}s: {now}"
        last = now


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def test_a_save_that_found_no_space_is_reported_and_saved_again(llm, server):
    """Chunk 0's attention is refused (no_space) during the cold run. Without the report
    and the re-save it stays a hole, and since a hit must cover every chunk from 0, the
    reload would find nothing; with it, the reload resumes at the strict prefix. The
    engine's own counters (vLLM's metrics) say the same as the server: every object the
    engine counts as saved is one the server stored, the refusals were reported and
    corrected, and the reload loaded without failures."""
    prompt = _prompt(5 * C + 10, seed=501)
    pin, lease = _fill_and_pin(server.url, 1)
    counted = _counters(llm, server.url)
    stop = threading.Event()
    watcher = _release_on_first_no_space(pin, lease, stop)
    before = _stats(server.url)
    try:
        cold = _run(llm, prompt, "save-outcome-1")
    finally:
        stop.set()
        watcher.join(60)
        pin.close()
    after = _stats(server.url)
    assert after["puts_no_space"] - before["puts_no_space"] >= 2  # attention and state of chunk 0 at least
    llm.reset_prefix_cache()
    reloaded = _run(llm, prompt, "save-outcome-1")
    assert cold[2] == 0
    assert reloaded[2] == 5 * C
    assert reloaded[0] == cold[0] and reloaded[1] == cold[1]
    got = _delta(_counters(llm, server.url), counted)
    stored = _stats(server.url)["puts_stored"] - before["puts_stored"]
    assert got["saved_objects"] == stored > 0, (got, stored)
    assert got["saved_bytes"] > 0 and got["loaded_objects"] > 0 and got["loaded_bytes"] > 0
    assert got["save_failures"] >= 2
    assert got["saves_reported_failed"] == got["save_failures"]
    assert got["saves_corrected"] >= 1
    assert got["load_failures"] == 0


def test_saves_that_never_find_space_are_given_up_and_outputs_stay_cold_equal(llm, server):
    """The pin is never released: each hole is retried a bounded number of times (with a
    back-off), then the request's saves are given up (or lost, if it finished first).
    Nothing stalls, no output changes, and the engine's counters say so."""
    prompt = _prompt(3 * C + 10, seed=502)
    pin, lease = _fill_and_pin(server.url, 2)
    counted = _counters(llm, server.url)
    before = _stats(server.url)
    cold = _run(llm, prompt, "save-outcome-2")  # it returns: nothing stalls (a hang is pytest-timeout's)
    _settled_puts(server.url)  # its last saves may still be on their way when vLLM answers
    after = _stats(server.url)
    refused = after["puts_no_space"] - before["puts_no_space"]
    # 3 chunks x 2 attention object groups (MLA latent, indexer cache) + 3 state objects on
    # the first attempt; at most 6 retries (MAX_SAVE_RETRIES) of the 6 attention objects
    # beyond that.
    assert 9 <= refused <= 9 + 6 * 6, refused
    llm.reset_prefix_cache()
    again = _run(llm, prompt, "save-outcome-2")
    assert again[2] == 0  # nothing landed, so nothing to resume
    assert again[0] == cold[0] and again[1] == cold[1]
    got = _delta(_counters(llm, server.url), counted)
    assert got["saved_objects"] == 0
    assert got["save_failures"] >= 6
    assert got["saves_reported_failed"] == got["save_failures"]
    assert got["saves_given_up"] + got["saves_lost"] >= 1
    assert pin.release(lease)
    pin.close()
