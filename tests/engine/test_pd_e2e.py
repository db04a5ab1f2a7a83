"""Prefill/decode disaggregation through one glm-cache-server (issue 34): roles and the hand-off.

One prefill ``vllm serve`` (``kv_role`` ``kv_producer``) and one decode ``vllm serve``
(``kv_consumer``) of the tiny GLM-5.3-Flash (float32, chunk 128 = vLLM's block) share a real
glm-cache-server. Requests follow vLLM's PD convention as its disaggregation proxy sends
them, with the last prompt token held back from the prefill (``connector.handoff``): the
prefill instance gets ``T[:-1]``, ``max_tokens`` 1 and ``{"do_remote_decode": true}``; the
decode instance gets ``T`` and the ``kv_transfer_params`` the prefill returned.

Shown: the decode instance computes one prompt token (vLLM's
``vllm:prompt_tokens_by_source{source="local_compute"}``) for prompts at and around chunk
boundaries and shorter than a chunk, and its greedy output equals a single instance's cold
run, first-token log-prob to float32 rounding (the cold run computes the tail in one pass,
the decode one token from the hand-off's state: the same math, summed in another order).
The producer never loads, the consumer never saves, each says so at start-up. A hand-off
missing (never prefilled), evicted (the server cleared) or under another salt (another
tenant's key space) gives a cold, correct decode (after at most ``timeout_s`` of asking
again where the prefill said it saved chunks). With MTP drafts on
(vLLM's defaults) no hand-off is made (the draft row before the last token would name the prefill's own sampled
token): the decode resumes at the strict prefix and its output is still a single instance's.

The decode leg is sent as soon as the prefill answers, as a proxy does: the decode side
waits (at most ``timeout_s``) for the prefill's saves, which travel after its response.
"""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import pytest

from testing.engines import random_prompt
from testing.server_process import ServerProcess
from tests.unit.test_pd_proxy import _get, _post  # the proxy's raw HTTP helpers (status, JSON)
from validation.serving import VllmServer, complete, metric_sum, post_json, scrape_metrics

pytestmark = pytest.mark.engine

C = 128
MAX_TOKENS = 8
# at and around chunk boundaries, and shorter than a chunk (no whole chunk: the hand-off only)
LENGTHS = (37, C + 1, C + 2, 2 * C - 1, 2 * C, 2 * C + 1, 3 * C + 50)
LP_TOL = 1e-4  # float32: the decode sums the tail's KDA recurrence in another order than a cold run


def _config(url: str, role: str) -> str:
    # timeout_s: how long the decode side waits for the prefill's saves (default 2 s). With
    # the other test lane's engine on the second core, the prefill's first saves of a run
    # have landed later than that (the decode then computed the whole prompt, correctly),
    # and beside a busy loop as well later than 10 s (fresh-clone runs at fb9e98e, 17056cc);
    # 60 s outlasts a stall of the whole machine (testing.engines.TIMEOUT_S).
    return json.dumps({"kv_connector": "GlmCacheConnector", "kv_role": role,
                       "kv_connector_extra_config": {"server": url, "timeout_s": 60.0}})


def _engines(ckpt, url: str, *extra: str) -> tuple[VllmServer, VllmServer]:
    args = ("--enforce-eager", "--max-num-batched-tokens", str(C), "--prefix-cache-retention-interval", str(C),
            "--dtype", "float32", "--max-num-seqs", "4", "--block-size", str(C), "--enable-log-requests", *extra)
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    prefill = VllmServer(ckpt, *args, kv_transfer_config=_config(url, "kv_producer"), max_model_len=4096, env=env)
    decode = VllmServer(ckpt, *args, kv_transfer_config=_config(url, "kv_consumer"), max_model_len=4096, env=env)
    for e in (prefill, decode):  # both start-ups overlap
        e.launch()
    for e in (prefill, decode):
        e.wait_ready(progress=False)
        # the first step after start-up names the weights; nothing is saved before (as in serving)
        complete(e.base_url, random_prompt(5, 5), max_tokens=1)
    return prefill, decode


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from glm5next_tiny import ensure_checkpoint

    path = tmp_path_factory.mktemp("pd") / "glm5next-tiny"
    ensure_checkpoint(path)
    return path


SERVER_ARGS = ("--chunk-size", str(C), "--l1-size-gb", "1")  # the server fixture's (conftest.py)


@pytest.fixture(scope="module")
def pd(ckpt, server):
    prefill, decode = _engines(ckpt, server.url)
    try:
        yield prefill, decode
    finally:
        for e in (prefill, decode):
            e.stop()


def _objects(server: ServerProcess) -> int:
    return int(server.status()["objects"])


def _computed(engine: VllmServer) -> float:
    return metric_sum(scrape_metrics(engine.base_url), "vllm:prompt_tokens_by_source_total", source="local_compute")


def _prefill(engine: VllmServer, prompt: list[int], salt: str | None = None) -> dict:
    """The proxy's first leg: the prompt less its last token, one token, do_remote_decode."""
    body = {"model": "model", "prompt": prompt[:-1], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"do_remote_decode": True}}
    if salt:
        body["cache_salt"] = salt
    return post_json(engine.base_url + "/v1/completions", body).get("kv_transfer_params") or {}


def _saves_landed(server: ServerProcess, before: int, timeout_s: float = 60.0) -> int:
    """Wait until the server holds more objects than ``before`` and the count has stayed put
    for half a second: vLLM answers the prefill leg before its asynchronous saves land, and
    a decode leg sent at once can look up first (CI saw the decode compute all its tokens).
    Returns the count; fails, saying so, when the saves have not landed within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = _objects(server)
        if now > before and now == last:
            return now
        assert time.monotonic() < deadline, (
            f"the prefill's saves did not land within {timeout_s}s: the server holds {now} objects, {before} before")
        last = now
        time.sleep(0.5)


def _decode(engine: VllmServer, prompt: list[int], params: dict, salt: str | None = None):
    """The proxy's second leg; returns (result, prompt tokens the decode instance computed)."""
    before = _computed(engine)
    out = complete(engine.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt=salt, kv_transfer_params=params)
    return out, _computed(engine) - before


def _cold(engine: VllmServer, prompt: list[int], tag: str):
    """A single instance's run: a salt nobody saved under (the consumer saves nothing)."""
    return complete(engine.base_url, prompt, max_tokens=MAX_TOKENS, cache_salt=f"cold-{tag}")


def _same(out, cold) -> None:
    assert out.token_ids == cold.token_ids
    assert out.token_logprobs[0] == pytest.approx(cold.token_logprobs[0], abs=LP_TOL)


def test_roles_named_at_start_up(pd):
    prefill, decode = pd
    assert "kv_role kv_producer: saves, never loads" in prefill.log()
    assert "kv_role kv_consumer: loads, never saves" in decode.log()


def test_decode_computes_only_the_last_prompt_token(pd, server):
    """The table of issue 34: decode-side computed prompt tokens per prompt length."""
    prefill, decode = pd
    table = []
    for n in LENGTHS:
        prompt = random_prompt(n, 1000 + n)
        cold = _cold(decode, prompt, str(n))
        params = _prefill(prefill, prompt)
        # a prefill ending on the grid needs no hand-off: the state there is a chunk's
        assert params.get("glm_handoff") is ((n - 1) % C != 0)
        out, computed = _decode(decode, prompt, params)
        table.append((n, computed))
        _same(out, cold)
    print("\ndecode-side computed prompt tokens:", table)
    assert table == [(n, 1) for n in LENGTHS]


def test_consumer_never_saves_producer_never_loads(pd, server):
    """A consumer computes a new prompt and saves none of it: once the producer's saves of
    another prompt (sent after it) have landed, the consumer, its prefix cache reset, finds
    nothing of its prompt on the server (no external hit), and its engine counts no object
    saved. The producer saves, and computes its prompt again rather than loading it."""
    prefill, decode = pd
    before = _objects(server)
    consumed = random_prompt(3 * C + 7, 77)
    _cold(decode, consumed, "consumer")  # a consumer computes a new prompt
    prompt = random_prompt(2 * C + 9, 78)
    complete(prefill.base_url, prompt, max_tokens=1)  # saved by the producer
    _saves_landed(server, before)
    assert decode.reset_prefix_cache()
    hits = _external_hits(decode)
    again = _cold(decode, consumed, "consumer")  # looked up on the server: not there
    assert again.cached_tokens == 0 and _external_hits(decode) == hits
    assert prefill.reset_prefix_cache()
    again = complete(prefill.base_url, prompt, max_tokens=1)
    assert again.cached_tokens == 0  # on the server, and not loaded
    samples = scrape_metrics(prefill.base_url)
    assert metric_sum(samples, "vllm:glm_cache_loaded_objects_total") == 0
    assert metric_sum(samples, "vllm:glm_cache_saved_objects_total") > 0
    assert metric_sum(scrape_metrics(decode.base_url), "vllm:glm_cache_saved_objects_total") == 0


@pytest.mark.parametrize("case", ["missing", "evicted", "other salt"])
def test_no_handoff_is_a_cold_correct_decode(pd, server, case):
    prefill, decode = pd
    n = 2 * C + 40
    prompt = random_prompt(n, {"missing": 1, "evicted": 2, "other salt": 3}[case])
    cold = _cold(decode, prompt, case)
    params = {"do_remote_prefill": True}
    if case != "missing":
        params = _prefill(prefill, prompt, salt="tenant-a" if case == "other salt" else None)
    if case == "evicted":
        post_json(server.http_url + "/cache/clear", {"force": True})
    # A decode told the prefill planned chunks asks again for them for at most its timeout_s,
    # then computes: that it returns at all is the point (a hang is pytest-timeout's).
    out, computed = _decode(decode, prompt, params, salt="tenant-b" if case == "other salt" else None)
    _same(out, cold)
    assert computed == n  # nothing of it on the server for this namespace: all computed


# -- through the proxy (validation/pd_proxy.py) --------------------------------------------

PROXY_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def proxied(pd):
    from validation.pd_proxy import PdProxy

    prefill, decode = pd
    with PdProxy(prefill.base_url, decode.base_url, decode_usage=True) as proxy:
        complete(proxy.url, random_prompt(C + 9, 99), 2, cache_salt="warm-pd")
        yield {"prefill": prefill, "decode": decode, "proxy": proxy}


def _external_hits(engine) -> float:
    return metric_sum(scrape_metrics(engine.base_url), "vllm:external_prefix_cache_hits_total")


def _expected_resume(n: int, record: dict[str, Any]) -> int:
    """What the decode instance loads for a prompt of ``n``: ``n - 1`` with the hand-off
    (the prefill returned parameters, not saying ``glm_handoff: false``), the chunks'
    strict prefix without (the same when ``n - 1`` is whole chunks)."""
    returned = record["prefill_returned_params"]
    handoff = bool(returned) and returned.get("glm_handoff") is not False
    return n - 1 if handoff else C * ((n - 1) // C)


def _prefill_log_line(prefill, request_id: str) -> str:
    lines = [ln for ln in prefill.log().splitlines() if f"Received request cmpl-{request_id}" in ln]
    assert len(lines) == 1, f"the prefill engine logged {len(lines)} requests {request_id}"
    return lines[0]


def _last_record(proxy) -> dict:
    """The proxy's record of the last request, once complete: the proxy writes ``total_ms``
    after the last byte has gone to the client, which may read the record first (fresh-clone
    CI, beside a busy loop: ``total_ms`` 0.0)."""
    deadline = time.monotonic() + 60
    while not proxy.records()[-1]["total_ms"]:
        assert time.monotonic() < deadline, proxy.records()[-1]
        time.sleep(0.01)
    return proxy.records()[-1]


@pytest.mark.parametrize("n", [3 * C + 50, 3 * C + 1, 2 * C])
def test_pd_streams_the_single_instance_greedy_tokens(proxied, n):
    prompt = random_prompt(n, 1000 + n)
    single = complete(proxied["prefill"].base_url, prompt, PROXY_MAX_TOKENS, cache_salt=f"single-{n}")
    hits0 = _external_hits(proxied["decode"])
    out = complete(proxied["proxy"].url, prompt, PROXY_MAX_TOKENS, cache_salt=f"pd-{n}")
    hits1 = _external_hits(proxied["decode"])
    record = _last_record(proxied["proxy"])

    assert single.cached_tokens == 0 and len(single.token_ids) == PROXY_MAX_TOKENS
    assert out.token_ids == single.token_ids, f"length {n}"
    assert out.token_logprobs == pytest.approx(single.token_logprobs, abs=1e-4)
    # the prefill instance got T[:-1], one token, do_remote_decode (its own usage and log)
    assert record["prefill_status"] == 200 and record["prefill_prompt_tokens"] == n - 1
    line = _prefill_log_line(proxied["prefill"], record["request_id"])
    assert "max_tokens=1," in line and "extra_args={'kv_transfer_params': {'do_remote_decode': True}}" in line
    # the decode instance got T and what the prefill returned
    assert out.prompt_tokens == n and record["prompt_tokens"] == n and record["decode_status"] == 200
    returned = record["prefill_returned_params"]
    expected_params = {k: v for k, v in returned.items() if k != "remote_prefill_cached_tokens"} if returned \
        else {"do_remote_prefill": True}
    assert record["decode_sent_params"] == expected_params and "glm_chunks" in expected_params
    # what it did not compute came from the server
    assert out.cached_tokens == _expected_resume(n, record) == hits1 - hits0
    assert 0 < record["ttft_ms"] <= record["total_ms"]


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "cloud", "seven", "market", "quiet", "lamp", "north", "paper",
             "green", "window", "salt", "engine", "moss", "copper"]
    return " ".join(rng.choice(vocab) for _ in range(words))


def test_pd_text_prompt_not_streamed(proxied):
    """A text prompt is tokenized by the prefill instance; the decode answer comes back whole."""
    text = _text(300, 5)
    body = {"model": "model", "prompt": text, "max_tokens": PROXY_MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, single = _post(proxied["prefill"].base_url + "/v1/completions",
                           json.dumps({**body, "cache_salt": "text-single"}).encode())
    assert status == 200
    status, out = _post(proxied["proxy"].url + "/v1/completions", json.dumps({**body, "cache_salt": "text-pd"}).encode())
    assert status == 200, out
    record = _last_record(proxied["proxy"])
    n = single["usage"]["prompt_tokens"]
    assert n > 2 * C and record["text_prompt"] and record["prompt_tokens"] == n
    assert out["choices"][0]["text"] == single["choices"][0]["text"] and out["usage"]["completion_tokens"] == PROXY_MAX_TOKENS
    assert out["usage"]["prompt_tokens"] == n and record["prefill_prompt_tokens"] == n - 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == _expected_resume(n, record)


def test_one_token_prompt_and_engine_errors(proxied):
    before = len(proxied["proxy"].records())
    out = complete(proxied["proxy"].url, [77], 4, cache_salt="one")
    single = complete(proxied["prefill"].base_url, [77], 4, cache_salt="one-single")
    record = proxied["proxy"].records()[before]
    assert out.token_ids == single.token_ids and len(out.token_ids) == 4
    assert record["prefill_status"] is None and record["decode_sent_params"] is None and record["decode_status"] == 200
    # a token id outside the vocabulary: the prefill engine's own 400, and no decode request
    status, answer = _post(proxied["proxy"].url + "/v1/completions",
                           json.dumps({"model": "model", "prompt": [5, 10**6, 7], "max_tokens": 4}).encode())
    record = _last_record(proxied["proxy"])
    assert status == 400 and re.search(r"token", json.dumps(answer), re.I)
    assert record["prefill_status"] == 400 and record["decode_status"] is None
    # ... as the last token, which only the decode instance sees: its 400
    status, answer = _post(proxied["proxy"].url + "/v1/completions",
                           json.dumps({"model": "model", "prompt": [5, 6, 10**6], "max_tokens": 4}).encode())
    record = _last_record(proxied["proxy"])
    assert status == 400 and re.search(r"token", json.dumps(answer), re.I)
    assert record["prefill_status"] == 200 and record["decode_status"] == 400
    # a wrong model name: also the engine's answer (404), passed through
    status, _ = _post(proxied["proxy"].url + "/v1/completions",
                      json.dumps({"model": "nope", "prompt": [5, 6, 7], "max_tokens": 4}).encode())
    assert status == 404
    assert _get(proxied["proxy"].url + "/health") == (200, {"prefill": True, "decode": True})


def test_mtp_drafts_outputs_are_a_single_instances(ckpt, server, pd):
    """vLLM's default MTP settings on both instances: no hand-off (the draft layer's row
    before the last token depends on the prefill's own sampled token); the decode resumes at
    the strict prefix, outputs as a single instance's."""
    for e in pd:  # at most two engines at once on two cores
        e.stop()
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    prefill, decode = _engines(ckpt, server.url, "--speculative-config", mtp)
    try:
        for n in (C + 2, 2 * C + 1):
            prompt = random_prompt(n, 2000 + n)
            cold = _cold(decode, prompt, f"mtp-{n}")
            before = _objects(server)
            params = _prefill(prefill, prompt)
            assert params.get("glm_handoff") is False
            _saves_landed(server, before)  # no hand-off: the decode resumes from what the prefill saved
            out, computed = _decode(decode, prompt, params)
            assert out.token_ids == cold.token_ids
            assert out.token_logprobs[0] == pytest.approx(cold.token_logprobs[0], abs=LP_TOL)
            # the prefill's last chunk has a key only if the token after it is in its prompt
            # (the lookahead), which the held-back last token is not when N - 1 is on the grid
            assert computed == n - C * ((n - 2) // C)
    finally:
        for e in (prefill, decode):
            e.stop()
