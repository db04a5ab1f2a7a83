"""The PD proxy (validation/pd_proxy.py, issue 34) in front of real ``vllm serve``
instances of the tiny GLM-5.3-Flash sharing one real glm-cache-server: a prefill instance
(``kv_role`` ``kv_producer``) and a decode instance (``kv_consumer``).

What is shown, against the engines (marked ``engine``; one prefill and one decode engine,
module-scoped, started together):

* the prefill instance is sent the prompt without its last token and ``do_remote_decode``:
  its own usage reports ``N - 1`` prompt tokens, and its request log shows
  ``max_tokens=1`` and ``kv_transfer_params {'do_remote_decode': True}``;
* the decode instance is sent the whole prompt and what the prefill returned (or
  ``{"do_remote_prefill": true}``), and its greedy tokens, streamed or not, from token ids
  or text, equal one instance's for the same prompt (the prefill engine, asked directly
  under another salt, computing the prompt itself);
* what the decode instance did not compute came from the server: with the hand-off
  (the prefill returned ``kv_transfer_params``) it resumes ``N - 1`` tokens, computes one;
  without, the chunks' strict prefix ``C * floor((N - 1) / C)``; vLLM's external-hit
  counter on the decode engine grows by as much;
* a one-token prompt goes to the decode instance alone; an engine's own 400 (a token id
  outside the vocabulary) comes back as it was: the prefill's, and then nothing is sent to
  the decode instance, or, when the bad id is the last (which only the decode instance
  sees), the decode's.

Without engines: the proxy answers 400 to hostile bodies before it sends anything (its
upstreams are closed ports, so a body that got through would be a 502), and keeps serving.
"""

from __future__ import annotations

import json
import random
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.engines import random_prompt
from validation.pd_proxy import MAX_PROMPT_TOKENS, BadRequest, PdProxy, check_body, decode_params, prefill_body

C = 128
MAX_TOKENS = 16


def _post(url: str, data: bytes, timeout_s: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# -- without engines -----------------------------------------------------------------------

HOSTILE = [
    b"{", b"[" * 200_000, b"\xff\xfe\x00", b"null", b"[]", b'"prompt"', b"1e999",
    json.dumps({}).encode(),
    json.dumps({"prompt": []}).encode(),
    json.dumps({"prompt": ""}).encode(),
    json.dumps({"prompt": [1, True, 3]}).encode(),
    json.dumps({"prompt": [1, -2, 3]}).encode(),
    json.dumps({"prompt": [1, 2**40]}).encode(),
    json.dumps({"prompt": [1, 2.5]}).encode(),
    json.dumps({"prompt": [[1, 2], [3, 4]]}).encode(),
    json.dumps({"prompt": ["a", "b"]}).encode(),
    json.dumps({"prompt": {"ids": [1]}}).encode(),
    json.dumps({"prompt": 7}).encode(),
    json.dumps({"prompt": [1] * (MAX_PROMPT_TOKENS + 1)}).encode(),
    json.dumps({"prompt": [1, 2], "max_tokens": "16"}).encode(),
    json.dumps({"prompt": [1, 2], "max_tokens": 0}).encode(),
    json.dumps({"prompt": [1, 2], "max_tokens": True}).encode(),
    json.dumps({"prompt": [1, 2], "stream": "yes"}).encode(),
    json.dumps({"prompt": [1, 2], "n": 10_000}).encode(),
    json.dumps({"prompt": [1, 2], "model": ["m"]}).encode(),
    json.dumps({"prompt": [1, 2], "cache_salt": "s" * 10_000}).encode(),
    json.dumps({"prompt": [1, 2], "kv_transfer_params": {"do_remote_prefill": True}}).encode(),
    json.dumps({"prompt": [1, 2], "truncate_prompt_tokens": 1}).encode(),
    json.dumps({"prompt": [1, 2], "prompt_embeds": "AAAA"}).encode(),
    b'{"prompt": [1, 2], "pad": "' + b"x" * (9 << 20) + b'"}',
]


def test_hostile_bodies_get_400_before_anything_is_sent():
    """Upstreams on a closed port: a body the checks let through would be a 502."""
    with PdProxy("http://127.0.0.1:9", "http://127.0.0.1:9") as proxy:
        for body in HOSTILE:
            status, answer = _post(proxy.url + "/v1/completions", body)
            assert status == 400, (body[:80], status, answer)
            assert answer["error"]["code"] == 400 and answer["error"]["message"]
        assert proxy.records() == []  # none reached the PD path
        # still serving: a valid body goes to the (absent) prefill instance: 502, not a crash
        status, answer = _post(proxy.url + "/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode())
        assert status == 502 and "prefill" in answer["error"]["message"]
        status, answer = _post(proxy.url + "/v1/completions", json.dumps({"prompt": "some text"}).encode())
        assert status == 502 and "tokenize" in answer["error"]["message"]
        assert _get(proxy.url + "/health") == (503, {"prefill": False, "decode": False})
        (rec, text_rec) = proxy.records()
        assert rec["prompt_tokens"] == 3 and rec["prefill_sent_params"] == {"do_remote_decode": True}
        assert rec["decode_status"] is None and text_rec["text_prompt"] and text_rec["prefill_status"] is None


def test_check_body_and_the_two_requests():
    assert check_body({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert check_body({"prompt": "hi", "max_tokens": None, "stream": True}) == "hi"
    with pytest.raises(BadRequest):
        check_body({"prompt": [5, 6, 7]}, max_prompt_tokens=2)
    body = {"model": "model", "prompt": [5, 6, 7], "max_tokens": 32, "stream": True, "temperature": 0.0,
            "min_tokens": 8, "cache_salt": "s", "stream_options": {"include_usage": True}, "logprobs": 5}
    # the prefill: T[:-1], one token, not streamed, do_remote_decode; the salt and model kept
    # (they name what is cached), sampling fields dropped (min_tokens 8 > max_tokens 1 would be a 400)
    assert prefill_body(body, [5, 6, 7]) == {"model": "model", "cache_salt": "s", "prompt": [5, 6],
                                             "max_tokens": 1, "stream": False,
                                             "kv_transfer_params": {"do_remote_decode": True}}
    assert decode_params(None) == decode_params({}) == decode_params("x") == {"do_remote_prefill": True}
    returned = {"do_remote_prefill": True, "glm_handoff": True, "remote_prefill_cached_tokens": 0}
    assert decode_params(returned) == returned
    assert decode_params(returned, decode_usage=True) == {"do_remote_prefill": True, "glm_handoff": True}


# -- against real engines ------------------------------------------------------------------

def _role_config(server_url: str, role: str) -> str:
    from validation.serving import connector_config

    config = json.loads(connector_config(server_url))
    config["kv_role"] = role
    return json.dumps(config)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    from glm5next_plugin.tiny_checkpoint import ensure_checkpoint
    from testing.server_process import ServerProcess
    from validation.serving import VllmServer, complete

    tmp = tmp_path_factory.mktemp("pd_proxy")
    ckpt = ensure_checkpoint(tmp / "glm5next-tiny")
    args = ("--enforce-eager", "--max-num-batched-tokens", str(C), "--prefix-cache-retention-interval", str(C),
            "--dtype", "float32", "--max-num-seqs", "4", "--enable-log-requests")
    with ServerProcess("--separate-object-groups", "--chunk-size", str(C), "--l1-size-gb", "1") as srv:
        engines = {role: VllmServer(ckpt, *args, kv_transfer_config=_role_config(srv.url, role), max_model_len=4096,
                                    env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, log_path=tmp / f"{role}.log")
                   for role in ("kv_producer", "kv_consumer")}
        try:
            for e in engines.values():  # the start-ups overlap
                e.launch()
            for e in engines.values():
                e.wait_ready(progress=False)
            prefill, decode = engines["kv_producer"], engines["kv_consumer"]
            with PdProxy(prefill.base_url, decode.base_url, decode_usage=True) as proxy:
                warm = random_prompt(C + 9, 99)  # the first request of each engine is slow
                complete(proxy.url, warm, 2, cache_salt="warm-pd")
                complete(prefill.base_url, warm, 2, cache_salt="warm-single")
                yield {"prefill": prefill, "decode": decode, "proxy": proxy, "server": srv}
        finally:
            for e in engines.values():
                e.stop()


def _external_hits(engine) -> float:
    from validation.serving import metric_sum, scrape_metrics

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


@pytest.mark.engine
@pytest.mark.parametrize("n", [3 * C + 50, 3 * C + 1, 2 * C])
def test_pd_streams_the_single_instance_greedy_tokens(pd, n):
    from validation.serving import complete

    prompt = random_prompt(n, 1000 + n)
    single = complete(pd["prefill"].base_url, prompt, MAX_TOKENS, cache_salt=f"single-{n}")
    hits0 = _external_hits(pd["decode"])
    out = complete(pd["proxy"].url, prompt, MAX_TOKENS, cache_salt=f"pd-{n}")
    hits1 = _external_hits(pd["decode"])
    record = pd["proxy"].records()[-1]

    assert single.cached_tokens == 0 and len(single.token_ids) == MAX_TOKENS
    assert out.token_ids == single.token_ids, f"length {n}"
    assert out.token_logprobs == pytest.approx(single.token_logprobs, abs=1e-4)
    # the prefill instance got T[:-1], one token, do_remote_decode (its own usage and log)
    assert record["prefill_status"] == 200 and record["prefill_prompt_tokens"] == n - 1
    line = _prefill_log_line(pd["prefill"], record["request_id"])
    assert "max_tokens=1," in line and "extra_args={'kv_transfer_params': {'do_remote_decode': True}}" in line
    # the decode instance got T and what the prefill returned
    assert out.prompt_tokens == n and record["prompt_tokens"] == n and record["decode_status"] == 200
    returned = record["prefill_returned_params"]
    expected_params = {k: v for k, v in returned.items() if k != "remote_prefill_cached_tokens"} if returned \
        else {"do_remote_prefill": True}
    assert record["decode_sent_params"] == expected_params and expected_params["do_remote_prefill"] is True
    # what it did not compute came from the server
    assert out.cached_tokens == _expected_resume(n, record) == hits1 - hits0
    assert 0 < record["ttft_ms"] <= record["total_ms"]


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "cloud", "seven", "market", "quiet", "lamp", "north", "paper",
             "green", "window", "salt", "engine", "moss", "copper"]
    return " ".join(rng.choice(vocab) for _ in range(words))


@pytest.mark.engine
def test_pd_text_prompt_not_streamed(pd):
    """A text prompt is tokenized by the prefill instance; the decode answer comes back whole."""
    text = _text(300, 5)
    body = {"model": "model", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    status, single = _post(pd["prefill"].base_url + "/v1/completions",
                           json.dumps({**body, "cache_salt": "text-single"}).encode())
    assert status == 200
    status, out = _post(pd["proxy"].url + "/v1/completions", json.dumps({**body, "cache_salt": "text-pd"}).encode())
    assert status == 200, out
    record = pd["proxy"].records()[-1]
    n = single["usage"]["prompt_tokens"]
    assert n > 2 * C and record["text_prompt"] and record["prompt_tokens"] == n
    assert out["choices"][0]["text"] == single["choices"][0]["text"] and out["usage"]["completion_tokens"] == MAX_TOKENS
    assert out["usage"]["prompt_tokens"] == n and record["prefill_prompt_tokens"] == n - 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == _expected_resume(n, record)


@pytest.mark.engine
def test_one_token_prompt_and_engine_errors(pd):
    from validation.serving import complete

    before = len(pd["proxy"].records())
    out = complete(pd["proxy"].url, [77], 4, cache_salt="one")
    single = complete(pd["prefill"].base_url, [77], 4, cache_salt="one-single")
    record = pd["proxy"].records()[before]
    assert out.token_ids == single.token_ids and len(out.token_ids) == 4
    assert record["prefill_status"] is None and record["decode_sent_params"] is None and record["decode_status"] == 200
    # a token id outside the vocabulary: the prefill engine's own 400, and no decode request
    status, answer = _post(pd["proxy"].url + "/v1/completions",
                           json.dumps({"model": "model", "prompt": [5, 10**6, 7], "max_tokens": 4}).encode())
    record = pd["proxy"].records()[-1]
    assert status == 400 and re.search(r"token", json.dumps(answer), re.I)
    assert record["prefill_status"] == 400 and record["decode_status"] is None
    # ... as the last token, which only the decode instance sees: its 400
    status, answer = _post(pd["proxy"].url + "/v1/completions",
                           json.dumps({"model": "model", "prompt": [5, 6, 10**6], "max_tokens": 4}).encode())
    record = pd["proxy"].records()[-1]
    assert status == 400 and re.search(r"token", json.dumps(answer), re.I)
    assert record["prefill_status"] == 200 and record["decode_status"] == 400
    # a wrong model name: also the engine's answer (404), passed through
    status, _ = _post(pd["proxy"].url + "/v1/completions",
                      json.dumps({"model": "nope", "prompt": [5, 6, 7], "max_tokens": 4}).encode())
    assert status == 404
    assert _get(pd["proxy"].url + "/health") == (200, {"prefill": True, "decode": True})
