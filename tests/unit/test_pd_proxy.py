"""The PD proxy (validation/pd_proxy.py, issue 34) in front of real ``vllm serve``
instances of the tiny GLM-5.3-Flash sharing one real glm-cache-server: a prefill instance
(``kv_role`` ``kv_producer``) and a decode instance (``kv_consumer``).

What is shown against the engines is in tests/engine/test_pd_e2e.py (it shares that module's
prefill and decode engines):

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
import urllib.error
import urllib.request
from typing import Any

import pytest

from validation.pd_proxy import MAX_PROMPT_TOKENS, BadRequest, PdProxy, check_body, decode_params, prefill_body


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
